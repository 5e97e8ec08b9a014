"""Incremental decoding and text generation for causal models.

A causal model's output at position i depends only on positions ≤ i, so a model that
generates one token at a time can keep what every layer computed for the earlier positions
(a cache) and compute only the newest position: softmax attention caches keys and values,
spin attention its keys and the earlier positions' magnetizations (each new position then
solves a D_h-dimensional fixed point per head instead of the whole sequence's), Boltzmann
attention keys and values. Each attention implements the protocol

- `attention.decode_init(max_len, dtype) -> cache` (one sequence; a pytree of arrays),
- `attention.decode(x (d,), cache, pos) -> (y (d,), cache)`, the attention's output at
  position `pos` for the (normed) input `x` of that position,

and `decode_step` runs the blocks around it (residuals, feed-forward networks, LayerNorms),
stacked over layers like `Transformer.__call__`.

Positions are absolute and the model's positional embedding has `max_len` rows, so a
context never holds more than `max_len` tokens: `generate` keeps a window of the most recent
tokens and, when it is full, restarts it from its last `max_len // 2` tokens (re-encoding
them); `generate(incremental=False)` re-solves the same windows from scratch at every step,
the reference the incremental path is tested and timed against.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

from ._transformer import SequenceModel, Transformer

__all__ = ["DecodeState", "decode_init", "decode_step", "decode_sequence", "prefill",
           "generate", "window_start"]


class DecodeState(eqx.Module):
    """What incremental decoding keeps between steps.

    **Fields:**

    - `caches`: every block's attention cache, stacked over layers (leading axis `depth`).
    - `pos`: int32 scalar, the number of tokens in the cache (the next token's position).
    """

    caches: Any
    pos: Int[Array, ""]

    @property
    def failures(self) -> Array:
        """The number of fixed-point solves that did not converge so far (0 for attentions
        that solve nothing)."""
        f = self.caches.get("failures") if isinstance(self.caches, dict) else None
        return jnp.zeros((), jnp.int32) if f is None else jnp.sum(f)


def _transformer(model) -> Transformer:
    if isinstance(model, SequenceModel):
        if not model.pool.per_position:
            raise ValueError("decoding needs per-position outputs (a CausalLM or a causal "
                             f"Tagger); this model pools (pool={str(model.pool)!r}).")
        return model.transformer
    if isinstance(model, Transformer):
        return model
    raise TypeError(f"decoding works on nn.SequenceModel (e.g. nn.CausalLM) or nn.Transformer, "
                    f"not {type(model).__name__}.")


def _max_len(model) -> int:
    return _transformer(model).pos_embed.shape[0]


def decode_init(model, max_len: Optional[int] = None) -> DecodeState:
    """An empty `DecodeState` for `model` (a causal `SequenceModel` or `Transformer`).

    **Arguments:** `max_len`: cache length, at most (and by default) the model's `max_len`.

    Raises `ValueError` for a model that is not causal or whose attention has no incremental
    path (no `decode` method); `generate(incremental=False)` works for any causal model.
    """
    tr = _transformer(model)
    if not tr.causal:
        raise ValueError("decoding needs a causal model (built with causal=True, e.g. "
                         "nn.CausalLM).")
    L = _max_len(model) if max_len is None else max_len
    if not 1 <= L <= _max_len(model):
        raise ValueError(f"max_len={L} must be in [1, {_max_len(model)}] (the model's max_len).")
    attn = tr.block(0).attention
    if not (hasattr(attn, "decode") and hasattr(attn, "decode_init")):
        raise ValueError(f"{type(attn).__name__} has no incremental decoding (decode_init / "
                         "decode); generate with incremental=False (--no-cache), which "
                         "re-solves the context at every step.")
    one = attn.decode_init(L, tr.pos_embed.dtype)
    caches = jax.tree.map(lambda a: jnp.broadcast_to(a, (tr.depth, *a.shape)), one)
    return DecodeState(caches, jnp.zeros((), jnp.int32))


def _block_decode(block, x, cache, pos):
    y, cache = block.attention.decode(block.norm1(x), cache, pos)
    x = x + y
    if block.ffn is not None:
        x = x + block.ffn(block.norm2(x))
    return x, cache


def _hidden_step(tr: Transformer, state: DecodeState, token):
    x = tr.embed(token) + tr.pos_embed[state.pos]
    dynamic, static = eqx.partition(tr.blocks, eqx.is_array)

    def layer(h, xs):
        params, cache = xs
        return _block_decode(eqx.combine(params, static), h, cache, state.pos)

    x, caches = jax.lax.scan(layer, x, (dynamic, state.caches))
    return tr.norm(x), DecodeState(caches, state.pos + 1)


def decode_step(model, state: DecodeState, token: Int[Array, ""]
                ) -> tuple[Float[Array, " c"], DecodeState]:
    """Feed one token: `(logits (C,) at the token's position, the new state)` for a
    `SequenceModel` (for a `Transformer`: the final hidden state `(d,)`).

    The position is `state.pos`; it must stay below the cache length (not checked inside
    compiled code: positions past the cache are clipped by JAX's indexing, so the caller
    keeps the window — `generate` does)."""
    tr = _transformer(model)
    h, state = _hidden_step(tr, state, token)
    if isinstance(model, SequenceModel):
        return model.readout(h), state
    return h, state


def decode_sequence(model, tokens: Int[Array, " n"], state: Optional[DecodeState] = None
                    ) -> tuple[Float[Array, "n c"], DecodeState]:
    """Feed `tokens (n,)` one at a time (a `lax.scan` of `decode_step`): the per-position
    outputs `(n, C)` — equal to `model(tokens)` up to the solver tolerance — and the state."""
    if state is None:
        state = decode_init(model)
    if tokens.shape[0] > _max_len(model):
        raise ValueError(f"{tokens.shape[0]} tokens exceed the model's max_len="
                         f"{_max_len(model)}.")
    out_state, logits = jax.lax.scan(lambda s, t: decode_step(model, s, t)[::-1], state,
                                     tokens)
    return logits, out_state


def prefill(model, tokens: Int[Array, " L"], length: Int[Array, ""]
            ) -> tuple[Float[Array, " c"], DecodeState]:
    """Encode the first `length` entries of `tokens` (padded to a fixed size, so one
    compilation serves every prompt length) into a fresh state: `(the last position's
    output, state)`. `length` must be ≥ 1."""
    state = decode_init(model, tokens.shape[0])
    out = jax.eval_shape(lambda: decode_step(model, state, tokens[0])[0])

    def body(i, carry):
        _, s = carry
        return decode_step(model, s, tokens[i])

    return jax.lax.fori_loop(0, length, body, (jnp.zeros(out.shape, out.dtype), state))


def window_start(n: int, start: int, max_len: int) -> int:
    """The start of the context window once `n` tokens exist: unchanged while the window
    `[start, n)` holds at most `max_len` tokens, else restarted at its last
    `max(1, max_len // 2)` tokens."""
    if n - start > max_len:
        return n - max(1, max_len // 2)
    return start


class _Carry(eqx.Module):
    """The generation loop's state: the token buffer (prompt, generated tokens, then
    `max_len` of padding), how many tokens it holds, the window start, the decoding state
    (None when re-solving), the next token's logits, window restarts and solver failures of
    the states already dropped."""

    buf: Int[Array, " N"]
    n: Int[Array, ""]
    start: Int[Array, ""]
    state: Optional[DecodeState]
    logits: Float[Array, " c"]
    restarts: Int[Array, ""]
    failures: Int[Array, ""]


def _window(buf, start, L):
    return jax.lax.dynamic_slice(buf, (start,), (L,))


def _context_logits(model, buf, start, n, L):
    """Re-solve: the whole window's call, the output at its last real position."""
    return model(_window(buf, start, L))[n - start - 1]


