"""Training FLOPs: XLA's count of a step's arithmetic, with every solver loop counted for the
iterations it takes.

XLA's cost analysis counts a loop's body once, whatever its trip count. `step_flops` counts a
config's training step on straight-line variants of it instead, and returns the step's FLOPs
as a function of the iterations its solves take (`StepFlops`), which the trainer applies to
every step's own counts (`fit(flops=...)`).
"""

from __future__ import annotations

import contextlib
import math
from typing import NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp

from .. import config as _config
from .. import solvers as _solvers
from ._build import build_dataset, build_model, build_objective, build_optimizer
from ._loop import train_batch
from ._objective import loss_fn
from ._state import RunState
from ._step import jit_step

MAX_SCAN = 64  # fixed-length scans up to this length are written out while counting
_UNROLLABLE = (_solvers.Picard, _solvers.Anderson)  # the solvers with `unroll`


class StepFlops(NamedTuple):
    """A training step's FLOPs, `base + forward_iteration * k_f + backward_product * p_b`,
    with `k_f` the mean forward iterations per solve and `p_b` the mean products per backward
    solve (a step's metrics `solver_steps` and `backward_steps`; `fixed_products` instead
    when the adjoint takes a fixed number, as `Phantom(steps)` does).

    `exact` is False when a loop could not be written out (the free-energy saddle's Newton
    iteration: counted once), so the count is a lower bound.
    """

    base: float
    forward_iteration: float = 0.0
    backward_product: float = 0.0
    fixed_products: float = math.nan
    exact: bool = True

    def __call__(self, solver_steps: float = 0.0, backward_steps: float = 0.0) -> float:
        """The FLOPs of a step whose solves took `solver_steps` forward iterations and
        `backward_steps` backward products on average (a negative count, from a backward
        solve that does not count its products, is taken as one product)."""
        p_b = self.fixed_products if math.isfinite(self.fixed_products) else backward_steps
        return (self.base + self.forward_iteration * solver_steps
                + self.backward_product * (p_b if p_b >= 0 else 1.0))

    def of_metrics(self, metrics) -> float:
        """`self(...)` with the counts of a step's metrics (absent counts are 0)."""
        return self(float(metrics.get("solver_steps", 0.0)),
                    float(metrics.get("backward_steps", 0.0)))


def xla_flops(fn, *args) -> float:
    """XLA's FLOP count of `fn(*args)` as lowered (the program as traced, before XLA's own
    optimisations; nothing is compiled or run). A loop's body counts once."""
    cost = eqx.filter_jit(fn).lower(*args).lowered.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return float((cost or {}).get("flops", 0.0))


@contextlib.contextmanager
def scans_written_out(max_len: int = MAX_SCAN):
    """Within it, every `jax.lax.scan` of at most `max_len` steps is traced unrolled (the
    stacked layers' scan over depth, the Energy Transformer's descent), so that XLA counts
    each step."""
    scan = jax.lax.scan

    def unrolled(f, init, xs=None, length=None, **kw):
        n = length if length is not None else len(jax.tree.leaves(xs)[0])
        return scan(f, init, xs, length, **({**kw, "unroll": True} if n <= max_len else kw))

    jax.lax.scan = unrolled
    try:
        yield
    finally:
        jax.lax.scan = scan


def _counts(cfg: "_config.Config", dataset, step: bool = True) -> tuple[float, float]:
    """XLA's FLOPs of `cfg`'s training step (NaN with `step=False`: not lowered) and of its
    forward loss alone, scans written out, on the first training batch of `dataset`."""
    with scans_written_out():
        model = build_model(cfg, dataset, key=jax.random.key(0))
        optimizer = build_optimizer(cfg)
        objective = build_objective(cfg)
        state = RunState.init(model, optimizer)
        batch = {k: jnp.asarray(v) for k, v in
                 train_batch(dataset, 0, cfg.train.accumulate).items()}
        key = jax.random.key(0)
        full = math.nan
        if step:
            full = xla_flops(jit_step(optimizer, accumulate=cfg.train.accumulate,
                                      precision=cfg.train.precision, objective=objective),
                             state, batch, key)
        one = jax.tree.map(lambda v: v[0], batch) if cfg.train.accumulate > 1 else batch
        fwd = xla_flops(lambda m, b, k: loss_fn(m, b, k, objective=objective)[0],
                        state.model, one, key) * cfg.train.accumulate
    return full, fwd


