"""Stacked transformers (blocks built with `eqx.filter_vmap`, applied with `lax.scan`) and
the sequence models on top of them (language model, tagger, classifier)."""

from __future__ import annotations

from typing import Any, Callable, Literal, Optional, Union

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from ._block import Block
from ._literal import check_literal
from .._schema import get_attention


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
    - `attention`: a registered attention name (`"softmax"`, `"spin"`, `"boltzmann"`, or any
      added with `nn.register_attention`), a registered class or its `nn.get_attention`
      registration, or a callable
      `attention(dim=, num_heads=, causal=, key=, **attention_kwargs) -> module`. Classes
      registered with `takes_max_len=True` also get `max_len=`.
    - `attention_kwargs`: extra keyword arguments for the attention constructor
      (e.g. `{"beta": 1.0, "update": "tap"}` for `SpinAttention`).
    - `causal`: causal self-attention (token i sees j ≤ i) in every block.
    - `ffn_hidden`: hidden width of each block's feed-forward network; 0 for none.
    - `dropout`: dropout rate (active only when a `key` is passed to `__call__`).
    - `num_segments`: size of a learned segment embedding added to the token embeddings
      (e.g. 3 for padding / premise / hypothesis of a sentence pair); 0 for none.
    - `detach_layers`: stop gradients between blocks: each block after the first sees its
      input as a constant, so a loss on the final output trains only the last block (and
      the readout); used with per-layer local losses (`train.local_losses`), where each block
      learns from its own readout. The forward values are unchanged.
    - `key`: PRNG key.
    """

    embed: eqx.nn.Embedding
    pos_embed: Float[Array, "max_len d"]
    segment_embed: Optional[eqx.nn.Embedding]
    blocks: Block
    norm: eqx.nn.LayerNorm
    depth: int = eqx.field(static=True)
    causal: bool = eqx.field(static=True)
    detach_layers: bool = eqx.field(static=True, default=False)

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
        num_segments: int = 0,
        detach_layers: bool = False,
        *,
        key: PRNGKeyArray,
    ):
        if depth < 1:
            raise ValueError(f"Transformer: depth={depth} must be >= 1.")
        reg = get_attention(attention)
        kwargs = dict(attention_kwargs or {})
        ke, kp, kb = jax.random.split(key, 3)

        def make_block(k):
            ka, kf = jax.random.split(k)
            attn = reg.build(dim=dim, num_heads=num_heads, causal=causal, max_len=max_len,
                             key=ka, **kwargs)
            return Block(attn, dim, ffn_hidden=ffn_hidden, dropout=dropout, key=kf)

        self.embed = eqx.nn.Embedding(vocab_size, dim, key=ke)
        self.pos_embed = 0.02 * jax.random.normal(kp, (max_len, dim))
        self.segment_embed = (eqx.nn.Embedding(num_segments, dim, key=jax.random.fold_in(ke, 1))
                              if num_segments > 0 else None)
        self.blocks = eqx.filter_vmap(make_block)(jax.random.split(kb, depth))
        self.norm = eqx.nn.LayerNorm(dim)
        self.depth = depth
        self.causal = causal
        self.detach_layers = detach_layers

    def __call__(
        self,
        tokens: Int[Array, " n"],
        *,
        context: Optional[Float[Array, "s d"]] = None,
        mask: Optional[Bool[Array, "n s"]] = None,
        state: Optional[Float[Array, "depth n d"]] = None,
        key: Optional[PRNGKeyArray] = None,
        return_diagnostics: bool = False,
        segments: Optional[Int[Array, " n"]] = None,
    ):
        """**Arguments:**

        - `tokens`: integer ids, shape `(n,)`, n ≤ `max_len`.
        - `segments`: segment ids `(n,)` (models built with `num_segments > 0` only).
        - `context`: optional `(s, d)` context for cross-attention in every block.
        - `mask`: optional boolean `(n, s)` attention mask.
        - `state`: optional `(depth, n, d)`, one state per block for attentions that carry
          one (e.g. `SpinAttention(init="carried")`): the previous call's `diagnostics.state`.
        - `key`: PRNG key; enables dropout (training). None means inference.
        - `return_diagnostics`: also return the blocks' `Diagnostics`, stacked over layers
          (leading axis `depth`); its `state` is the next call's `state=`.

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
        dim = self.pos_embed.shape[1]
        if state is not None and state.shape != (self.depth, n, dim):
            raise ValueError(
                f"Transformer: state must have shape (depth, n, d) = ({self.depth}, {n}, {dim}); "
                f"got {state.shape}. Pass the previous call's diagnostics.state."
            )
        x = self.embeddings(tokens, segments)
        dynamic, static = eqx.partition(self.blocks, eqx.is_array)
        keys = None if key is None else jax.random.split(key, self.depth)

        def layer(h, xs):
            params, s, k, i = xs
            block = eqx.combine(params, static)
            if self.detach_layers:  # the embeddings still learn from the first block
                h = jnp.where(i == 0, h, jax.lax.stop_gradient(h))
            out = block(h, context=context, mask=mask, state=s, key=k,
                        return_diagnostics=return_diagnostics)
            return out if return_diagnostics else (out, None)

        x, diags = jax.lax.scan(layer, x, (dynamic, state, keys, jnp.arange(self.depth)))
        x = jax.vmap(self.norm)(x)
        if return_diagnostics:
            return x, diags
        return x

    def embeddings(self, tokens: Int[Array, " n"],
                   segments: Optional[Int[Array, " n"]] = None) -> Float[Array, "n d"]:
        """The input of the first block: token + position (+ segment) embeddings `(n, d)`."""
        n = tokens.shape[0]
        x = jax.vmap(self.embed)(tokens) + self.pos_embed[:n]
        if (segments is None) != (self.segment_embed is None):
            raise ValueError(
                "Transformer: pass segments= exactly when the model has a segment embedding "
                f"(num_segments > 0); got segments={'None' if segments is None else 'ids'} "
                f"with {'no ' if self.segment_embed is None else ''}segment embedding."
            )
        if segments is not None:
            if segments.shape != tokens.shape:
                raise ValueError(f"Transformer: segments must have the shape of tokens "
                                 f"{tokens.shape}; got {segments.shape}.")
            x = x + jax.vmap(self.segment_embed)(segments)
        return x

    def block(self, i: int) -> Block:
        """Block `i` (0-based) as a module of its own (its parameters sliced from the stack)."""
        if not 0 <= i < self.depth:
            raise ValueError(f"Transformer: block {i} does not exist; depth is {self.depth}.")
        dynamic, static = eqx.partition(self.blocks, eqx.is_array)
        return eqx.combine(jax.tree.map(lambda a: a[i], dynamic), static)


