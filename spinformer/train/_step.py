"""One pure training step, evaluation, and the optimizer."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jaxtyping import Array, PyTree

from .. import solvers
from ..nn import Diagnostics, param_labels


@dataclasses.dataclass(frozen=True)
class Objective:
    """What a training step minimises besides the cross-entropy of the model's logits.

    **Arguments:**

    - `entropy_weight`: w. The loss gains `w * σ`, where σ is the entropy production the
      model reports (`diagnostics.entropy_production`, per layer and head; e.g. spin
      attention's, M. Bal, "Entropy Production in Non-Equilibrium Neural Networks" (2026),
      mcbal.github.io) summed over layers and averaged over examples and heads: w > 0
      minimises it, w < 0 maximises it. Nonzero w with a model that reports none is a
      `ValueError` when the step is traced.
    - `local_losses`: train on the sum over layers of each layer's own cross-entropy, from
      `model.layer_logits(diagnostics.hidden)` (the final norm and readout applied to every
      block's output). Build the model with `detach_layers=True` so that no gradient flows
      through the stack: each block then learns only from its own readout. `loss` and
      `accuracy` stay the last layer's (the model's logits).

    The default, `Objective()`, is the plain cross-entropy.
    """

    entropy_weight: float = 0.0
    local_losses: bool = False


def _forward(model, inputs, key, state=None):
    """Logits and diagnostics for a batch; `state (B, ...)`, if given, is passed to each
    example's call as `state=` (an attention that carries its state: streaming)."""
    keys = None if key is None else jax.random.split(key, inputs.shape[0])

    def one(x, k, s):
        extra = {} if s is None else {"state": s}
        return model(x, key=k, return_diagnostics=True, **extra)

    logits, diag = jax.vmap(one)(inputs, keys, state)
    return logits, diag


def _diag_metrics(diag: Optional[Diagnostics]) -> dict[str, Array]:
    """Forward solver statistics: overall means `solver_steps`, `solver_failures` (the
    fraction of solves whose result is not `RESULTS.successful`), and, for models whose
    diagnostics are stacked over layers (`(batch, depth, ...)`), the same per layer:
    `solver_steps/0`, `solver_failures/0`, ...; none for models that solve nothing."""
    if diag is None or diag.solver is None:
        return {}
    failed = diag.solver.result != solvers.RESULTS.successful
    series = {
        "solver_steps": diag.solver.num_steps.astype(jnp.float32),
        "solver_failures": failed.astype(jnp.float32),
    }
    out = {name: jnp.mean(v) for name, v in series.items()}
    rho = getattr(diag, "spectral_radius", None)
    if rho is not None:
        out["spectral_radius"] = jnp.mean(rho)
    for name, v in series.items():
        if v.ndim >= 2:
            per_layer = jnp.mean(v, axis=(0, *range(2, v.ndim)))
            out.update({f"{name}/{i}": per_layer[i] for i in range(per_layer.shape[0])})
    return out


def _entropy_metrics(diag) -> dict[str, Array]:
    """`entropy_production` (summed over layers, averaged over examples and heads) and, for
    diagnostics stacked over layers (`(batch, depth, H)`), `entropy_production/0`, ...; none
    for models that do not report it."""
    sigma = getattr(diag, "entropy_production", None)
    if sigma is None:
        return {}
    sigma = sigma.astype(jnp.float32)
    if sigma.ndim < 3:  # (batch, H): one layer
        return {"entropy_production": jnp.mean(sigma)}
    per_layer = jnp.mean(sigma, axis=(0, *range(2, sigma.ndim)))
    out = {"entropy_production": jnp.sum(per_layer)}
    out.update({f"entropy_production/{i}": per_layer[i] for i in range(per_layer.shape[0])})
    return out


