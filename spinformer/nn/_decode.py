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
- optionally `attention.prefill(x (L, d)) -> (y (L, d), cache)`, every position of a window
  at once with the cache `decode` would have built over it (softmax and spin attention):
  `prefill` then encodes a window in one pass instead of L steps,

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
from typing import Optional

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

from ._transformer import SequenceModel, Transformer

__all__ = ["DecodeState", "decode_init", "decode_step", "decode_sequence", "prefill",
           "generate", "window_start", "with_solver"]


class DecodeState(eqx.Module):
    """What incremental decoding keeps between steps.

    **Fields:**

    - `caches`: a tuple with every block's attention cache (one per layer, in order).
    - `pos`: int32 scalar, the number of tokens in the cache (the next token's position).
    """

    caches: tuple
    pos: Int[Array, ""]

    @property
    def failures(self) -> Array:
        """The number of fixed-point solves that did not converge so far (0 for attentions
        that solve nothing)."""
        total = jnp.zeros((), jnp.int32)
        for cache in self.caches:
            f = cache.get("failures") if isinstance(cache, dict) else None
            if f is not None:
                total = total + jnp.sum(f)
        return total


def _transformer(model) -> Transformer:
    if isinstance(model, SequenceModel):
        if model.pool != "none":
            raise ValueError("decoding needs per-position outputs (a CausalLM or a causal "
                             f"Tagger); this model pools (pool={model.pool!r}).")
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
    return DecodeState((one,) * tr.depth, jnp.zeros((), jnp.int32))


def _block_apply(block, x, attend, per_token):
    """One block around its attention: `attend(attention, normed x) -> (y, cache)`, then the
    residuals and the feed-forward network; `per_token` maps a per-token module over `x`
    (the module itself for one token `(d,)`, `jax.vmap` for a window `(L, d)`)."""
    y, cache = attend(block.attention, per_token(block.norm1)(x))
    x = x + y
    if block.ffn is not None:
        x = x + per_token(block.ffn)(per_token(block.norm2)(x))
    return x, cache


def _block_decode(block, x, cache, pos):
    return _block_apply(block, x, lambda attn, h: attn.decode(h, cache, pos), lambda f: f)


def _output(model, tr, x):
    """The model's output at the final hidden state `x (d,)`: logits for a `SequenceModel`,
    the normed state for a `Transformer`."""
    h = tr.norm(x)
    return model.readout(h) if isinstance(model, SequenceModel) else h


def _blocks(model) -> tuple:
    """The model's blocks as separate modules (parameters sliced from the stack once)."""
    tr = _transformer(model)
    return tuple(tr.block(i) for i in range(tr.depth))


def _step(model, blocks: Optional[tuple], state: DecodeState, token):
    """`decode_step` with the blocks already split (`_blocks`), or split here when None.

    The layers run as straight-line code (a Python loop over the blocks, each with its own
    cache), not as a `lax.scan` over the stacked parameters: one token's work is a few
    small products per layer, and on a GPU a loop step, its slices of the stacked
    parameters and caches cost more launches than the layer itself."""
    tr = _transformer(model)
    if blocks is None:
        blocks = _blocks(model)
    x = tr.embed(token) + tr.pos_embed[state.pos]
    caches = []
    for block, cache in zip(blocks, state.caches):
        x, cache = _block_decode(block, x, cache, state.pos)
        caches.append(cache)
    return _output(model, tr, x), DecodeState(tuple(caches), state.pos + 1)


def decode_step(model, state: DecodeState, token: Int[Array, ""]
                ) -> tuple[Float[Array, " c"], DecodeState]:
    """Feed one token: `(logits (C,) at the token's position, the new state)` for a
    `SequenceModel` (for a `Transformer`: the final hidden state `(d,)`).

    The position is `state.pos`; it must stay below the cache length (not checked inside
    compiled code: positions past the cache are clipped by JAX's indexing, so the caller
    keeps the window — `generate` does)."""
    return _step(model, None, state, token)


