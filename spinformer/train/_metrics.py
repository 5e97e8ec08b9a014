"""Metrics read off a model's diagnostics: solver effort per layer, entropy production, and
the backward solves' records."""

from __future__ import annotations

from typing import Optional

import jax.numpy as jnp
from jaxtyping import Array

from .. import solvers
from ..nn import Diagnostics


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


def _backward_metrics(records: list[Array]) -> dict[str, Array]:
    """Backward-solve statistics from `solvers.backward_stats` records (each `(..., 4)`:
    solves, matrix–vector products, relative residuals, fallbacks run, summed):
    `backward_steps` (products per solve; −1 for a linear solver that does not count them,
    BiCGStab), `backward_residual` (mean relative residual) and `backward_fallbacks` (the
    fraction of solves whose first solver missed its tolerance and that ran the adjoint's
    fallback) overall, and per layer (`backward_steps/0`, ...) when the records have a
    leading layer axis."""
    if not records:
        return {}

    def means(r):
        solves = jnp.maximum(r[..., 0], 1.0)
        return r[..., 1] / solves, r[..., 2] / solves

    total = sum(r.reshape(-1, 4).sum(0) for r in records)
    out = dict(zip(("backward_steps", "backward_residual"), means(total)))
    out["backward_fallbacks"] = total[3] / jnp.maximum(total[0], 1.0)
    if all(r.shape == records[0].shape for r in records) and records[0].ndim == 2:
        steps, _ = means(sum(records))
        out.update({f"backward_steps/{i}": steps[i] for i in range(steps.shape[0])})
    return out