def _sample(logits, temperature, key):
    """A draw from softmax(logits / temperature), or the argmax at temperature 0."""
    t = jnp.maximum(temperature, 1e-30)
    drawn = jax.random.categorical(key, logits.astype(jnp.float32) / t)
    return jnp.where(temperature > 0, drawn, jnp.argmax(logits)).astype(jnp.int32)


@eqx.filter_jit
def _start(model, buf, n, start, incremental: bool):
    L = _max_len(model)
    zero = jnp.zeros((), jnp.int32)
    if incremental:
        logits, state = prefill(model, _window(buf, start, L), n - start)
    else:
        logits, state = _context_logits(model, buf, start, n, L), None
    return _Carry(buf, n, start, state, logits, zero, zero)


@eqx.filter_jit
def _generate_chunk(model, carry: _Carry, key, temperature, steps: int, incremental: bool):
    """`steps` generation steps in one compiled loop (no host round trip per token)."""
    L = _max_len(model)
    keep = max(1, L // 2)

    def body(_, c: _Carry):
        tok = _sample(c.logits, temperature, jax.random.fold_in(key, c.n))
        buf = c.buf.at[c.n].set(tok)
        n = c.n + 1
        restart = n - c.start > L
        start = jnp.where(restart, n - keep, c.start)
        if incremental:
            def again(_):
                logits, state = prefill(model, _window(buf, start, L), n - start)
                return logits, state, c.failures + c.state.failures

            def step(_):
                logits, state = decode_step(model, c.state, tok)
                return logits, state, c.failures

            logits, state, failures = jax.lax.cond(restart, again, step, None)
        else:
            logits, state, failures = _context_logits(model, buf, start, n, L), None, c.failures
        return _Carry(buf, n, start, state, logits, c.restarts + restart, failures)

    return jax.lax.fori_loop(0, steps, body, carry)


def generate(
    model,
    prompt: Int[Array, " p"],
    *,
    length: int,
    temperature: float = 1.0,
    key: PRNGKeyArray,
    incremental: bool = True,
    progress: bool = False,
    chunk: int = 64,
) -> tuple[list[int], dict]:
    """Sample `length` tokens after `prompt` from a causal language model.

    **Arguments:**

    - `model`: a causal `SequenceModel` (`nn.CausalLM`) in inference mode (no dropout).
    - `prompt`: token ids `(p,)`, p ≥ 1.
    - `length`: number of tokens to generate.
    - `temperature`: softmax temperature of the sampling distribution; 0 means greedy
      (argmax).
    - `key`: PRNG key; token t is drawn with `fold_in(key, t)` (t counts prompt and generated
      tokens), so a key gives the same text in both modes whenever their logits agree.
    - `incremental`: keep per-layer caches and compute only each new position
      (`decode_step`); False re-solves the whole context window at every step.
    - `progress`: a tqdm bar over the generated tokens.
    - `chunk`: tokens generated per compiled loop (between progress updates).

    The context is a window of at most `max_len` tokens (see `window_start`). Sampling, the
    cache updates and the window restarts all run inside compiled loops of `chunk` steps.

    **Returns:** `(ids, info)`: the generated ids (a list of `length` ints) and
    `{"solver_failures": fixed-point solves that did not converge (incremental spin
    attention; 0 otherwise), "restarts": how often the window was restarted}`.
    """
    if isinstance(length, bool) or not isinstance(length, int) or length < 0:
        raise ValueError(f"length={length!r} must be an int >= 0.")
    if not (temperature >= 0 and math.isfinite(temperature)):
        raise ValueError(f"temperature={temperature} must be a finite number >= 0.")
    ids = [int(t) for t in jnp.asarray(prompt).reshape(-1)]
    if not ids:
        raise ValueError("the prompt is empty; give at least one token.")
    L = _max_len(model)
    if incremental:
        decode_init(model)  # raises early for models without an incremental path
    buf = jnp.asarray(ids + [0] * (length + L), jnp.int32)
    n = len(ids)
    carry = _start(model, buf, jnp.int32(n), jnp.int32(window_start(n, 0, L)), incremental)
    temp = jnp.float32(temperature)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=length, desc="generate", dynamic_ncols=True)
    try:
        done = 0
        while done < length:
            steps = min(chunk, length - done)
            carry = _generate_chunk(model, carry, key, temp, steps, incremental)
            done += steps
            if bar is not None:
                jax.block_until_ready(carry.n)
                bar.update(steps)
    finally:
        if bar is not None:
            bar.close()
    failures = carry.failures + (carry.state.failures if carry.state is not None else 0)
    out = [int(t) for t in carry.buf[n:n + length]]
    return out, {"solver_failures": int(failures), "restarts": int(carry.restarts)}
