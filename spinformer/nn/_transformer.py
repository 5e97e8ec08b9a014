"""Stacked transformers (blocks built with `eqx.filter_vmap`, applied with `lax.scan`) and
task heads."""

from __future__ import annotations

from typing import Any, Callable, Optional, Union

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from ._block import Block
from ._softmax import SoftmaxAttention


def _attention_registry() -> dict[str, Callable[..., eqx.Module]]:
    from ._boltzmann import BoltzmannAttention
    from ._spin import SpinAttention

    return {"softmax": SoftmaxAttention, "spin": SpinAttention, "boltzmann": BoltzmannAttention}


ATTENTIONS = ("softmax", "spin", "boltzmann")


def resolve_attention(attention: Union[str, Callable[..., eqx.Module]]):
    """Map an attention name (`"softmax"`, `"spin"`, `"boltzmann"`) to its class; callables
    pass through."""
    if callable(attention):
        return attention
    reg = _attention_registry()
    if attention not in reg:
        raise ValueError(f"unknown attention {attention!r}; choose one of {sorted(reg)}.")
    return reg[attention]


class Transformer(eqx.Module):
    """Token embedding + learned positions + `depth` identical blocks + final LayerNorm.

    The blocks are created with `eqx.filter_vmap` (their parameters stacked on a leading
    `depth` axis) and applied with `jax.lax.scan`, so compile time does not grow with depth.

    **Arguments:**

    - `vocab_size`: number of input token ids.
    - `dim`: model width D.
    - `depth`: number of blocks.
    - `num_heads`: attention heads per block.
    - `max_len`: longest sequence (size of the positional embedding).
    - `attention`: `"softmax"`, `"spin"`, `"boltzmann"`, or a callable
      `attention(dim=, num_heads=, causal=, key=, **attention_kwargs) -> module` (classes
      with a true class attribute `takes_max_len` also get `max_len=`).
    - `attention_kwargs`: extra keyword arguments for the attention constructor
      (e.g. `{"beta": 1.0, "update": "tap"}` for `SpinAttention`).
    - `causal`: causal self-attention (token i sees j ≤ i) in every block.
    - `ffn_hidden`: hidden width of each block's feed-forward network; 0 for none.
    - `dropout`: dropout rate (active only when a `key` is passed to `__call__`).
    - `key`: PRNG key.
    """

    embed: eqx.nn.Embedding
    pos_embed: Float[Array, "max_len d"]
    blocks: Block
    norm: eqx.nn.LayerNorm
    depth: int = eqx.field(static=True)
    causal: bool = eqx.field(static=True)

    def __init__(
        self,
        vocab_size: int,
        dim: int,
        depth: int,
        num_heads: int = 1,
        max_len: int = 512,
        attention: Union[str, Callable[..., eqx.Module]] = "softmax",
        attention_kwargs: Optional[dict[str, Any]] = None,
        causal: bool = False,
        ffn_hidden: int = 0,
        dropout: float = 0.0,
        *,
        key: PRNGKeyArray,
    ):
        if depth < 1:
            raise ValueError(f"Transformer: depth={depth} must be >= 1.")
        cls = resolve_attention(attention)
        kwargs = dict(attention_kwargs or {})
        if getattr(cls, "takes_max_len", False):
            kwargs.setdefault("max_len", max_len)
        ke, kp, kb = jax.random.split(key, 3)

        def make_block(k):
            ka, kf = jax.random.split(k)
            attn = cls(dim=dim, num_heads=num_heads, causal=causal, key=ka, **kwargs)
            return Block(attn, dim, ffn_hidden=ffn_hidden, dropout=dropout, key=kf)

        self.embed = eqx.nn.Embedding(vocab_size, dim, key=ke)
        self.pos_embed = 0.02 * jax.random.normal(kp, (max_len, dim))
        self.blocks = eqx.filter_vmap(make_block)(jax.random.split(kb, depth))
        self.norm = eqx.nn.LayerNorm(dim)
        self.depth = depth
        self.causal = causal

    def __call__(
        self,
        tokens: Int[Array, " n"],
        *,
        context: Optional[Float[Array, "s d"]] = None,
        mask: Optional[Bool[Array, "n s"]] = None,
        key: Optional[PRNGKeyArray] = None,
        return_diagnostics: bool = False,
    ):
        """**Arguments:**

        - `tokens`: integer ids, shape `(n,)`, n ≤ `max_len`.
        - `context`: optional `(s, d)` context for cross-attention in every block.
        - `mask`: optional boolean `(n, s)` attention mask.
        - `key`: PRNG key; enables dropout (training). None means inference.
        - `return_diagnostics`: also return the blocks' diagnostics, stacked over layers
          (leading axis `depth`).

        **Returns:** hidden states `(n, d)`, or `((n, d), diagnostics)`.
        """
        n = tokens.shape[0]
        if tokens.ndim != 1:
            raise ValueError(
                f"Transformer: tokens must have shape (n,); got {tokens.shape}. Use "
                "jax.vmap(model)(tokens) for a batch."
            )
        if n > self.pos_embed.shape[0]:
            raise ValueError(
                f"Transformer: sequence length {n} exceeds max_len={self.pos_embed.shape[0]}; "
                "build the model with a larger max_len."
            )
        x = jax.vmap(self.embed)(tokens) + self.pos_embed[:n]
        dynamic, static = eqx.partition(self.blocks, eqx.is_array)
        keys = None if key is None else jax.random.split(key, self.depth)

        def layer(h, xs):
            params, k = xs
            block = eqx.combine(params, static)
            out = block(
                h, context=context, mask=mask, key=k, return_diagnostics=return_diagnostics
            )
            if return_diagnostics:
                return out[0], out[1]
            return out, None

        x, diags = jax.lax.scan(layer, x, (dynamic, keys))
        x = jax.vmap(self.norm)(x)
        if return_diagnostics:
            return x, diags
        return x


