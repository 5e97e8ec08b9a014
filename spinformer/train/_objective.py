"""What training minimises and how a batch is scored: the objective, the loss, the carried
stream state, and evaluation."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Optional

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array

from ..solvers._fixed_point import cut_solves as _cut_solves
from ..solvers._fixed_point import plain_loops
from ._metrics import _all_diag_metrics


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


def objective_for(options) -> Objective:
    """The objective of a run's training options (a `config.TrainConfig`): its
    `entropy_weight` and `local_losses`."""
    return Objective(entropy_weight=options.entropy_weight, local_losses=options.local_losses)


def _forward(model, inputs, key, state=None):
    """Logits and diagnostics for a batch; `state (B, ...)`, if given, is passed to each
    example's call as `state=` (an attention that carries its state: streaming)."""
    keys = None if key is None else jax.random.split(key, inputs.shape[0])

    def one(x, k, s):
        extra = {} if s is None else {"state": s}
        return model(x, key=k, return_diagnostics=True, **extra)

    logits, diag = jax.vmap(one)(inputs, keys, state)
    return logits, diag


def _sums(logits, targets, mask):
    """Masked sums `(nll, correct, count)`. Float `targets` (reconstruction) score the
    outputs by the squared error averaged over each example's trailing axes (`nll` is then the
    summed mean squared error, `correct` zero); integer targets by the cross-entropy and the
    argmax."""
    if jnp.issubdtype(targets.dtype, jnp.floating):
        err = (logits.astype(jnp.float32) - targets) ** 2
        err = jnp.mean(err.reshape(*mask.shape, -1), axis=-1)
        return jnp.sum(err * mask), jnp.zeros((), jnp.float32), jnp.sum(mask)
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
    metrics = {"loss": loss, **({} if _regression(batch) else
                                {"accuracy": sums["correct"] / count}), **metrics}
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


@eqx.filter_jit
def _eval_sums(model, batch, state, objective, cut=None):
    # `cut` (a 0-d int32 array: one program for every value) stops every solve after that
    # many steps
    with _cut_solves(cut) if cut is not None else contextlib.nullcontext():
        sums, metrics, _, next_state = _batch_outputs(model, batch, None, state, objective)
    metrics.pop("penalty", None)  # a training regulariser
    return sums, metrics, next_state


_BATCH_KEYS = ("inputs", "targets", "mask", "start")


def _regression(batch) -> bool:
    """Float targets: a reconstruction batch, scored by the mean squared error (no accuracy
    or perplexity)."""
    return bool(jnp.issubdtype(jnp.asarray(batch["targets"]).dtype, jnp.floating))


def evaluate(model, batches, *, objective: Optional[Objective] = None,
             stream: bool = False, cut_solves: Optional[int] = None) -> dict[str, float]:
    """Masked loss and accuracy of `model` (inference mode) over an iterable of batches.

    **Arguments:**

    - `objective`: with `local_losses`, also each layer's `local_loss/0`, `local_accuracy/0`,
      ... (see `Objective`).
    - `stream`: the batches are consecutive chunks of streams (`data.CharText(stream=True)`):
      the model's state is carried from each batch to the next, from zeros.
    - `cut_solves`: every solve of the model stops after this many iterations of its solver
      (0: its starting point) and counts as converged (`solver_effect`); None: as trained.

    **Returns:** `{"loss", "accuracy", "perplexity"` (float targets: `"loss", "mse"`, the
    mean squared error per pixel) `[, "solver_steps", "solver_failures",
    "solver_steps/0", ..., "entropy_production", "entropy_production/0", ...,
    "local_loss/0", "local_accuracy/0", ...]}` as Python floats: losses and accuracies
    averaged over all masked positions, the diagnostics' metrics over batches.
    """
    objective = objective or Objective()
    if cut_solves is not None:
        if isinstance(cut_solves, bool) or not isinstance(cut_solves, int) or cut_solves < 0:
            raise ValueError(f"evaluate(cut_solves={cut_solves!r}): must be an int >= 0 or "
                             "None.")
        cut_solves = jnp.asarray(cut_solves, jnp.int32)  # a run-time value: one compilation
    totals: dict[str, Any] = {}
    extras: dict[str, list] = {}
    state = None
    regression = False
    for batch in batches:
        b = {k: jnp.asarray(batch[k]) for k in _BATCH_KEYS if k in batch}
        regression = _regression(b)
        if stream and state is None:
            state = init_stream_state(model, b)
        # compiled for a few calls per run: solves without lane compaction, which would cost
        # more to compile than it saves (`solvers._fixed_point.plain_loops`)
        with plain_loops():
            sums, extra, state = _eval_sums(model, b, state, objective, cut_solves)
        for k, v in sums.items():
            totals[k] = totals.get(k, 0.0) + np.asarray(v, np.float64)
        for k, v in extra.items():
            extras.setdefault(k, []).append(float(v))
    count = max(float(totals.get("count", 0.0)), 1.0)
    out = {"loss": float(totals.get("nll", 0.0)) / count}
    if regression:
        out["mse"] = out["loss"]
    else:
        out["accuracy"] = float(totals.get("correct", 0.0)) / count
        out["perplexity"] = float(np.exp(min(out["loss"], 50.0)))
    out.update({k: float(np.mean(v)) for k, v in extras.items()})
    if "layer_nll" in totals:
        for i, (n, c) in enumerate(zip(totals["layer_nll"], totals["layer_correct"])):
            out[f"local_loss/{i}"] = float(n) / count
            out[f"local_accuracy/{i}"] = float(c) / count
    return out


#: the relative change of the loss below which `solver_effect` says a model's solves do
#: nothing: cut to their starting points, they give the converged model's loss within 0.1 %
NO_EFFECT = 1e-3


def solver_effect(model, batches, *, objective: Optional[Objective] = None,
                  stream: bool = False) -> Optional[dict]:
    """Whether a model's solves matter: its loss over `batches` with every layer's solve cut
    to its starting point (`start`), to one iteration of its solver (`one_step`), and as
    trained (`converged`), from `evaluate(..., cut_solves=k)`; with the accuracies where the
    task has them. `no_effect` is True when the start's loss is within `NO_EFFECT` (0.1 %,
    relative) of the converged one: the solved equilibrium is its starting point, and a
    cheaper model without the solve would do the same. None for a model without solves
    (no solver statistics in its evaluation).

    A 2026 study of a physics-structured deep-equilibrium model (arXiv:2607.11116) found
    exactly that: skipping its solver changed accuracy by 0.00 points in 18 of 19 runs.
    Costs three evaluations (one more compilation of the evaluation step: the two cuts
    share one, their number of steps a run-time value)."""
    batches = list(batches)
    kw = dict(objective=objective, stream=stream)
    converged = evaluate(model, batches, **kw)
    if "solver_steps" not in converged:
        return None
    out = {}
    for name, metrics in (("start", evaluate(model, batches, cut_solves=0, **kw)),
                          ("one_step", evaluate(model, batches, cut_solves=1, **kw)),
                          ("converged", converged)):
        out[name] = metrics["loss"]
        if "accuracy" in metrics:
            out[f"{name}_accuracy"] = metrics["accuracy"]
    out["no_effect"] = bool(abs(out["start"] - out["converged"])
                            <= NO_EFFECT * max(abs(out["converged"]), 1e-12))
    return out