def _all_diag_metrics(diag) -> dict[str, Array]:
    """`_diag_metrics` and `_entropy_metrics` of the model's diagnostics, plus
    `head_solver_steps` and `head_solver_failures` for models with a solving head
    (`nn.PairClassifier(pool="ngt")`)."""
    out = {**_diag_metrics(diag), **_entropy_metrics(diag)}
    head = getattr(diag, "head", None)
    if head is not None and head.solver is not None:
        failed = head.solver.result != solvers.RESULTS.successful
        out["head_solver_steps"] = jnp.mean(head.solver.num_steps.astype(jnp.float32))
        out["head_solver_failures"] = jnp.mean(failed.astype(jnp.float32))
    return out


def _sums(logits, targets, mask):
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    correct = (jnp.argmax(logits, axis=-1) == targets).astype(jnp.float32)
    return jnp.sum(nll * mask), jnp.sum(correct * mask), jnp.sum(mask)


def _reset(state, batch):
    """`state` with the examples whose chunk starts a stream (`batch["start"]`) set to zeros
    ("no history")."""
    if state is None or "start" not in batch:
        return state
    start = batch["start"].astype(bool).reshape(-1, *([1] * (state.ndim - 1)))
    return jnp.where(start, jnp.zeros_like(state), state)


def _batch_outputs(model, batch, key, state, objective: Objective):
    """One forward pass of a batch: `(sums, metrics, extra_loss, next_state)`.

    `sums`: masked sums `nll`, `correct`, `count` of the logits, and with local losses
    `layer_nll`, `layer_correct` `(depth,)`; `metrics`: the diagnostics' (`_all_diag_metrics`,
    `penalty`); `extra_loss`: what the objective adds to the cross-entropy (the entropy term
    and the diagnostics' penalty); `next_state`: `diagnostics.state` with no gradient (None
    without `state`)."""
    state = _reset(state, batch)
    targets, mask = batch["targets"], batch["mask"]
    logits, diag = _forward(model, batch["inputs"], key, state)
    nll, correct, count = _sums(logits, targets, mask)
    sums = {"nll": nll, "correct": correct, "count": count}
    if objective.local_losses:
        hidden = getattr(diag, "hidden", None)
        if hidden is None or not hasattr(model, "layer_logits"):
            raise ValueError(
                "local losses need a model with per-layer readouts (`layer_logits`, e.g. "
                "nn.CausalLM or nn.Tagger) whose diagnostics carry every block's output "
                f"(diagnostics.hidden); {type(model).__name__} has "
                + ("no layer_logits." if not hasattr(model, "layer_logits") else
                   "no diagnostics.hidden."))
        per_layer = jnp.moveaxis(jax.vmap(model.layer_logits)(hidden), 1, 0)
        sums["layer_nll"], sums["layer_correct"], _ = jax.vmap(
            lambda lg: _sums(lg, targets, mask))(per_layer)
    metrics = _all_diag_metrics(diag)
    extra = jnp.zeros((), jnp.float32)
    if objective.entropy_weight:
        if "entropy_production" not in metrics:
            raise ValueError(
                f"entropy_weight={objective.entropy_weight}: {type(model).__name__} reports no "
                "entropy production (diagnostics.entropy_production); use an attention that "
                "does (spin self-attention), or entropy_weight=0.")
        extra = extra + objective.entropy_weight * metrics["entropy_production"]
    penalty = getattr(diag, "penalty", None)
    if penalty is not None:
        # a regulariser the model asks for (e.g. the Jacobian penalty of an implicit layer):
        # summed over layers, averaged over examples
        metrics["penalty"] = jnp.sum(penalty) / penalty.shape[0]
        extra = extra + metrics["penalty"]
    next_state = None
    if state is not None:
        carried = getattr(diag, "state", None)
        if carried is None:
            raise ValueError(f"{type(model).__name__} reports no state (diagnostics.state) to "
                             "carry into the next call; streaming needs an attention that "
                             "carries one.")
        next_state = jax.lax.stop_gradient(carried)  # truncated history
    return sums, metrics, extra, next_state