def decode_sequence(model, tokens: Int[Array, " n"], state: Optional[DecodeState] = None
                    ) -> tuple[Float[Array, "n c"], DecodeState]:
    """Feed `tokens (n,)` one at a time (a `lax.scan` of `decode_step`): the per-position
    outputs `(n, C)` — equal to `model(tokens)` up to the solver tolerance — and the state."""
    if state is None:
        state = decode_init(model)
    if tokens.shape[0] > _max_len(model):
        raise ValueError(f"{tokens.shape[0]} tokens exceed the model's max_len="
                         f"{_max_len(model)}.")
    blocks = _blocks(model)
    out_state, logits = jax.lax.scan(lambda s, t: _step(model, blocks, s, t)[::-1], state,
                                     tokens)
    return logits, out_state


def prefill(model, tokens: Int[Array, " L"], length: Int[Array, ""]
            ) -> tuple[Float[Array, " c"], DecodeState]:
    """Encode the first `length` entries of `tokens` (padded to a fixed size, so one
    compilation serves every prompt length) into a fresh state: `(the last position's
    output, state)`. `length` must be ≥ 1.

    When every layer's attention has a `prefill` method the window is one whole-sequence
    pass (the caches agree with step-by-step decoding to the solver tolerance, and its
    failed solves are counted per layer and head of the pass); otherwise the tokens are
    decoded one at a time."""
    return _prefill(model, _blocks(model), tokens, length)


def _prefill(model, blocks, tokens, length):
    state = decode_init(model, tokens.shape[0])  # refuses models that cannot decode
    if all(hasattr(b.attention, "prefill") for b in blocks):
        return _prefill_parallel(model, blocks, tokens, length)
    out = jax.eval_shape(lambda: _step(model, blocks, state, tokens[0])[0])

    def body(i, carry):
        _, s = carry
        return _step(model, blocks, s, tokens[i])

    return jax.lax.fori_loop(0, length, body, (jnp.zeros(out.shape, out.dtype), state))


def _prefill_parallel(model, blocks, tokens, length):
    """`_prefill` as one whole-sequence pass (`decode_step`'s layers over all positions at
    once), each attention building its cache with `prefill`: on a GPU, where a decoding step
    costs about as much as a whole window's pass, re-encoding a window this way costs one
    step instead of `length`. The positions at and after `length` are computed too (the
    window is padded to a fixed size) and are overwritten by the steps that follow."""
    tr = _transformer(model)
    x = jax.vmap(tr.embed)(tokens) + tr.pos_embed[:tokens.shape[0]]
    caches = []
    for block in blocks:
        x, cache = _block_apply(block, x, lambda attn, h: attn.prefill(h), jax.vmap)
        caches.append(cache)
    last = jax.lax.dynamic_index_in_dim(x, length - 1, keepdims=False)
    return _output(model, tr, last), DecodeState(tuple(caches), jnp.asarray(length, jnp.int32))


def with_solver(model, solver):
    """`model` with every solver in it (each layer's `solver` field) replaced by `solver`,
    a `solvers.AbstractSolver`.

    For incremental decoding on a GPU, where one position's solve is a few small kernels and
    a while loop waits for the host at every iteration, a fixed number of unrolled steps is
    faster: `with_solver(model, solvers.Picard(tol=1e-3, max_steps=12, unroll=True))`. The
    solves still check their residual (once, at the end), and those that miss `tol` are
    counted in `generate`'s `solver_failures`. `generate(solver=...)` does this for you."""
    from ..solvers import AbstractSolver

    if not isinstance(solver, AbstractSolver):
        raise ValueError(f"with_solver: expected a spinformer solver such as "
                         f"solvers.Picard(unroll=True); got {solver!r}.")
    if not solvers_of(model):
        raise ValueError(f"with_solver: {type(model).__name__} solves nothing (no layer has a "
                         "solver), so there is no solver to replace.")
    return jax.tree.map(lambda leaf: solver if isinstance(leaf, AbstractSolver) else leaf,
                        model, is_leaf=lambda x: isinstance(x, AbstractSolver))


