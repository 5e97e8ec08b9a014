r"""The asymmetric kinetic Ising model and its Plefka[t-1,t] mean-field dynamics.

Binary spins s_t ∈ {-1, +1}^n updated in parallel (as in M. Bal, "Spin-Model Transformers"
(2023), mcbal.github.io):

    P(s_t | s_{t-1}) = Π_i exp(β s_{i,t} h_{i,t}) / (2 cosh β h_{i,t}),
    h_{i,t} = x_{i,t} + Σ_j J_ij s_{j,t-1},

with J any (generally asymmetric) matrix. Expanding around factorized distributions at times
t-1 and t (Plefka[t-1,t], Aguilera, Moosavi & Shimazaki 2021) gives

    mean field:  m_{i,t} = tanh(β(x_i + Σ_j J_ij m_{j,t-1}))
    TAP:         m_{i,t} = tanh(β(x_i + Σ_j J_ij m_{j,t-1}) − β² m_{i,t} Σ_j J_ij² (1 − m_{j,t-1}²))

and second-order equal-time and delayed correlations (`correlations`). The post writes these
with β absorbed into x and J; here β is explicit (set `beta=1.0` to use absorbed parameters).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float

from .. import solvers
from ._common import (
    DEFAULT_ADJOINT,
    Matrix,
    Scalar,
    Solver,
    Vector,
    as_float,
    check_square,
    check_vector,
)

__all__ = ["mean_field_step", "tap_step", "correlations", "entropy_production", "simulate"]


def _check(name, m_prev, x, J):
    n = check_vector(name, m_prev, "m_prev")
    check_vector(name, x, "x", n)
    check_square(name, J, n)
    return n


def mean_field_step(
    m_prev: Vector, x: Vector, J: Matrix, *, beta: Scalar = 1.0
) -> Float[Array, " n"]:
    """One naive (first-order) mean-field time step, m_t = tanh(β(x + J m_{t−1})).

    **Arguments:**

    - `m_prev`: magnetizations at t−1, shape `(n,)`.
    - `x`: external fields at t, shape `(n,)`.
    - `J`: couplings `(n, n)`, J_ij the influence of spin j at t−1 on spin i at t.
    - `beta`: inverse temperature.

    **Returns:** magnetizations at t, shape `(n,)`.
    """
    _check("mean_field_step", m_prev, x, J)
    m_prev, x, J, beta = as_float(m_prev, x, J, beta)
    return jnp.tanh(beta * (x + J @ m_prev))


def _tap_map(m, args):
    field, onsager = args
    return jnp.tanh(field - onsager * m)


def tap_step(
    m_prev: Vector, x: Vector, J: Matrix, *, beta: Scalar = 1.0, solver: Solver = None,
    adjoint: solvers.AbstractAdjoint = DEFAULT_ADJOINT, throw: bool = True,
) -> solvers.Solution:
    """One TAP time step: solves, for m = m_t,

    m_i = tanh(β(x_i + Σ_j J_ij m_{j,t−1}) − β² m_i Σ_j J_ij² (1 − m_{j,t−1}²))

    (the Onsager-corrected Plefka[t−1,t] equation of Aguilera et al. 2021). Each site's
    equation is one-dimensional and has a unique solution (its right-hand side decreases in
    m_i).

    **Arguments:** as `mean_field_step`, plus `solver` (`None`, the default, means
    `solvers.Anderson(tol=1e-6)`), `adjoint` (default `spins.vector.DEFAULT_ADJOINT`,
    `Implicit(linear_solver=GMRES(restart=5))`) and `throw`, as `solvers.fixed_point`.

    **Returns:** a `solvers.Solution` whose `value` holds the magnetizations at t, `(n,)`.
    """
    _check("tap_step", m_prev, x, J)
    m_prev, x, J, beta = as_float(m_prev, x, J, beta)
    field = beta * (x + J @ m_prev)
    onsager = beta**2 * ((J * J) @ (1.0 - m_prev * m_prev))
    m0 = jax.lax.stop_gradient(jnp.tanh(field))
    return solvers.fixed_point(
        _tap_map, m0, (field, onsager),
        solver=solvers.Anderson(tol=1e-6) if solver is None else solver, adjoint=adjoint,
        throw=throw)


def correlations(
    m: Float[ArrayLike, " n"],
    m_prev: Float[ArrayLike, " n"],
    J: Float[ArrayLike, "n n"],
    *,
    beta: float | Float[ArrayLike, ""] = 1.0,
) -> tuple[Float[Array, "n n"], Float[Array, "n n"]]:
    """Second-order Plefka[t−1,t] equal-time and delayed correlations (Aguilera et al. 2021,
    as written in Bal 2023):

    C_ik = (1 − m_i²)(1 − m_k²) β² Σ_j J_ij J_kj (1 − m_{j,t−1}²)  (i ≠ k),  C_ii = 1 − m_i²,
    D_il = β J_il (1 − m_i²)(1 − m_{l,t−1}²)(1 + 2β J_il m_i m_{l,t−1}),

    with C_ik = ⟨s_i,t s_k,t⟩ − m_i m_k and D_il = ⟨s_i,t s_l,t−1⟩ − m_i m_{l,t−1}.

    **Arguments:**

    - `m`: magnetizations at t (e.g. from `tap_step`), shape `(n,)`.
    - `m_prev`: magnetizations at t−1, shape `(n,)`.
    - `J`: couplings `(n, n)`; `beta`: inverse temperature.

    **Returns:** `(C, D)`, each `(n, n)`.
    """
    _check("correlations", m_prev, m, J)
    m, m_prev, J, beta = as_float(m, m_prev, J, beta)
    a = 1.0 - m * m
    b = 1.0 - m_prev * m_prev
    off = beta**2 * jnp.outer(a, a) * ((J * b[None, :]) @ J.T)
    C = jnp.where(jnp.eye(m.shape[0], dtype=bool), jnp.diag(a), off)
    D = beta * J * jnp.outer(a, b) * (1.0 + 2.0 * beta * J * jnp.outer(m, m_prev))
    return C, D


def entropy_production(
    J: Float[ArrayLike, "n n"],
    D: Float[ArrayLike, "n n"],
    *,
    beta: float | Float[ArrayLike, ""] = 1.0,
) -> Float[Array, ""]:
    """Entropy production per step in a steady state, σ = β Σ_ij (J_ij − J_ji) D_ij
    (M. Bal, "Entropy Production in Non-Equilibrium Neural Networks" (2026), mcbal.github.io,
    after Aguilera et al. 2021).

    σ is the mean log-ratio of forward and time-reversed transition probabilities; in a
    stationary state the field and normalization terms cancel and only the antisymmetric part
    of J paired with the delayed correlations survives. Zero for symmetric J.

    **Arguments:**

    - `J`: couplings `(n, n)`.
    - `D`: delayed correlations D_ij = ⟨s_i,t s_j,t−1⟩ − m_i m_j, shape `(n, n)`
      (from `correlations`, or measured).
    - `beta`: inverse temperature (1.0 when β is absorbed into J).

    **Returns:** a scalar (≥ 0 for exact stationary D).
    """
    if jnp.ndim(J) != 2:
        raise ValueError(f"entropy_production: J must have shape (n, n), got {jnp.shape(J)}.")
    n = jnp.shape(J)[0]
    check_square("entropy_production", J, n)
    check_square("entropy_production", D, n, what="D")
    J, D, beta = as_float(J, D, beta)
    return beta * jnp.sum((J - J.T) * D)


def simulate(
    m0: Float[ArrayLike, " n"],
    x: Float[ArrayLike, " n"] | Float[ArrayLike, "steps n"],
    J: Float[ArrayLike, "n n"],
    *,
    beta: float | Float[ArrayLike, ""] = 1.0,
    steps: int,
    method: str = "mean_field",
    solver: solvers.AbstractSolver | None = None,
    throw: bool = True,
) -> Float[Array, "steps n"]:
    """Mean-field time evolution m_0 → m_1 → … → m_steps with `jax.lax.scan`.

    **Arguments:**

    - `m0`: initial magnetizations `(n,)`.
    - `x`: fields, `(n,)` (the same at every step) or `(steps, n)` (one per step).
    - `J`: couplings `(n, n)`; `beta`: inverse temperature.
    - `steps`: number of time steps (a Python int).
    - `method`: `"mean_field"` (`mean_field_step`) or `"tap"` (`tap_step`).
    - `solver`, `throw`: passed to `tap_step` when `method="tap"`.

    **Returns:** the trajectory m_1, …, m_steps, shape `(steps, n)`. vmap over `m0` for many
    initial states and over `(x, J)` for parameter samples.
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"simulate: steps={steps!r} must be a Python int >= 1.")
    if method not in ("mean_field", "tap"):
        raise ValueError(f"simulate: method={method!r}; choose 'mean_field' or 'tap'.")
    n = check_vector("simulate", m0, "m0")
    check_square("simulate", J, n)
    xs = jnp.shape(x)
    if xs == (n,):
        per_step = False
    elif xs == (steps, n):
        per_step = True
    else:
        raise ValueError(
            f"simulate: x must have shape (n,) = ({n},) or (steps, n) = ({steps}, {n}), got {xs}."
        )
    m0, x, J, beta = as_float(m0, x, J, beta)

    def step(m, x_t):
        if method == "mean_field":
            new = mean_field_step(m, x_t, J, beta=beta)
        else:
            new = tap_step(m, x_t, J, beta=beta, solver=solver, throw=throw).value
        return new, new

    if per_step:
        _, traj = jax.lax.scan(step, m0, x)
    else:
        _, traj = jax.lax.scan(lambda m, _: step(m, x), m0, None, length=steps)
    return traj