def unrolled_config(cfg: "_config.Config", k: int, adjoint: bool = True,
                    picard: bool = False):
    """`cfg` with its attention's solver unrolled to `k` iterations (`picard`: plain Picard
    iterations with the solver's damping) and, with `adjoint`, the unrolled adjoint (where
    the attention's settings have one); None when the attention has no solver that
    unrolls."""
    if not isinstance(getattr(cfg.model.attention, "solver", None), _UNROLLABLE):
        return None
    changes = {"model.attention.solver.unroll": True, "model.attention.solver.max_steps": k}
    if picard:
        changes["model.attention.solver.name"] = "picard"
    if adjoint and hasattr(cfg.model.attention, "adjoint"):
        changes["model.attention.adjoint"] = "unrolled"
    return cfg.replace(changes)


def step_flops(cfg: "_config.Config", dataset=None) -> StepFlops:
    """The training step of `cfg` as FLOPs per solver iteration (`StepFlops`).

    Counted by XLA on straight-line variants of the step (scans written out; about four
    traces, nothing compiled):

    - one forward iteration: the forward loss with the attention's own solver unrolled to 3
      iterations minus 2;
    - one backward product (a VJP of the map): the step with plain Picard unrolled to 3
      iterations and the unrolled adjoint, minus 2, less the forward iteration (through
      Anderson the unrolled adjoint would also differentiate the mixing, which the implicit
      adjoint never does);
    - `base`: the two-Picard-iteration step less two forward iterations and two products.

    An attention without a solver (softmax, exact Boltzmann, spin time steps) is counted as
    it is; one whose loop does not unroll (the free-energy saddle) is counted once, `exact`
    False. An attention of one's own whose settings have a solver but no `adjoint` has its
    backward product estimated as two forward iterations (`exact` False). `dataset`:
    `build_dataset(cfg)` by default.
    """
    if cfg.data.stream:
        raise _config.ConfigError("counting training FLOPs (train.count_flops) does not "
                                  "support data.stream=true: its steps carry a state.")
    dataset = build_dataset(cfg) if dataset is None else dataset
    section = cfg.model.attention
    if unrolled_config(cfg, 1) is None:
        has_loop = isinstance(getattr(section, "solver", None), _solvers.AbstractSolver)
        return StepFlops(_counts(cfg, dataset)[0], exact=not has_loop)
    if not hasattr(section, "adjoint"):
        # an attention of one's own that takes no adjoint option: its solves differentiate
        # with the module's own choice, whose loop a config cannot unroll. The forward
        # iteration is counted; a backward product is taken as two forward iterations (a
        # VJP of the map), and the count is marked inexact
        (f2, g2), g3 = (_counts(unrolled_config(cfg, 2, adjoint=False), dataset),
                        _counts(unrolled_config(cfg, 3, adjoint=False), dataset, step=False)[1])
        d_f = g3 - g2
        return StepFlops(f2 - 2 * d_f - 2 * d_f, d_f, 2 * d_f, exact=False)
    # increments from 2 to 3 iterations: the first iteration of an unrolled loop costs a
    # little less (no cotangents to add up yet, Anderson without history)
    f2p, g2p = _counts(unrolled_config(cfg, 2, picard=True), dataset)
    f3p, g3p = _counts(unrolled_config(cfg, 3, picard=True), dataset)
    if isinstance(section.solver, _solvers.Picard):
        g2, g3 = g2p, g3p
    else:
        g2, g3 = (_counts(unrolled_config(cfg, k, adjoint=False), dataset, step=False)[1]
                  for k in (2, 3))
    d_f, d_b = g3 - g2, (f3p - f2p) - (g3p - g2p)
    base = f2p - 2 * (g3p - g2p) - 2 * d_b
    adjoint = getattr(section, "adjoint", None)
    fixed = float(adjoint.steps) if isinstance(adjoint, _solvers.Phantom) else math.nan
    if isinstance(adjoint, _solvers.OneStep):
        fixed = 1.0
    if isinstance(adjoint, _solvers.Unrolled):  # backpropagation through every iteration
        return StepFlops(base, d_f + d_b, 0.0)
    return StepFlops(base, d_f, d_b, fixed)