def _objective(model, batch, key, state, objective: Objective):
    """`(value, (metrics, next_state))`: the value minimised (the cross-entropy, or the sum
    of the layers' local losses, plus the entropy term and any penalty) and the metrics."""
    sums, metrics, extra, next_state = _batch_outputs(model, batch, key, state, objective)
    count = jnp.maximum(sums["count"], 1.0)
    loss = sums["nll"] / count
    metrics = {"loss": loss, "accuracy": sums["correct"] / count, **metrics}
    value = loss
    if objective.local_losses:
        local = sums["layer_nll"] / count
        accuracy = sums["layer_correct"] / count
        metrics.update({f"local_loss/{i}": local[i] for i in range(local.shape[0])})
        metrics.update({f"local_accuracy/{i}": accuracy[i] for i in range(local.shape[0])})
        value = jnp.sum(local)
    return value + extra, (metrics, next_state)


def loss_fn(model, batch: dict[str, Array], key: Optional[Array] = None, *,
            objective: Optional[Objective] = None, state: Optional[Array] = None):
    """Masked cross-entropy of `model` on a batch, plus what `objective` adds.

    **Arguments:**

    - `model`: called per example as `model(inputs[i], key=, return_diagnostics=True)`
      (and `state=state[i]` with `state`), returning logits `(..., C)` and diagnostics.
    - `batch`: `inputs (B, ...)`, `targets (B, ...)` int, `mask (B, ...)` float; optionally
      `start (B,)` bool (streaming: examples whose `state` is reset to zeros).
    - `key`: PRNG key for dropout (None: inference).
    - `objective`: an `Objective` (default: the plain cross-entropy).
    - `state`: streaming: `(B, ...)` the state each example's call starts from (the previous
      chunk's `next_state`; zeros for "no history").

    **Returns:** `(loss, metrics)`, or with `state` `(loss, (metrics, next_state))` where
    `next_state` is the model's `diagnostics.state` with its gradient stopped (truncated
    history). `loss` is the value minimised: the cross-entropy (or, with local losses, the
    sum over layers of `local_loss/0`, ...), plus the entropy term and any `penalty` the
    diagnostics carry. `metrics`: `loss` (the cross-entropy of the model's logits),
    `accuracy` (masked means); `penalty`; for models that report solver statistics
    `solver_steps` and `solver_failures` overall and per layer (`solver_steps/0`, ...) and
    the mean `spectral_radius` where the model estimates it; `entropy_production` (summed
    over layers) and `entropy_production/0`, ... where the model reports it; with local
    losses `local_loss/0`, `local_accuracy/0`, ....
    """
    value, (metrics, next_state) = _objective(model, batch, key, state,
                                              objective or Objective())
    return (value, metrics) if state is None else (value, (metrics, next_state))


def init_stream_state(model, batch: dict[str, Array]) -> Array:
    """Zeros shaped like the state `model` reports for `batch` (`(B, depth, n, d)` for a
    `SequenceModel`): the state of the first chunk of a stream, "no history" (m_{t-1} = 0;
    a first-order time step from it gives φ(x)). A `ValueError` if the model reports none."""
    def state_of(m, inputs):
        return getattr(_forward(m, inputs, None)[1], "state", None)

    shape = eqx.filter_eval_shape(state_of, model, jnp.asarray(batch["inputs"]))
    if shape is None:
        raise ValueError(f"{type(model).__name__} reports no state (diagnostics.state) to carry "
                         "into the next call; streaming needs an attention that carries one.")
    return jnp.zeros(shape.shape, shape.dtype)


def _backward_metrics(records: list[Array]) -> dict[str, Array]:
    """Backward-solve statistics from `solvers.backward_stats` records (each `(..., 3)`:
    solves, matrix–vector products, relative residuals, summed): `backward_steps` (products
    per solve; −1 for a linear solver that does not count them, BiCGStab) and
    `backward_residual` (mean relative residual) overall, and per layer (`backward_steps/0`,
    ...) when the records have a leading layer axis."""
    if not records:
        return {}

    def means(r):
        solves = jnp.maximum(r[..., 0], 1.0)
        return r[..., 1] / solves, r[..., 2] / solves

    total = sum(r.reshape(-1, 3).sum(0) for r in records)
    out = dict(zip(("backward_steps", "backward_residual"), means(total)))
    if all(r.shape == records[0].shape for r in records) and records[0].ndim == 2:
        steps, _ = means(sum(records))
        out.update({f"backward_steps/{i}": steps[i] for i in range(steps.shape[0])})
    return out


