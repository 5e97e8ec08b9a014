"""Parameter groups: which parameters are couplings (they may get their own learning rate)."""

from __future__ import annotations

import jax
from jaxtyping import PyTree

# Field names under which attention modules keep the maps that build their couplings
# (the class attribute `coupling_fields` of each attention module lists its own).
COUPLING_FIELDS = ("to_q", "to_k", "to_qk")


def param_labels(params: PyTree) -> PyTree:
    """Label each array leaf `"couplings"` (query/key maps inside an `attention` module) or
    `"default"`; use with `optax.multi_transform`."""

    def label(path, leaf):
        names = [getattr(p, "name", None) for p in path]
        if "attention" in names:
            after = names[names.index("attention") + 1:]
            if any(n in COUPLING_FIELDS for n in after):
                return "couplings"
        return "default"

    return jax.tree_util.tree_map_with_path(label, params)