def _unroll_call(model: Transformer, tokens, **kwargs):
    """Reference: apply the stacked blocks with a Python loop (used by the tests)."""
    x = jax.vmap(model.embed)(tokens) + model.pos_embed[: tokens.shape[0]]
    dynamic, static = eqx.partition(model.blocks, eqx.is_array)
    for i in range(model.depth):
        block = eqx.combine(jax.tree.map(lambda a: a[i], dynamic), static)
        x = block(x, **kwargs)
    return jax.vmap(model.norm)(x)


def _head_call(transformer, readout, pool, tokens, context, mask, key, return_diagnostics):
    out = transformer(
        tokens, context=context, mask=mask, key=key, return_diagnostics=return_diagnostics
    )
    h, diag = out if return_diagnostics else (out, None)
    if pool:
        logits = readout(jnp.mean(h, axis=0))
    else:
        logits = jax.vmap(readout)(h)
    return (logits, diag) if return_diagnostics else logits


_CALL_DOC = """**Arguments:** `tokens (n,)` integer ids; `context`, `mask`, `key`,
        `return_diagnostics` as in `Transformer.__call__`.

        **Returns:** logits{shape}, or `(logits, diagnostics)`."""


class CausalLM(eqx.Module):
    """A causal language model: `tokens (n,) -> next-token logits (n, vocab_size)`.

    **Arguments:** as `Transformer` (always causal; no `causal` argument).
    """

    transformer: Transformer
    readout: eqx.nn.Linear

    def __init__(self, vocab_size: int, dim: int, depth: int, num_heads: int = 1,
                 max_len: int = 512, attention="softmax", attention_kwargs=None,
                 ffn_hidden: int = 0, dropout: float = 0.0, *, key: PRNGKeyArray):
        kt, kh = jax.random.split(key)
        self.transformer = Transformer(
            vocab_size, dim, depth, num_heads=num_heads, max_len=max_len, attention=attention,
            attention_kwargs=attention_kwargs, causal=True, ffn_hidden=ffn_hidden,
            dropout=dropout, key=kt,
        )
        self.readout = eqx.nn.Linear(dim, vocab_size, key=kh)

    def __call__(self, tokens: Int[Array, " n"], *, context=None, mask=None,
                 key: Optional[PRNGKeyArray] = None, return_diagnostics: bool = False):
        return _head_call(self.transformer, self.readout, False, tokens, context, mask, key,
                          return_diagnostics)

    __call__.__doc__ = _CALL_DOC.format(shape=" `(n, vocab_size)`")


class Tagger(eqx.Module):
    """A per-position tagger: `tokens (n,) -> logits (n, num_classes)` (e.g. bracket
    matching, where the class of a closing bracket is the position of its opening bracket).

    **Arguments:** as `Transformer`, plus `num_classes`.
    """

    transformer: Transformer
    readout: eqx.nn.Linear

    def __init__(self, vocab_size: int, num_classes: int, dim: int, depth: int,
                 num_heads: int = 1, max_len: int = 512, attention="softmax",
                 attention_kwargs=None, causal: bool = False, ffn_hidden: int = 0,
                 dropout: float = 0.0, *, key: PRNGKeyArray):
        kt, kh = jax.random.split(key)
        self.transformer = Transformer(
            vocab_size, dim, depth, num_heads=num_heads, max_len=max_len, attention=attention,
            attention_kwargs=attention_kwargs, causal=causal, ffn_hidden=ffn_hidden,
            dropout=dropout, key=kt,
        )
        self.readout = eqx.nn.Linear(dim, num_classes, key=kh)

    def __call__(self, tokens: Int[Array, " n"], *, context=None, mask=None,
                 key: Optional[PRNGKeyArray] = None, return_diagnostics: bool = False):
        return _head_call(self.transformer, self.readout, False, tokens, context, mask, key,
                          return_diagnostics)

    __call__.__doc__ = _CALL_DOC.format(shape=" `(n, num_classes)`")


class Classifier(eqx.Module):
    """A sequence classifier: `tokens (n,) -> logits (num_classes,)` from the mean-pooled
    final hidden states.

    **Arguments:** as `Transformer`, plus `num_classes`.
    """

    transformer: Transformer
    readout: eqx.nn.Linear

    def __init__(self, vocab_size: int, num_classes: int, dim: int, depth: int,
                 num_heads: int = 1, max_len: int = 512, attention="softmax",
                 attention_kwargs=None, causal: bool = False, ffn_hidden: int = 0,
                 dropout: float = 0.0, *, key: PRNGKeyArray):
        kt, kh = jax.random.split(key)
        self.transformer = Transformer(
            vocab_size, dim, depth, num_heads=num_heads, max_len=max_len, attention=attention,
            attention_kwargs=attention_kwargs, causal=causal, ffn_hidden=ffn_hidden,
            dropout=dropout, key=kt,
        )
        self.readout = eqx.nn.Linear(dim, num_classes, key=kh)

    def __call__(self, tokens: Int[Array, " n"], *, context=None, mask=None,
                 key: Optional[PRNGKeyArray] = None, return_diagnostics: bool = False):
        return _head_call(self.transformer, self.readout, True, tokens, context, mask, key,
                          return_diagnostics)

    __call__.__doc__ = _CALL_DOC.format(shape=" `(num_classes,)`")