class _MixedLinear(eqx.Module):
    """An `eqx.nn.Linear` whose product runs in bfloat16 with float32 accumulation and
    output; its parameters (`weight`, `bias`, read through) stay float32."""

    inner: eqx.nn.Linear

    @property
    def weight(self):
        return self.inner.weight

    @property
    def bias(self):
        return self.inner.bias

    def __getattr__(self, name):  # in_features, out_features, use_bias, ...
        return getattr(self.inner, name)

    def __call__(self, x, *, key=None):
        w = self.inner.weight
        y = jnp.matmul(w.astype(jnp.bfloat16), x.astype(jnp.bfloat16),
                       preferred_element_type=jnp.float32).astype(x.dtype)
        if self.inner.bias is not None:
            y = y + self.inner.bias
        return y


def mixed_precision(model):
    """`model` with every `eqx.nn.Linear` computing in bfloat16 (float32 accumulation and
    output). Parameters, their gradients and everything else — the attention's fixed-point
    solves, LayerNorm, softmax, the loss — stay float32: a solve's tolerance (1e-4 .. 1e-6)
    is below bfloat16's resolution (2^-8 ~ 4e-3), so a bfloat16 solve would never report
    convergence, and its implicit gradient needs the accurate fixed point."""
    is_linear = lambda m: isinstance(m, eqx.nn.Linear)  # noqa: E731
    return jax.tree.map(lambda m: _MixedLinear(m) if is_linear(m) else m, model,
                        is_leaf=is_linear)


def _all_finite(tree) -> Array:
    leaves = [x for x in jax.tree.leaves(eqx.filter(tree, eqx.is_inexact_array))]
    if not leaves:
        return jnp.asarray(True)
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]))


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


def _step(model, opt_state, batch, key=None, state=None, *, optimizer, accumulate: int = 1,
          precision: str = "float32", mesh=None, objective: Optional[Objective] = None):
    (loss, metrics), grads, state = _grads(model, batch, key, state, precision=precision,
                                           accumulate=accumulate,
                                           objective=objective or Objective())
    # the backward-solve records ride on probe cotangents: log them, keep them from the update
    grads, records = solvers.backward_stats(grads)
    metrics.update(_backward_metrics(records))
    params = eqx.filter(model, eqx.is_inexact_array)
    updates, new_opt_state = optimizer.update(grads, opt_state, params)
    new_model = eqx.apply_updates(model, updates)
    # a non-finite loss, gradient or update is skipped: parameters and optimiser state stay
    ok = jnp.isfinite(loss) & _all_finite(grads) & _all_finite(new_model)
    keep = lambda new, old: jnp.where(ok, new, old) if eqx.is_array(new) else new  # noqa: E731
    model = jax.tree.map(keep, new_model, model)
    opt_state = jax.tree.map(keep, new_opt_state, opt_state)
    metrics["grad_norm"] = optax.tree.norm(grads)
    metrics["bad_step"] = (~ok).astype(jnp.float32)
    if mesh is not None:  # keep the state's layout from step to step (no drift, no recompile)
        from ._mesh import batch_sharding, constrain_state

        model, opt_state = constrain_state((model, opt_state), mesh)
        if state is not None:
            state = jax.lax.with_sharding_constraint(state, batch_sharding(mesh, state.ndim))
    if state is None:
        return model, opt_state, metrics
    return model, opt_state, metrics, _finite_rows(state)


