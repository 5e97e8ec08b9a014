"""One pure training step: gradients (accumulated, mixed precision), the skip of a
non-finite step, the optimizer update."""

from __future__ import annotations

import functools
from typing import Any, Optional

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array

from .. import solvers
from ..solvers._adjoint import without_fallbacks
from ._metrics import _backward_metrics
from ._objective import Objective, _objective
from ._precision import mixed_precision
from ._state import RunState


def _all_finite(tree) -> Array:
    """Whether every floating leaf of `tree` is finite: one reduction over the leaves laid end
    to end (per dtype). A reduction per leaf, joined by a chain of `and`s, had XLA copy that
    chain into every fusion that reads the answer (the step's selects of each parameter and
    optimiser leaf): 2 k of the softmax step's 11.6 k HLO lines, and 2.3 of its 6.1 s of
    compilation."""
    groups: dict = {}
    for x in jax.tree.leaves(eqx.filter(tree, eqx.is_inexact_array)):
        groups.setdefault(jnp.result_type(x), []).append(jnp.ravel(x))
    ok = jnp.asarray(True)
    for parts in groups.values():
        ok = ok & jnp.all(jnp.isfinite(jnp.concatenate(parts)))
    return ok


def _grads(model, batch, key, state, *, precision: str, accumulate: int,
           objective: Objective):
    """`(loss, metrics), grads, next_state` of one batch, or the mean over `accumulate`
    micro-batches stacked on the leading axis of every batch array (a `lax.scan`, one
    compiled body; a carried `state` goes from each micro-batch to the next)."""
    def value_and_grad(b, k, s):
        def loss(m):
            m = mixed_precision(m) if precision == "bfloat16" else m
            return _objective(m, b, k, s, objective)

        (value, (metrics, s)), grads = eqx.filter_value_and_grad(loss, has_aux=True)(model)
        return (value, metrics, grads), s

    if accumulate == 1:
        (loss, metrics, grads), state = value_and_grad(batch, key, state)
        return (loss, metrics), grads, state

    def body(carry, xs):
        total, s = carry
        b, i = xs
        out, s = value_and_grad(b, None if key is None else jax.random.fold_in(key, i), s)
        add = lambda a, g: a + g / accumulate  # noqa: E731
        return (jax.tree.map(add, total, out), s), None

    shapes, _ = jax.eval_shape(
        lambda: value_and_grad(jax.tree.map(lambda x: x[0], batch), key, state))
    # (the gradient tree has None where the model has no inexact array: kept as is)
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    ((loss, metrics, grads), state), _ = jax.lax.scan(body, (zeros, state),
                                                      (batch, jnp.arange(accumulate)))
    return (loss, metrics), grads, state


def _finite_rows(state):
    """`state` with the examples whose state is not finite reset to zeros (a diverged
    forward pass does not poison the rest of its stream)."""
    ok = jnp.all(jnp.isfinite(state), axis=tuple(range(1, state.ndim)), keepdims=True)
    return jnp.where(ok, state, jnp.zeros_like(state))


def _step(run: RunState, batch, key=None, *, optimizer, accumulate: int = 1,
          precision: str = "float32", mesh=None, objective: Optional[Objective] = None,
          backward_fallback: bool = True):
    model, opt_state, state = run.model, run.opt_state, run.stream
    with without_fallbacks(not backward_fallback):
        (loss, metrics), grads, state = _grads(model, batch, key, state, precision=precision,
                                               accumulate=accumulate,
                                               objective=objective or Objective())
    # the backward-solve records ride on probe cotangents: log them, keep them from the update
    grads, records = solvers.backward_stats(grads)
    metrics.update(_backward_metrics(records))
    params = eqx.filter(model, eqx.is_inexact_array)
    updates, new_opt_state = optimizer.update(grads, opt_state, params)
    new_model = eqx.apply_updates(model, updates)
    # a non-finite loss, gradient or update is skipped: parameters and optimiser state stay.
    # One conditional over the whole state rather than a select per leaf: the same values,
    # and one small branch to compile instead of a fusion per parameter and optimiser leaf
    # (the compile time it saved: docs/results/cost.md, "Compile time").
    ok = jnp.isfinite(loss) & _all_finite(grads) & _all_finite(new_model)
    new, static = eqx.partition((new_model, new_opt_state), eqx.is_array)
    old = eqx.filter((model, opt_state), eqx.is_array)
    model, opt_state = eqx.combine(jax.lax.cond(ok, lambda: new, lambda: old), static)
    metrics["grad_norm"] = optax.tree.norm(grads)
    metrics["bad_step"] = (~ok).astype(jnp.float32)
    step = run.step + 1  # a skipped step counts too: the data position advances
    if mesh is not None:  # keep the state's layout from step to step (no drift, no recompile)
        from ._mesh import batch_sharding, constrain_state

        model, opt_state, step = constrain_state((model, opt_state, step), mesh)
        if state is not None:
            state = jax.lax.with_sharding_constraint(state, batch_sharding(mesh, state.ndim))
    stream = None if state is None else _finite_rows(state)
    return RunState(model, opt_state, stream, step=step), metrics


