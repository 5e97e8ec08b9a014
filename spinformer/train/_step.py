"""One pure training step, evaluation, and the optimizer."""

from __future__ import annotations

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


def _forward(model, inputs, key):
    """Logits and (if the model reports them) solver statistics for a batch."""
    if key is None:
        out = jax.vmap(lambda x: model(x, return_diagnostics=True))(inputs)
    else:
        keys = jax.random.split(key, inputs.shape[0])
        out = jax.vmap(lambda x, k: model(x, key=k, return_diagnostics=True))(inputs, keys)
    logits, diag = out
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


def _all_diag_metrics(diag) -> dict[str, Array]:
    """`_diag_metrics` of the model's diagnostics, plus `head_solver_steps` and
    `head_solver_failures` for models with a solving head (`nn.PairClassifier(pool="ngt")`)."""
    out = _diag_metrics(diag)
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


def loss_fn(model, batch: dict[str, Array], key: Optional[Array] = None):
    """Masked cross-entropy of `model` on a batch.

    **Arguments:**

    - `model`: called per example as `model(inputs[i], key=, return_diagnostics=True)`,
      returning logits `(..., C)` and diagnostics.
    - `batch`: `inputs (B, ...)`, `targets (B, ...)` int, `mask (B, ...)` float.
    - `key`: PRNG key for dropout (None: inference).

    **Returns:** `(loss, metrics)` with `loss` (the cross-entropy; the value returned also
    includes any `penalty` the diagnostics carry, logged as `penalty`), `accuracy` (masked
    means) and, for models that report solver statistics, `solver_steps` and
    `solver_failures` overall and per layer (`solver_steps/0`, `solver_failures/0`, ...) and
    the mean `spectral_radius` where the model estimates it.
    """
    logits, diag = _forward(model, batch["inputs"], key)
    nll, correct, count = _sums(logits, batch["targets"], batch["mask"])
    count = jnp.maximum(count, 1.0)
    loss = nll / count
    metrics = {"loss": loss, "accuracy": correct / count, **_all_diag_metrics(diag)}
    penalty = getattr(diag, "penalty", None)
    if penalty is not None:
        # a regulariser the model asks for (e.g. the Jacobian penalty of an implicit layer):
        # summed over layers, averaged over examples; `loss` stays the cross-entropy
        reg = jnp.sum(penalty) / penalty.shape[0]
        metrics["penalty"] = reg
        return loss + reg, metrics
    return loss, metrics


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


def _grads(model, batch, key, *, precision: str, accumulate: int):
    """`(loss, metrics), grads` of one batch, or the mean over `accumulate` micro-batches
    stacked on the leading axis of every batch array (a `lax.scan`, one compiled body)."""
    def value_and_grad(b, k):
        def loss(m):
            return loss_fn(mixed_precision(m) if precision == "bfloat16" else m, b, k)

        return eqx.filter_value_and_grad(loss, has_aux=True)(model)

    if accumulate == 1:
        return value_and_grad(batch, key)
    def body(total, xs):
        b, i = xs
        (loss, metrics), grads = value_and_grad(b, None if key is None
                                                else jax.random.fold_in(key, i))
        add = lambda a, g: a + g / accumulate  # noqa: E731
        return jax.tree.map(add, total, (loss, metrics, grads)), None

    (loss, metrics), grads0 = jax.eval_shape(
        lambda: value_and_grad(jax.tree.map(lambda x: x[0], batch), key))
    # (the gradient tree has None where the model has no inexact array: kept as is)
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), (loss, metrics, grads0))
    (loss, metrics, grads), _ = jax.lax.scan(body, zeros, (batch, jnp.arange(accumulate)))
    return (loss, metrics), grads


def _step(model, opt_state, batch, key=None, *, optimizer, accumulate: int = 1,
          precision: str = "float32", mesh=None):
    (loss, metrics), grads = _grads(model, batch, key, precision=precision,
                                    accumulate=accumulate)
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
        from ._mesh import constrain_state

        model, opt_state = constrain_state((model, opt_state), mesh)
    return model, opt_state, metrics


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
             precision: str = "float32", mesh=None):
    """`make_step` with `optimizer` bound: `step(model, opt_state, batch, key=None)`.

    **Arguments:**

    - `accumulate`: with k > 1 every batch array carries a leading micro-batch axis
      `(k, B, ...)`; the step averages the k losses, metrics and gradients (one `lax.scan`)
      and makes one update, as a batch of k·B would (up to the masks' weighting).
    - `precision`: `"float32"` or `"bfloat16"` (see `mixed_precision`).
    - `mesh`: the `Mesh` the state lives on (`train._mesh.place_state`); the returned model
      and optimiser state are constrained to the same layout. None: whatever the inputs have.

    A step whose loss, gradient or updated parameters are not finite changes nothing (its
    `bad_step` metric is 1). Jitted once: it compiles on its first call and reuses that for
    every later call with arrays of the same shapes and shardings; the compiled step is freed
    with the returned function.
    """
    if precision not in ("float32", "bfloat16"):
        raise ValueError(f"precision={precision!r}: use 'float32' or 'bfloat16'.")
    return eqx.filter_jit(functools.partial(_step, optimizer=optimizer, accumulate=accumulate,
                                            precision=precision, mesh=mesh))


@eqx.filter_jit
def _eval_sums(model, batch):
    logits, diag = _forward(model, batch["inputs"], None)
    nll, correct, count = _sums(logits, batch["targets"], batch["mask"])
    extra = _all_diag_metrics(diag)
    return nll, correct, count, extra


def evaluate(model, batches) -> dict[str, float]:
    """Masked loss and accuracy of `model` (inference mode) over an iterable of batches.

    **Returns:** `{"loss", "accuracy", "perplexity"[, "solver_steps", "solver_failures",
    "solver_steps/0", ...]}` as Python floats: loss and accuracy averaged over all masked
    positions, solver statistics over batches.
    """
    nll = correct = count = 0.0
    extras: dict[str, list] = {}
    for batch in batches:
        b = {k: jnp.asarray(batch[k]) for k in ("inputs", "targets", "mask")}
        n, c, m, extra = _eval_sums(model, b)
        nll += float(n)
        correct += float(c)
        count += float(m)
        for k, v in extra.items():
            extras.setdefault(k, []).append(float(v))
    count = max(count, 1.0)
    out = {"loss": nll / count, "accuracy": correct / count}
    out["perplexity"] = float(np.exp(min(out["loss"], 50.0)))
    out.update({k: float(np.mean(v)) for k, v in extras.items()})
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