@eqx.filter_jit
def make_step(
    model,
    opt_state,
    batch: dict[str, Array],
    key: Optional[Array] = None,
    *,
    optimizer: optax.GradientTransformation,
):
    """One optimizer step: `(model, opt_state, batch, key) -> (model, opt_state, metrics)`.

    **Arguments:**

    - `model`, `opt_state`: the model and `init_opt_state(optimizer, model)`.
    - `batch`: `inputs`, `targets`, `mask` (see `loss_fn`).
    - `key`: PRNG key for dropout (None: no dropout).
    - `optimizer`: an optax optimizer; a static argument, so each optimizer object compiles
      the step once. A loop should use `jit_step(optimizer)` instead.

    **Returns:** the updated model and optimizer state, and `metrics` (`loss_fn`'s,
    `grad_norm`, and for models with recorded implicit adjoints (`solvers.record_backward`)
    `backward_steps`, `backward_residual`, `backward_steps/0`, ...), which stay on the device
    until the caller reads them.
    """
    return _step(model, opt_state, batch, key, optimizer=optimizer)


def jit_step(optimizer: optax.GradientTransformation, *, accumulate: int = 1,
             precision: str = "float32", mesh=None, objective: Optional[Objective] = None):
    """`make_step` with `optimizer` bound: `step(model, opt_state, batch, key=None,
    state=None)`.

    **Arguments:**

    - `accumulate`: with k > 1 every batch array carries a leading micro-batch axis
      `(k, B, ...)`; the step averages the k losses, metrics and gradients (one `lax.scan`)
      and makes one update, as a batch of k·B would (up to the masks' weighting).
    - `precision`: `"float32"` or `"bfloat16"` (see `mixed_precision`).
    - `mesh`: the `Mesh` the state lives on (`train._mesh.place_state`); the returned model
      and optimiser state are constrained to the same layout. None: whatever the inputs have.
    - `objective`: what is minimised (`Objective`: entropy term, local losses); default the
      cross-entropy.

    Streaming (truncated backpropagation through time): pass `state (B, ...)`, the state
    each example starts from (`init_stream_state` for the first chunk, then the previous
    step's); the step then returns `(model, opt_state, metrics, next_state)`, `next_state`
    the model's `diagnostics.state` with no gradient (nothing flows back into the previous
    chunk), examples marked by `batch["start"]` starting from zeros, and the examples whose
    state is not finite reset to zeros. With `accumulate` the state goes through the k
    micro-batches in order (consecutive chunks).

    A step whose loss, gradient or updated parameters are not finite changes nothing (its
    `bad_step` metric is 1). Jitted once: it compiles on its first call and reuses that for
    every later call with arrays of the same shapes and shardings; the compiled step is freed
    with the returned function.
    """
    if precision not in ("float32", "bfloat16"):
        raise ValueError(f"precision={precision!r}: use 'float32' or 'bfloat16'.")
    return eqx.filter_jit(functools.partial(_step, optimizer=optimizer, accumulate=accumulate,
                                            precision=precision, mesh=mesh,
                                            objective=objective or Objective()))


@eqx.filter_jit
def _eval_sums(model, batch, state, objective):
    sums, metrics, _, next_state = _batch_outputs(model, batch, None, state, objective)
    metrics.pop("penalty", None)  # a training regulariser
    return sums, metrics, next_state


_BATCH_KEYS = ("inputs", "targets", "mask", "start")