@eqx.filter_jit
def make_step(
    state: RunState,
    batch: dict[str, Array],
    key: Optional[Array] = None,
    *,
    optimizer: optax.GradientTransformation,
) -> tuple[RunState, dict[str, Array]]:
    """One optimizer step: `(state, batch, key) -> (state, metrics)`.

    **Arguments:**

    - `state`: the `RunState` (`RunState.init(model, optimizer)` before the first step).
    - `batch`: `inputs`, `targets`, `mask` (see `loss_fn`).
    - `key`: PRNG key for dropout (None: no dropout).
    - `optimizer`: an optax optimizer; a static argument, so each optimizer object compiles
      the step once. A loop should use `jit_step(optimizer)` instead.

    **Returns:** the next `RunState` (model and optimizer state updated, `step` + 1; the
    carried stream state of a streaming state, see `jit_step`), and `metrics` (`loss_fn`'s,
    `grad_norm`, `bad_step`, and for models with recorded implicit adjoints
    (`solvers.record_backward`) `backward_steps`, `backward_residual`, `backward_steps/0`,
    ...), which stay on the device until the caller reads them.
    """
    return _step(state, batch, key, optimizer=optimizer)


def jit_step(optimizer: optax.GradientTransformation, *, accumulate: int = 1,
             precision: str = "float32", mesh=None, objective: Optional[Objective] = None,
             backward_fallback: bool = True):
    """`make_step` with `optimizer` bound: `step(state, batch, key=None) -> (state, metrics)`,
    `state` a `RunState`.

    **Arguments:**

    - `accumulate`: with k > 1 every batch array carries a leading micro-batch axis
      `(k, B, ...)`; the step averages the k losses, metrics and gradients (one `lax.scan`)
      and makes one update, as a batch of k·B would (up to the masks' weighting).
    - `precision`: `"float32"` or `"bfloat16"` (see `train._precision.mixed_precision`).
    - `mesh`: the `Mesh` the state lives on (`train._mesh.place_state`); the returned model,
      optimiser state and step are constrained to the same layout, the stream state to the
      batch's. None: whatever the inputs have.
    - `objective`: what is minimised (`Objective`: entropy term, local losses); default the
      cross-entropy.
    - `backward_fallback`: False leaves the `Implicit` adjoints' fallback solves out of the
      step (less to compile): a step whose backward solve misses its tolerance is then
      skipped (`bad_step` 1) where the fallback might have saved it; the training loop
      takes such a step again with a step that has them (`fit`).

    The returned state's `step` is the input's + 1.

    Streaming (truncated backpropagation through time): a state whose `stream` is not None,
    `(B, ...)`, the state each example starts from (`init_stream_state` for the first chunk,
    then the previous step's). The returned state's `stream` is the model's
    `diagnostics.state` with no gradient (nothing flows back into the previous chunk),
    examples marked by `batch["start"]` starting from zeros, and the examples whose state is
    not finite reset to zeros. With `accumulate` the state goes through the k micro-batches in
    order (consecutive chunks).

    A step whose loss, gradient or updated parameters are not finite leaves the model and
    optimizer state unchanged (its `bad_step` metric is 1; `step` still advances). Jitted
    once: it compiles on its first call and reuses that for every later call with arrays of
    the same shapes and shardings; the compiled step is freed with the returned function.
    """
    if precision not in ("float32", "bfloat16"):
        raise ValueError(f"precision={precision!r}: use 'float32' or 'bfloat16'.")
    return eqx.filter_jit(functools.partial(_step, optimizer=optimizer, accumulate=accumulate,
                                            precision=precision, mesh=mesh,
                                            objective=objective or Objective(),
                                            backward_fallback=backward_fallback))


def to_device(batch: dict[str, Any]) -> dict[str, Array]:
    return {k: jnp.asarray(v) for k, v in batch.items()}