def _unroll_call(model: Transformer, tokens, **kwargs):
    """Reference: apply the stacked blocks with a Python loop (used by the tests)."""
    x = jax.vmap(model.embed)(tokens) + model.pos_embed[: tokens.shape[0]]
    dynamic, static = eqx.partition(model.blocks, eqx.is_array)
    for i in range(model.depth):
        block = eqx.combine(jax.tree.map(lambda a: a[i], dynamic), static)
        x = block(x, **kwargs)
    return jax.vmap(model.norm)(x)


#: What a `SequenceModel` reads out (`pool=`): per-position outputs (`"none"`: logits
#: `(n, num_outputs)`, what decoding needs) or one output from the mean of the final hidden
#: states (`"mean"`: logits `(num_outputs,)`, a classifier).
SequencePool = Literal["none", "mean"]


class SequenceModel(eqx.Module):
    """A `Transformer` with a linear readout: per-position outputs (`pool="none"`, e.g. a
    language model or a tagger) or one output for the sequence from the mean-pooled final
    hidden states (`pool="mean"`, a classifier).

    **Arguments:**

    - `transformer`: the `Transformer` (width D).
    - `num_outputs`: size of the readout (classes, or the vocabulary of a language model).
    - `pool`: `"none"` (per-position logits `(n, num_outputs)`) or `"mean"` (logits
      `(num_outputs,)` of the mean of the final hidden states `(n, D)`).
    - `key`: PRNG key for the readout.

    `CausalLM`, `Tagger` and `Classifier` build the three usual cases.
    """

    transformer: Transformer
    readout: eqx.nn.Linear
    pool: SequencePool = eqx.field(static=True)

    def __init__(self, transformer: Transformer, num_outputs: int,
                 pool: SequencePool = "none", *, key: PRNGKeyArray):
        pool = check_literal("SequenceModel", "pool", pool, SequencePool)
        self.transformer = transformer
        self.readout = eqx.nn.Linear(transformer.pos_embed.shape[1], num_outputs, key=key)
        self.pool = pool

    def __call__(self, tokens: Int[Array, " n"], *,
                 context: Optional[Float[Array, "s d"]] = None,
                 mask: Optional[Bool[Array, "n s"]] = None,
                 state: Optional[Float[Array, "depth n d"]] = None,
                 key: Optional[PRNGKeyArray] = None, return_diagnostics: bool = False):
        """**Arguments:** `tokens (n,)` integer ids; `context`, `mask`, `state`, `key`,
        `return_diagnostics` as in `Transformer.__call__`.

        **Returns:** logits `(n, num_outputs)` (`pool="none"`) or `(num_outputs,)`
        (`pool="mean"`), or `(logits, diagnostics)`.
        """
        out = self.transformer(tokens, context=context, mask=mask, state=state, key=key,
                               return_diagnostics=return_diagnostics)
        h, diag = out if return_diagnostics else (out, None)
        if self.pool == "mean":
            logits = self.readout(jnp.mean(h, axis=0))
        else:
            logits = jax.vmap(self.readout)(h)
        return (logits, diag) if return_diagnostics else logits

    def layer_logits(self, hidden: Float[Array, "depth n d"]) -> Float[Array, "depth n c"]:
        """Readouts of every block's output (`diagnostics.hidden` of a call with
        `return_diagnostics=True`): the final LayerNorm and the readout applied to each
        layer, `(depth, n, num_outputs)` (`pool="none"`) or `(depth, num_outputs)`
        (`pool="mean"`). The last layer's equals the logits of `__call__`."""
        norm = jax.vmap(jax.vmap(self.transformer.norm))(hidden)
        if self.pool == "mean":
            return jax.vmap(self.readout)(jnp.mean(norm, axis=1))
        return jax.vmap(jax.vmap(self.readout))(norm)


