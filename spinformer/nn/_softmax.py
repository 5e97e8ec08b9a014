"""Standard multi-head scaled dot-product attention, the baseline every spin attention is
compared against."""

from __future__ import annotations

from typing import ClassVar, Optional

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, PRNGKeyArray

from ._masks import combine_masks


class SoftmaxAttention(eqx.Module):
    """Multi-head softmax attention (Vaswani et al.), one example per call.

    **Arguments:**

    - `dim`: model width D (input and output).
    - `num_heads`: number of heads H; D must be divisible by H.
    - `causal`: if True, token i attends only to tokens j ≤ i (self-attention only).
    - `use_bias`: biases on the q/k/v/out projections.
    - `key`: PRNG key for the initialisation.
    """

    to_q: eqx.nn.Linear
    to_k: eqx.nn.Linear
    to_v: eqx.nn.Linear
    to_out: eqx.nn.Linear
    dim: int = eqx.field(static=True)
    num_heads: int = eqx.field(static=True)
    causal: bool = eqx.field(static=True)

    # Parameter names that define the attention pattern (the "couplings"); the trainer may give
    # them their own learning rate.
    coupling_fields: ClassVar[tuple[str, ...]] = ("to_q", "to_k")

    def __init__(
        self,
        dim: int,
        num_heads: int = 1,
        causal: bool = False,
        use_bias: bool = False,
        *,
        key: PRNGKeyArray,
    ):
        if dim % num_heads:
            raise ValueError(
                f"SoftmaxAttention: dim={dim} is not divisible by num_heads={num_heads}; "
                "choose num_heads dividing dim."
            )
        kq, kk, kv, ko = jax.random.split(key, 4)
        self.to_q = eqx.nn.Linear(dim, dim, use_bias=use_bias, key=kq)
        self.to_k = eqx.nn.Linear(dim, dim, use_bias=use_bias, key=kk)
        self.to_v = eqx.nn.Linear(dim, dim, use_bias=use_bias, key=kv)
        self.to_out = eqx.nn.Linear(dim, dim, use_bias=use_bias, key=ko)
        self.dim = dim
        self.num_heads = num_heads
        self.causal = causal

    def __call__(
        self,
        x: Float[Array, "n d"],
        *,
        context: Optional[Float[Array, "s d"]] = None,
        mask: Optional[Bool[Array, "n s"]] = None,
        state: None = None,
        key: Optional[PRNGKeyArray] = None,
        return_diagnostics: bool = False,
    ):
        """**Arguments:**

        - `x`: tokens, shape `(n, d)`.
        - `context`: keys/values for cross-attention, shape `(s, d)`; defaults to `x`.
        - `mask`: boolean `(n, s)`, True where attention is allowed (combined with `causal`).
        - `state`, `key`: accepted for interface compatibility; unused.
        - `return_diagnostics`: also return `{"couplings": (H, n, s) attention weights}`.

        **Returns:** `(n, d)`, or `((n, d), diagnostics)`.
        """
        del state, key
        ctx = x if context is None else context
        _check_shapes("SoftmaxAttention", x, ctx, self.dim)
        n, s = x.shape[0], ctx.shape[0]
        h = self.num_heads
        q_HxNxK = jax.vmap(self.to_q)(x).reshape(n, h, -1).transpose(1, 0, 2)
        k_HxSxK = jax.vmap(self.to_k)(ctx).reshape(s, h, -1).transpose(1, 0, 2)
        v_HxSxK = jax.vmap(self.to_v)(ctx).reshape(s, h, -1).transpose(1, 0, 2)
        scores = jnp.einsum("hnk,hsk->hns", q_HxNxK, k_HxSxK) / jnp.sqrt(q_HxNxK.shape[-1])
        allowed = combine_masks(n, s, self.causal and context is None, mask)
        if allowed is not None:
            scores = jnp.where(allowed, scores, jnp.finfo(scores.dtype).min)
        weights = jax.nn.softmax(scores, axis=-1)
        out = jnp.einsum("hns,hsk->nhk", weights, v_HxSxK).reshape(n, self.dim)
        out = jax.vmap(self.to_out)(out)
        if return_diagnostics:
            return out, {"couplings": weights}
        return out


def _check_shapes(name, x, ctx, dim):
    if x.ndim != 2 or x.shape[-1] != dim:
        raise ValueError(
            f"{name}: x must have shape (n_tokens, {dim}); got {x.shape}. Modules handle one "
            "example: use jax.vmap(module)(x) for a batch."
        )
    if ctx.ndim != 2 or ctx.shape[-1] != dim:
        raise ValueError(f"{name}: context must have shape (s, {dim}); got {ctx.shape}.")