def evaluate(model, batches, *, objective: Optional[Objective] = None,
             stream: bool = False) -> dict[str, float]:
    """Masked loss and accuracy of `model` (inference mode) over an iterable of batches.

    **Arguments:**

    - `objective`: with `local_losses`, also each layer's `local_loss/0`, `local_accuracy/0`,
      ... (see `Objective`).
    - `stream`: the batches are consecutive chunks of streams (`data.CharText(stream=True)`):
      the model's state is carried from each batch to the next, from zeros.

    **Returns:** `{"loss", "accuracy", "perplexity"[, "solver_steps", "solver_failures",
    "solver_steps/0", ..., "entropy_production", "entropy_production/0", ...,
    "local_loss/0", "local_accuracy/0", ...]}` as Python floats: losses and accuracies
    averaged over all masked positions, the diagnostics' metrics over batches.
    """
    objective = objective or Objective()
    totals: dict[str, Any] = {}
    extras: dict[str, list] = {}
    state = None
    for batch in batches:
        b = {k: jnp.asarray(batch[k]) for k in _BATCH_KEYS if k in batch}
        if stream and state is None:
            state = init_stream_state(model, b)
        sums, extra, state = _eval_sums(model, b, state, objective)
        for k, v in sums.items():
            totals[k] = totals.get(k, 0.0) + np.asarray(v, np.float64)
        for k, v in extra.items():
            extras.setdefault(k, []).append(float(v))
    count = max(float(totals.get("count", 0.0)), 1.0)
    out = {"loss": float(totals.get("nll", 0.0)) / count,
           "accuracy": float(totals.get("correct", 0.0)) / count}
    out["perplexity"] = float(np.exp(min(out["loss"], 50.0)))
    out.update({k: float(np.mean(v)) for k, v in extras.items()})
    if "layer_nll" in totals:
        for i, (n, c) in enumerate(zip(totals["layer_nll"], totals["layer_correct"])):
            out[f"local_loss/{i}"] = float(n) / count
            out[f"local_accuracy/{i}"] = float(c) / count
    return out


def make_schedule(peak: float, steps: int, warmup_steps: int, min_lr_ratio: float):
    """Linear warmup from 0 to `peak`, then cosine decay to `peak * min_lr_ratio`."""
    warmup = min(warmup_steps, max(steps - 1, 0))
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0 if warmup > 0 else peak,
        peak_value=peak,
        warmup_steps=warmup,
        decay_steps=max(steps, warmup + 1),
        end_value=peak * min_lr_ratio,
    )


def make_optimizer(
    *,
    steps: int,
    lr: float,
    coupling_lr: Optional[float] = None,
    weight_decay: float = 0.0,
    coupling_weight_decay: Optional[float] = None,
    warmup_steps: int = 0,
    min_lr_ratio: float = 0.1,
    grad_clip: float = 0.0,
) -> optax.GradientTransformation:
    """AdamW with warmup + cosine schedule, optional global-norm clipping, and a separate
    learning rate and weight decay for the coupling parameters (labelled by
    `spinformer.nn.param_labels`: e.g. the Ising couplings J of Boltzmann attention, the
    LR_J of Kim & Park 2026, §4.1). `None` for `coupling_lr` / `coupling_weight_decay` means the defaults'."""
    groups = {
        "default": optax.adamw(make_schedule(lr, steps, warmup_steps, min_lr_ratio),
                               weight_decay=weight_decay),
        "couplings": optax.adamw(
            make_schedule(lr if coupling_lr is None else coupling_lr, steps, warmup_steps,
                          min_lr_ratio),
            weight_decay=weight_decay if coupling_weight_decay is None else coupling_weight_decay,
        ),
    }
    tx = optax.multi_transform(groups, param_labels)
    if grad_clip and grad_clip > 0:
        tx = optax.chain(optax.clip_by_global_norm(grad_clip), tx)
    return tx


def params_of(model) -> PyTree:
    """The trainable leaves of `model` (its floating arrays; other leaves None)."""
    return eqx.filter(model, eqx.is_inexact_array)


def init_opt_state(optimizer: optax.GradientTransformation, model) -> PyTree:
    """`optimizer.init` on the trainable leaves of `model`."""
    return optimizer.init(params_of(model))


def num_params(model) -> int:
    """The number of trainable numbers in `model` (the implicit adjoints' backward-solve
    probes, `solvers.record_backward`, are not parameters and are not counted)."""
    is_adjoint = lambda x: isinstance(x, solvers.Implicit)  # noqa: E731
    no_probes = jax.tree.map(lambda x: None if is_adjoint(x) else x, model, is_leaf=is_adjoint)
    return int(sum(x.size for x in jax.tree.leaves(eqx.filter(no_probes, eqx.is_inexact_array))))


def to_device(batch: dict[str, Any]) -> dict[str, Array]:
    return {k: jnp.asarray(v) for k, v in batch.items()}
