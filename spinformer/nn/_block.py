"""A pre-norm residual block: attention + optional feed-forward network."""

from __future__ import annotations

import dataclasses
from typing import Optional

import equinox as eqx
import jax
from jaxtyping import Array, Bool, Float, PRNGKeyArray

from ._attention_diagnostics import Diagnostics


class FeedForward(eqx.Module):
    """Two-layer position-wise MLP `Linear → GELU → Linear`, applied to one token `(d,)`."""

    lin1: eqx.nn.Linear
    lin2: eqx.nn.Linear

    def __init__(self, dim: int, hidden: int, *, key: PRNGKeyArray):
        k1, k2 = jax.random.split(key)
        self.lin1 = eqx.nn.Linear(dim, hidden, key=k1)
        self.lin2 = eqx.nn.Linear(hidden, dim, key=k2)

    def __call__(self, x: Float[Array, " d"]) -> Float[Array, " d"]:
        return self.lin2(jax.nn.gelu(self.lin1(x)))


class Block(eqx.Module):
    """`x + drop(attn(norm(x)))`, then `x + drop(ffn(norm(x)))` if the block has an FFN.

    With `norm=False` and no FFN the block is `x + attn(x)`: the Energy Transformer's block,
    whose attention normalises its tokens itself and whose Hopfield energy replaces the MLP
    (`EnergyTransformerAttention` returns x_T − x, so the block's output is x_T).

    **Arguments:**

    - `attention`: an attention module called as `attention(x, context=, mask=, state=, key=,
      return_diagnostics=)` returning an array shaped like `x` (e.g. `SoftmaxAttention`,
      `SpinAttention`).
    - `dim`: model width.
    - `ffn_hidden`: hidden width of the feed-forward network; 0 for no FFN.
    - `dropout`: dropout rate on both residual branches (active only when a `key` is passed).
    - `norm`: False leaves out both layer norms (the attention sees the residual stream).
    - `key`: PRNG key for the FFN initialisation.
    """

    attention: eqx.Module
    norm1: Optional[eqx.nn.LayerNorm]
    norm2: Optional[eqx.nn.LayerNorm]
    ffn: Optional[FeedForward]
    dropout: eqx.nn.Dropout

    def __init__(
        self,
        attention: eqx.Module,
        dim: int,
        ffn_hidden: int = 0,
        dropout: float = 0.0,
        *,
        norm: bool = True,
        key: PRNGKeyArray,
    ):
        self.attention = attention
        self.norm1 = eqx.nn.LayerNorm(dim) if norm else None
        if ffn_hidden > 0:
            self.norm2 = eqx.nn.LayerNorm(dim) if norm else None
            self.ffn = FeedForward(dim, ffn_hidden, key=key)
        else:
            self.norm2 = None
            self.ffn = None
        self.dropout = eqx.nn.Dropout(dropout)

    def attention_input(self, x: Float[Array, "n d"]) -> Float[Array, "n d"]:
        """What the attention sees: the normalised tokens (or `x` itself with `norm=False`)."""
        return x if self.norm1 is None else jax.vmap(self.norm1)(x)

    def __call__(self, x: Float[Array, "n d"], *, context: Optional[Float[Array, "s d"]] = None,
                 mask: Optional[Bool[Array, "n s"]] = None,
                 state: Optional[Float[Array, "n d"]] = None,
                 key: Optional[PRNGKeyArray] = None, return_diagnostics: bool = False):
        """**Arguments:** `x (n, d)`; `context`, `mask`, `state` (carried from the previous
        call's `diagnostics.state`) are passed to the attention; `key` enables dropout.

        **Returns:** `(n, d)`, or `((n, d), diagnostics of the attention)` with the block's
        output in `diagnostics.hidden`."""
        inference = key is None
        ka = kd1 = kd2 = None
        if key is not None:
            ka, kd1, kd2 = jax.random.split(key, 3)
        out = self.attention(
            self.attention_input(x),
            context=context,
            mask=mask,
            state=state,
            key=ka,
            return_diagnostics=return_diagnostics,
        )
        diag = None
        if return_diagnostics:
            out, diag = out
        x = x + self.dropout(out, key=kd1, inference=inference)
        if self.ffn is not None:
            y = jax.vmap(self.ffn)(x if self.norm2 is None else jax.vmap(self.norm2)(x))
            x = x + self.dropout(y, key=kd2, inference=inference)
        if return_diagnostics:
            if isinstance(diag, Diagnostics):
                diag = dataclasses.replace(diag, hidden=x)
            return x, diag
        return x
