"""Parameter groups for the optimizer: the group "couplings" holds the parameters that define
an attention's couplings (the query/key maps that build attention weights or spin couplings,
Boltzmann attention's Ising J and K); they may get their own learning rate and weight decay."""

from __future__ import annotations

import jax
from jaxtyping import PyTree

from .._schema import get_attention


def _child(obj, key):
    if isinstance(key, jax.tree_util.GetAttrKey):
        return getattr(obj, key.name, None)
    if isinstance(key, (jax.tree_util.SequenceKey,)):
        return obj[key.idx]
    if isinstance(key, jax.tree_util.DictKey):
        return obj[key.key]
    return None


def param_labels(params: PyTree) -> PyTree:
    """Label each array leaf `"couplings"` or `"default"`; use with `optax.multi_transform`.

    A leaf is a coupling if it sits under a field named `attention` and, inside that module,
    under one of the `coupling_fields` its class was registered with (`register_attention`;
    softmax and spin attention: the query/key maps `to_q`, `to_k`; Boltzmann attention: the
    Ising couplings `J`, `K`, with their own learning rate LR_J as in Kim and Park §4.1).
    """

    def label(path, leaf):
        obj = params
        for i, key in enumerate(path):
            if getattr(key, "name", None) == "attention" and i + 1 < len(path):
                module = _child(obj, key)
                fields = get_attention(type(module)).coupling_fields
                if getattr(path[i + 1], "name", None) in fields:
                    return "couplings"
                return "default"
            obj = _child(obj, key)
            if obj is None:
                break
        return "default"

    return jax.tree_util.tree_map_with_path(label, params)
