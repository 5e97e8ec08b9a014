"""The optimizer: AdamW with a warmup-cosine schedule and its own coupling group, and its
state."""

from __future__ import annotations

from typing import Optional

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jaxtyping import PyTree

from .. import solvers
from ..nn import param_labels


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


def optimizer_for(options) -> optax.GradientTransformation:
    """The optimizer of a run's training options (a `config.TrainConfig`): `make_optimizer`
    with its `steps`, `lr`, `coupling_lr`, `weight_decay`, `coupling_weight_decay`,
    `warmup_steps`, `min_lr_ratio` and `grad_clip`."""
    o = options
    return make_optimizer(
        steps=o.steps, lr=o.lr, coupling_lr=o.coupling_lr, weight_decay=o.weight_decay,
        coupling_weight_decay=o.coupling_weight_decay,
        warmup_steps=o.warmup_steps, min_lr_ratio=o.min_lr_ratio, grad_clip=o.grad_clip,
    )


def schedule_for(options):
    """The learning rate of `optimizer_for(options)` by step (its default group's)."""
    return make_schedule(options.lr, options.steps, options.warmup_steps, options.min_lr_ratio)


def params_of(model) -> PyTree:
    """The trainable leaves of `model` (its floating arrays; other leaves None)."""
    return eqx.filter(model, eqx.is_inexact_array)


def init_opt_state(optimizer: optax.GradientTransformation, model) -> PyTree:
    """`optimizer.init` on the trainable leaves of `model`."""
    return optimizer.init(params_of(model))


def num_params(model) -> int:
    """The number of trainable numbers in `model` (the implicit adjoints' backward-solve
    probes, `solvers.record_backward`, are not parameters and are not counted). `model` may
    be abstract (`eqx.filter_eval_shape(build, ...)`: its leaves `jax.ShapeDtypeStruct`),
    which counts a model without creating it."""
    is_adjoint = lambda x: isinstance(x, solvers.Implicit)  # noqa: E731
    no_probes = jax.tree.map(lambda x: None if is_adjoint(x) else x, model, is_leaf=is_adjoint)

    def trainable(x):
        if isinstance(x, jax.ShapeDtypeStruct):
            return jnp.issubdtype(x.dtype, jnp.inexact)
        return eqx.is_inexact_array(x)

    return int(sum(x.size for x in jax.tree.leaves(eqx.filter(no_probes, trainable))))
