"""The skeleton every attention shares: shape checks, the head split, scaled query-key scores
and masking. The attention modules keep their own `to_q`/`to_k`/`to_v` maps (so parameter paths
stay `attention.to_q`, ...) and call these functions with them."""

from __future__ import annotations

import math
from typing import Optional

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, PRNGKeyArray

from ..spins._common import matmul_nt_rt
from ._masks import combine_masks


def check_heads(name: str, dim: int, num_heads: int, min_head_dim: int = 1) -> None:
    """Raise a `ValueError` unless `num_heads` divides `dim` into heads of width
    `>= min_head_dim`."""
    if num_heads < 1 or dim % num_heads:
        raise ValueError(f"{name}: dim={dim} is not divisible by num_heads={num_heads}; "
                         "choose num_heads dividing dim.")
    if dim // num_heads < min_head_dim:
        raise ValueError(f"{name}: the head width D_h = dim/num_heads = {dim // num_heads} "
                         f"must be >= {min_head_dim}; use fewer heads.")


def linear_maps(dim: int, use_bias: bool, *keys: PRNGKeyArray) -> list[eqx.nn.Linear]:
    """One square `dim × dim` linear map per key (the q/k/v/out projections)."""
    return [eqx.nn.Linear(dim, dim, use_bias=use_bias, key=k) for k in keys]


def check_shapes(name: str, x: Array, ctx: Array, dim: int) -> None:
    """Raise a `ValueError` unless `x (n, dim)` and `ctx (s, dim)` are single examples."""
    if x.ndim != 2 or x.shape[-1] != dim:
        raise ValueError(
            f"{name}: x must have shape (n_tokens, {dim}); got {x.shape}. Modules handle one "
            "example: use jax.vmap(module)(x) for a batch."
        )
    if ctx.ndim != 2 or ctx.shape[-1] != dim:
        raise ValueError(f"{name}: context must have shape (s, {dim}); got {ctx.shape}.")


def split_heads(a: Float[Array, "n d"], num_heads: int) -> Float[Array, "h n dh"]:
    """`(n, H·D_h) -> (H, n, D_h)`: head h is the h-th slice of the last axis."""
    n = a.shape[0]
    return a.reshape(n, num_heads, -1).transpose(1, 0, 2)


def merge_heads(a: Float[Array, "h n dh"]) -> Float[Array, "n d"]:
    """The inverse of `split_heads`: `(H, n, D_h) -> (n, H·D_h)`."""
    H, n, dh = a.shape
    return a.transpose(1, 0, 2).reshape(n, H * dh)


def project_heads(linear: eqx.nn.Linear, a: Float[Array, "n d"], num_heads: int
                  ) -> Float[Array, "h n dh"]:
    """A linear map applied to every token, split into heads."""
    return split_heads(jax.vmap(linear)(a), num_heads)


def qk_scores(
    name: str,
    to_q: eqx.nn.Linear,
    to_k: eqx.nn.Linear,
    x: Float[Array, "n d"],
    context: Optional[Float[Array, "s d"]],
    mask: Optional[Bool[Array, "n s"]],
    *,
    num_heads: int,
    causal: bool,
) -> tuple[Float[Array, "h n s"], Optional[Bool[Array, "n s"]]]:
    """Scaled dot-product scores of queries `x` against keys `context` (default `x`), per head.

    **Arguments:**

    - `name`: the calling module's name, for error messages.
    - `to_q`, `to_k`: the query and key maps, `D -> D`.
    - `x`: queries `(n, D)`; `context`: keys `(s, D)`, or None for self-attention.
    - `mask`: boolean `(n, s)`, True where query i may see key j.
    - `num_heads`: H; `causal`: causal self-attention (ignored with a context).

    **Returns:** `scores (H, n, s) = q_h k_hᵀ / sqrt(D_h)` (unmasked) and the allowed pattern
    `(n, s)` — the causal mask (self-attention only) combined with `mask` — or None if every
    pair is allowed.
    """
    ctx = x if context is None else context
    check_shapes(name, x, ctx, to_q.in_features)
    q_HxNxK = project_heads(to_q, x, num_heads)
    k_HxSxK = project_heads(to_k, ctx, num_heads)
    scores = matmul_nt_rt(q_HxNxK, k_HxSxK) / math.sqrt(q_HxNxK.shape[-1])
    allowed = combine_masks(x.shape[0], ctx.shape[0], causal and context is None, mask)
    return scores, allowed


def masked_softmax(scores: Float[Array, "h n s"], allowed: Optional[Bool[Array, "n s"]]
                   ) -> Float[Array, "h n s"]:
    """Softmax over keys with the disallowed scores sent to the most negative float."""
    if allowed is not None:
        scores = jnp.where(allowed, scores, jnp.finfo(scores.dtype).min)
    return jax.nn.softmax(scores, axis=-1)


def mix_values(weights: Float[Array, "h n s"], v_HxSxK: Float[Array, "h s dh"]
               ) -> Float[Array, "n d"]:
    """Each head's weighted sum of values, heads concatenated: `(n, H·D_h)`."""
    return merge_heads(jnp.einsum("hns,hsk->hnk", weights, v_HxSxK))


def decode_scores(module, x: Float[Array, " d"], cache: dict, pos, causal: bool
                  ) -> tuple[Float[Array, "h s"], Bool[Array, " s"], dict]:
    """Incremental decoding: the scores `(H, max_len)` of the query `x` at position `pos`
    against the cached keys with the new key written at `pos`, the visible positions
    `(max_len,)` (those `<= pos`), and the cache with `k` updated. `module` has `to_q`,
    `to_k`, `num_heads`; only causal self-attention decodes incrementally."""
    name = type(module).__name__
    if not causal:
        raise ValueError(f"{name}: incremental decoding needs causal attention (each position "
                         "sees only earlier ones); build the model with causal=True.")
    if x.ndim != 1:
        raise ValueError(f"{name}.decode: x must be one token (d,); got {x.shape}.")
    H = module.num_heads
    q = module.to_q(x).reshape(H, -1)
    k = cache["k"].at[:, pos].set(module.to_k(x).reshape(H, -1))
    scores = jnp.einsum("hk,hsk->hs", q, k) / math.sqrt(q.shape[-1])
    visible = jnp.arange(k.shape[1]) <= pos
    return scores, visible, {**cache, "k": k}