def _with_readout(num_outputs, pool, key, vocab_size, dim, depth, num_heads, max_len,
                  attention, attention_kwargs, causal, ffn_hidden, dropout,
                  detach_layers=False) -> SequenceModel:
    """A `Transformer` and its readout, built from one key."""
    kt, kh = jax.random.split(key)
    transformer = Transformer(
        vocab_size, dim, depth, num_heads=num_heads, max_len=max_len, attention=attention,
        attention_kwargs=attention_kwargs, causal=causal, ffn_hidden=ffn_hidden,
        dropout=dropout, detach_layers=detach_layers, key=kt,
    )
    return SequenceModel(transformer, num_outputs, pool, key=kh)


def CausalLM(vocab_size: int, dim: int, depth: int, num_heads: int = 1, max_len: int = 512,
             attention="softmax", attention_kwargs=None, ffn_hidden: int = 0,
             dropout: float = 0.0, detach_layers: bool = False, *,
             key: PRNGKeyArray) -> SequenceModel:
    """A causal language model: `tokens (n,) -> next-token logits (n, vocab_size)`.

    **Arguments:** as `Transformer` (always causal; no `causal` argument).

    **Returns:** a `SequenceModel`.
    """
    return _with_readout(vocab_size, "none", key, vocab_size, dim, depth, num_heads, max_len,
                         attention, attention_kwargs, True, ffn_hidden, dropout, detach_layers)


def Tagger(vocab_size: int, num_classes: int, dim: int, depth: int, num_heads: int = 1,
           max_len: int = 512, attention="softmax", attention_kwargs=None,
           causal: bool = False, ffn_hidden: int = 0, dropout: float = 0.0,
           detach_layers: bool = False, *, key: PRNGKeyArray) -> SequenceModel:
    """A per-position tagger: `tokens (n,) -> logits (n, num_classes)` (e.g. bracket
    matching, where the class of a closing bracket is the position of its opening bracket).

    **Arguments:** as `Transformer`, plus `num_classes`.

    **Returns:** a `SequenceModel`.
    """
    return _with_readout(num_classes, "none", key, vocab_size, dim, depth, num_heads, max_len,
                         attention, attention_kwargs, causal, ffn_hidden, dropout, detach_layers)


def Classifier(vocab_size: int, num_classes: int, dim: int, depth: int, num_heads: int = 1,
               max_len: int = 512, attention="softmax", attention_kwargs=None,
               causal: bool = False, ffn_hidden: int = 0, dropout: float = 0.0,
               detach_layers: bool = False, *, key: PRNGKeyArray) -> SequenceModel:
    """A sequence classifier: `tokens (n,) -> logits (num_classes,)` from the mean-pooled
    final hidden states.

    **Arguments:** as `Transformer`, plus `num_classes`.

    **Returns:** a `SequenceModel`.
    """
    return _with_readout(num_classes, "mean", key, vocab_size, dim, depth, num_heads, max_len,
                         attention, attention_kwargs, causal, ffn_hidden, dropout, detach_layers)
