"""Shared problems for the solver tests, with independent numpy references, and the jaxopt
reference solver the tests compare ours against."""

from typing import Any, Callable

import equinox as eqx
import numpy as np
import jax.numpy as jnp

from spinformer import solvers as S
from spinformer.solvers._solvers import _check_damping, _FixedPointProblem


def random_contraction(rng, n, norm=0.5):
    """A random matrix with spectral norm `norm` (so x -> A x + b contracts)."""
    A = rng.normal(size=(n, n))
    return A * (norm / np.linalg.norm(A, 2))


def linear_map(x, args):
    A, b = args
    return A @ x + b


def tanh_map(x, args):
    W, b = args
    return jnp.tanh(W @ x + b)


def tap_map(m, args):
    """Binary TAP: m = tanh(β(h + J m) − β² m Σ_j J_ij² (1 − m_j²))."""
    h, J, beta = args
    onsager = beta**2 * m * ((J**2) @ (1.0 - m**2))
    return jnp.tanh(beta * (h + J @ m) - onsager)


def numpy_iterate(f, x0, steps=5000, damping=0.0):
    """Plain (damped) iteration in float64 numpy: the reference for nonlinear maps."""
    x = np.asarray(x0, np.float64)
    for _ in range(steps):
        x = (1 - damping) * f(x) + damping * x
    return x


def numpy_tap(h, J, beta):
    def f(m):
        return np.tanh(beta * (h + J @ m) - beta**2 * m * ((J**2) @ (1 - m**2)))

    return f


def sk_couplings(rng, n, beta, j_mean=1.0, j_std=0.1):
    """Symmetric couplings J_ij ~ N(β J_μ / n, β² J_σ² / n), zero diagonal (the seeds' setup)."""
    J = rng.normal(beta * j_mean / n, beta * j_std / np.sqrt(n), size=(n, n))
    J = np.triu(J, 1)
    return J + J.T


def tuned(solver=None, **rule):
    """`solver` (default `Anderson()`) with its stopping rule (`tol`, `max_steps`, `norm`)
    replaced: the tolerances live on the solver objects."""
    import dataclasses

    from spinformer import solvers

    return dataclasses.replace(solvers.Anderson() if solver is None else solver, **rule)


# ----------------------------------------------------------------------------- jaxopt


class _JaxoptState(eqx.Module):
    params: Any  # (n,)
    inner: Any
    rnorm: Any  # ()


class JaxoptAnderson(S.AbstractFixedPointSolver):
    """`jaxopt.AndersonAcceleration` (the reference implementation) behind this interface.

    Each step is one `AndersonAcceleration.update`, so iterates match jaxopt's own `run`
    exactly; the loop, termination, statistics and gradients (`adjoint=`) are spinformer's.
    jaxopt starts extrapolating only once its history is full and regularises with an
    absolute ridge. As in jaxopt, the iterate is g(x_k) while the residual is measured at
    x_k. The reference the tests compare `Anderson` against (jaxopt, unmaintained upstream,
    is a `dev` extra, not a dependency of the library).

    **Arguments:** `history` (≥ 2), `damping` (jaxopt's `beta` = 1 − damping), `ridge`
    (absolute), and `tol`, `max_steps`, `norm` as every solver.
    """

    history: int = eqx.field(default=5, static=True)
    damping: float = 0.0
    ridge: float = 1e-5
    tol: float = 1e-5
    max_steps: int = eqx.field(default=100, static=True)
    norm: Callable = eqx.field(default=S.max_norm, static=True)

    def __check_init__(self):
        if self.history < 2:
            raise ValueError("JaxoptAnderson(history=...) must be >= 2 (a jaxopt requirement).")
        _check_damping("JaxoptAnderson", self.damping)

    def _solver(self, prob):
        import jaxopt

        if not isinstance(prob, _FixedPointProblem):
            raise ValueError("JaxoptAnderson only solves fixed points.")
        return jaxopt.AndersonAcceleration(
            fixed_point_fun=prob.fn,
            history_size=self.history,
            beta=1.0 - self.damping,
            ridge=self.ridge,
            implicit_diff=False,
            jit=False,
        )

    def init(self, prob, x, args):
        inner = self._solver(prob).init_state(x, args)
        return _JaxoptState(x, inner, jnp.asarray(jnp.inf, x.dtype))

    def step(self, prob, s, args):
        params, inner = self._solver(prob).update(s.params, s.inner, args)
        pos = (inner.iter_num - 1) % self.history
        rnorm = self._rnorm(inner.residuals_history[pos])
        return _JaxoptState(params, inner, rnorm.astype(s.rnorm.dtype))

    def terminate(self, state):
        failed = jnp.isnan(state.rnorm) | (state.rnorm == jnp.inf) & (state.inner.iter_num > 0)
        return self._stop(state.rnorm, failed)

    def output(self, state):
        return state.params, state.rnorm