def solvers_of(model) -> list:
    """The solvers in `model` (each layer's `solver` field), in tree order; empty for a
    model that solves nothing."""
    from ..solvers import AbstractSolver

    is_solver = lambda x: isinstance(x, AbstractSolver)  # noqa: E731
    return [s for s in jax.tree.leaves(model, is_leaf=is_solver) if is_solver(s)]


def window_start(n: int, start: int, max_len: int) -> int:
    """The start of the context window once `n` tokens exist: unchanged while the window
    `[start, n)` holds at most `max_len` tokens, else restarted at its last
    `max(1, max_len // 2)` tokens."""
    if n - start > max_len:
        return n - max(1, max_len // 2)
    return start


class _Carry(eqx.Module):
    """The generation loop's state for a batch of B sequences that share their length: the
    token buffers `(B, N)` (prompt, generated tokens, then `max_len` of padding), how many
    tokens each holds, the window start, the decoding states (batched; None when
    re-solving), the next tokens' logits `(B, C)`, window restarts and the solver failures
    of the states already dropped (re-solving: of every call so far)."""

    buf: Int[Array, "B N"]
    n: Int[Array, ""]
    start: Int[Array, ""]
    state: Optional[DecodeState]
    logits: Float[Array, "B c"]
    restarts: Int[Array, ""]
    failures: Int[Array, ""]


def _window(buf, start, L):
    return jax.lax.dynamic_slice(buf, (start,), (L,))


def _context_logits(model, buf, start, n, L):
    """Re-solve: the whole window's call, the output at its last real position, and the
    number of the call's solves (per layer and head) that did not converge."""
    logits, diag = model(_window(buf, start, L), return_diagnostics=True)
    stats = getattr(diag, "solver", None)
    failed = (jnp.zeros((), jnp.int32) if stats is None
              else jnp.sum(stats.result != 0).astype(jnp.int32))
    return logits[n - start - 1], failed


def _sample(logits, temperature, key):
    """A draw from softmax(logits / temperature), or the argmax at temperature 0."""
    t = jnp.maximum(temperature, 1e-30)
    drawn = jax.random.categorical(key, logits.astype(jnp.float32) / t)
    return jnp.where(temperature > 0, drawn, jnp.argmax(logits)).astype(jnp.int32)


def _rows(f, *args):
    """`jax.vmap(f)(*args)` over the batch axis, or for a batch of one `f` on the row
    itself (a vmap rule such as exact Boltzmann attention's costs more than the row)."""
    if jax.tree.leaves(args)[0].shape[0] != 1:
        return jax.vmap(f)(*args)
    out = f(*jax.tree.map(lambda a: a[0], args))
    return jax.tree.map(lambda a: a[None], out)


def _encode(model, blocks, buf, n, start, incremental):
    """The logits after the window `[start, n)` of every row of `buf (B, N)`, and the
    decoding states (incremental) or None."""
    L = _max_len(model)
    if not incremental:
        logits, failed = _rows(lambda b: _context_logits(model, b, start, n, L), buf)
        return logits, jnp.sum(failed)  # re-solving keeps no state: its failures instead
    logits, state = _rows(lambda b: _prefill(model, blocks, _window(b, start, L), n - start),
                          buf)
    return logits, DecodeState(state.caches, n - start)  # one position for every row


def _decode_rows(model, blocks, state: DecodeState, tok):
    """`_step` for every row: the caches are batched, the position `state.pos` is one scalar
    that the rows share (they have one length). Under a vmap over a batched position each
    cache write is a scatter (several per layer in the compiled loop); with a shared
    position every write is a slice update in place."""
    pos = state.pos

    def row(caches, t):
        logits, new = _step(model, blocks, DecodeState(caches, pos), t)
        return logits, new.caches

    logits, caches = _rows(row, state.caches, tok)
    return logits, DecodeState(caches, pos + 1)


@eqx.filter_jit
def _start(model, blocks, buf, n, start, incremental: bool):
    logits, state = _encode(model, blocks, buf, n, start, incremental)
    zero = jnp.zeros((), jnp.int32)
    if not incremental:
        return _Carry(buf, n, start, None, logits, zero, state)
    return _Carry(buf, n, start, state, logits, zero, zero)


def _append(c: _Carry, keys, temperature):
    """Draw each row's next token (row b with `fold_in(keys[b], n)`) and append it."""
    tok = jax.vmap(lambda lg, k: _sample(lg, temperature, jax.random.fold_in(k, c.n)))(
        c.logits, keys)
    return tok, c.buf.at[:, c.n].set(tok), c.n + 1


@eqx.filter_jit
def _generate_chunk(model, blocks, carry: _Carry, keys, temperature, lead, segments, count,
                    incremental: bool):
    """Generation steps in one compiled program, with no host round trip and no branch per
    token: `lead` plain steps, then (incremental) for each of the first `count` entries k
    of `segments` one step whose token overflows the window (the window restarts at the
    last `max_len // 2` tokens, re-encoded from fresh states) followed by k plain steps.
    The counts are int32 arrays (`segments` of a fixed size), so one compilation serves
    every plan; `generate` makes the plan (the restarts depend only on the lengths).
    Re-solving moves the window inside the loop instead (`segments` unused)."""
    L = _max_len(model)
    keep = max(1, L // 2)

    def body(_, c: _Carry):
        tok, buf, n = _append(c, keys, temperature)
        if incremental:
            logits, state = _decode_rows(model, blocks, c.state, tok)
            return _Carry(buf, n, c.start, state, logits, c.restarts, c.failures)
        restart = n - c.start > L
        start = jnp.where(restart, n - keep, c.start)
        logits, failed = _encode(model, blocks, buf, n, start, incremental)
        return _Carry(buf, n, start, None, logits, c.restarts + restart, c.failures + failed)

    carry = jax.lax.fori_loop(0, lead, body, carry)
    if not incremental:
        return carry

    def segment(i, c: _Carry):
        _, buf, n = _append(c, keys, temperature)
        start = n - keep
        logits, state = _encode(model, blocks, buf, n, start, True)
        c = _Carry(buf, n, start, state, logits, c.restarts + 1, c.failures + c.state.failures)
        return jax.lax.fori_loop(0, segments[i], body, c)

    return jax.lax.fori_loop(0, count, segment, carry)


def _plan(tokens: int, free: int, room: int, size: int):
    """`tokens` generation steps as `(lead, segments, count)` for `_generate_chunk`: `lead`
    plain steps while `free` tokens still fit the window, then segments of one restart and
    up to `room` plain steps (`segments` padded to `size` entries)."""
    lead = min(tokens, free)
    rest, segments = tokens - lead, []
    while rest > 0:
        k = min(room, rest - 1)
        segments.append(k)
        rest -= 1 + k
    return lead, segments + [0] * (size - len(segments)), len(segments)


def generate(
    model,
    prompt: Int[Array, "*b p"],
    *,
    length: int,
    temperature: float = 1.0,
    key: PRNGKeyArray,
    incremental: bool = True,
    progress: bool = False,
    chunk: int = 64,
    solver=None,
) -> tuple[list, dict]:
    """Sample `length` tokens after `prompt` from a causal language model.

    **Arguments:**

    - `model`: a causal `SequenceModel` (`nn.CausalLM`) in inference mode (no dropout).
    - `prompt`: token ids `(p,)`, p ≥ 1, or a batch of prompts of one length `(B, p)`:
      the B sequences are generated together (one compiled step for all of them; on a GPU
      a batch costs about as much per step as one sequence).
    - `length`: number of tokens to generate.
    - `temperature`: softmax temperature of the sampling distribution; 0 means greedy
      (argmax).
    - `key`: PRNG key; token t is drawn with `fold_in(key, t)` (t counts prompt and generated
      tokens), so a key gives the same text in both modes whenever their logits agree. For
      a batch, row b uses `jax.random.split(key, B)[b]` in place of `key`.
    - `incremental`: keep per-layer caches and compute only each new position
      (`decode_step`); False re-solves the whole context window at every step.
    - `progress`: a tqdm bar over the generated tokens.
    - `chunk`: tokens generated per compiled loop (between progress updates).
    - `solver`: a `solvers.AbstractSolver` for every solve of the generation in place of
      each layer's own (see `with_solver`), e.g. `solvers.Picard(tol=1e-3, max_steps=12,
      unroll=True)`: on a GPU a fixed number of unrolled steps decodes a position faster
      than a while loop; solves that miss the tolerance are counted in `solver_failures`.

    The context is a window of at most `max_len` tokens (see `window_start`). Sampling and
    the cache updates run inside compiled loops of up to `chunk` steps; the window restarts
    are planned on the host (their positions depend only on the lengths), so a step has no
    branch, which a batch would turn into computing both sides.

    **Returns:** `(ids, info)`: the generated ids (a list of `length` ints; for a batch, a
    list of B such lists) and `{"solver_failures": fixed-point solves that did not converge,
    all rows (incremental: one per position, head and layer; re-solving: one per window
    call, head and layer, the padded positions after the last token included; 0 for
    attentions that solve nothing), "restarts": how often the window was restarted}`.
    """
    if isinstance(length, bool) or not isinstance(length, int) or length < 0:
        raise ValueError(f"length={length!r} must be an int >= 0.")
    if not (temperature >= 0 and math.isfinite(temperature)):
        raise ValueError(f"temperature={temperature} must be a finite number >= 0.")
    prompts = jnp.asarray(prompt)
    batched = prompts.ndim == 2
    if prompts.ndim not in (1, 2):
        raise ValueError(f"the prompt must be token ids (p,) or a batch of prompts (B, p); "
                         f"got shape {prompts.shape}.")
    if prompts.size == 0:
        raise ValueError(f"the prompt is empty (shape {prompts.shape}); give at least one "
                         "token (and one prompt).")
    rows = prompts.reshape(-1, prompts.shape[-1]).astype(jnp.int32)
    B, n = rows.shape
    keys = jax.random.split(key, B) if batched else key[None]
    if solver is not None:
        model = with_solver(model, solver)
    L = _max_len(model)
    if incremental:
        decode_init(model)  # raises early for models without an incremental path
    blocks = _blocks(model) if incremental else None  # split once, outside the loops
    buf = jnp.concatenate([rows, jnp.zeros((B, length + L), jnp.int32)], axis=1)
    start = window_start(n, 0, L)
    carry = _start(model, blocks, buf, jnp.int32(n), jnp.int32(start), incremental)
    temp = jnp.float32(temperature)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=length, desc="generate", dynamic_ncols=True)
    try:
        done = 0
        while done < length:
            steps = min(chunk, length - done)
            if incremental:  # plan the window: `free` more tokens fit before it restarts
                lead, segments, count = _plan(steps, L - (n + done - start),
                                              L - max(1, L // 2), chunk)
            else:
                lead, segments, count = steps, [0] * chunk, 0
            carry = _generate_chunk(model, blocks, carry, keys, temp, jnp.int32(lead),
                                    jnp.asarray(segments, jnp.int32), jnp.int32(count),
                                    incremental)
            for _ in range(steps):
                done += 1
                start = window_start(n + done, start, L)
            if bar is not None:
                jax.block_until_ready(carry.n)
                bar.update(steps)
    finally:
        if bar is not None:
            bar.close()
    failures = carry.failures + (carry.state.failures if carry.state is not None else 0)
    out = [[int(t) for t in row] for row in jax.device_get(carry.buf[:, n:n + length])]
    info = {"solver_failures": int(failures), "restarts": int(carry.restarts)}
    return (out if batched else out[0]), info
