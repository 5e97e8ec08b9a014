"""Standard multi-head scaled dot-product attention, the baseline every spin attention is
compared against."""

from __future__ import annotations

from typing import Optional

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from ._attention_diagnostics import Diagnostics
from ._heads import (check_heads, decode_scores, linear_maps, masked_softmax, mix_values,
                     project_heads, qk_scores)
from .._schema import register_attention


# The query/key maps define the attention pattern: they form the optimizer group "couplings".
@register_attention("softmax", help="standard scaled dot-product attention",
                    coupling_fields=("to_q", "to_k"))
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

    def __init__(self, dim: int, num_heads: int = 1, causal: bool = False,
                 use_bias: bool = False, *, key: PRNGKeyArray):
        check_heads("SoftmaxAttention", dim, num_heads)
        self.to_q, self.to_k, self.to_v, self.to_out = linear_maps(
            dim, use_bias, *jax.random.split(key, 4))
        self.dim, self.num_heads, self.causal = dim, num_heads, causal

    def __call__(self, x: Float[Array, "n d"], *, context: Optional[Float[Array, "s d"]] = None,
                 mask: Optional[Bool[Array, "n s"]] = None, state: None = None,
                 key: Optional[PRNGKeyArray] = None, return_diagnostics: bool = False):
        """**Arguments:**

        - `x`: tokens, shape `(n, d)`.
        - `context`: keys/values for cross-attention, shape `(s, d)`; defaults to `x`.
        - `mask`: boolean `(n, s)`, True where attention is allowed (combined with `causal`).
        - `state`, `key`: accepted for interface compatibility; unused.
        - `return_diagnostics`: also return `Diagnostics(weights=(H, n, s))`.

        **Returns:** `(n, d)`, or `((n, d), diagnostics)`.
        """
        del state, key
        scores, allowed = qk_scores("SoftmaxAttention", self.to_q, self.to_k, x, context, mask,
                                    num_heads=self.num_heads, causal=self.causal)
        weights = masked_softmax(scores, allowed)
        v_HxSxK = project_heads(self.to_v, x if context is None else context, self.num_heads)
        out = jax.vmap(self.to_out)(mix_values(weights, v_HxSxK))
        if return_diagnostics:
            return out, Diagnostics(weights=weights)
        return out

    # -- incremental decoding (see nn.decode_step) -----------------------------------------

    def decode_init(self, max_len: int, dtype=jnp.float32) -> dict:
        """An empty cache for `max_len` positions: keys and values `(H, max_len, D_h)`."""
        shape = (self.num_heads, max_len, self.dim // self.num_heads)
        return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}

    def prefill(self, x: Float[Array, "L d"]) -> tuple[Float[Array, "L d"], dict]:
        """Every position of a causal self-attention at once, and the decoding cache that
        `decode` would have built over the same `L` positions: `(y (L, d), cache)`, cache
        length L. Positions past the prompt are harmless: `decode` writes over them and
        never looks at positions after its own."""
        if not self.causal:
            raise ValueError("SoftmaxAttention.prefill: incremental decoding needs causal "
                             "attention; build the model with causal=True.")
        cache = {"k": project_heads(self.to_k, x, self.num_heads),
                 "v": project_heads(self.to_v, x, self.num_heads)}
        return self(x), cache

    def decode(self, x: Float[Array, " d"], cache: dict, pos: Int[Array, ""]
               ) -> tuple[Float[Array, " d"], dict]:
        """The output at position `pos` of a causal self-attention given the cached keys and
        values of positions `< pos`: `(y (d,), cache with position pos written)`. Equal to
        row `pos` of `__call__` on the whole prefix."""
        scores, visible, cache = decode_scores(self, x, cache, pos, self.causal)
        weights = masked_softmax(scores[:, None], visible[None])[:, 0]
        v = cache["v"].at[:, pos].set(self.to_v(x).reshape(self.num_heads, -1))
        out = self.to_out(jnp.einsum("hs,hsk->hk", weights, v).reshape(-1))
        return out, {**cache, "v": v}
