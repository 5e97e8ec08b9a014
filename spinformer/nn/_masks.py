"""Attention masks shared by the attention modules."""

from __future__ import annotations

from typing import Optional

import jax.numpy as jnp
from jaxtyping import Array, Bool


def causal_mask(n: int, s: Optional[int] = None) -> Bool[Array, "n s"]:
    """Lower-triangular boolean mask: position i may see positions j ≤ i."""
    s = n if s is None else s
    return jnp.tril(jnp.ones((n, s), dtype=bool))


def combine_masks(
    n: int, s: int, causal: bool, mask: Optional[Bool[Array, "n s"]]
) -> Optional[Bool[Array, "n s"]]:
    """The conjunction of a causal mask (if `causal`) and a user mask (if given), or None."""
    if mask is not None and mask.shape != (n, s):
        raise ValueError(f"mask must have shape ({n}, {s}) (queries, keys); got {mask.shape}.")
    if causal:
        c = causal_mask(n, s)
        return c if mask is None else c & mask
    return mask
