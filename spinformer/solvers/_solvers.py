"""Iterative solvers: `Picard`, `Anderson`, `Broyden`, `Newton` and the `JaxoptAnderson` reference.

Every solver works on one flat vector `x` (the driver ravels pytrees) and is a small Equinox
module with `init`, `step` and `output`, following the init/step/terminate split of
optimistix. The driver (`fixed_point` / `root_find`) owns the loop, the termination test, the
best-iterate bookkeeping and the gradients; a solver only proposes the next iterate.

A problem (`_Problem`) gives `prob.fn(x, args)`: the map `g` for fixed points (x = g(x)), or
the residual `F` for roots (F(x) = 0); `prob.residual(x, args)` is always the residual.
"""

from __future__ import annotations

import abc
from typing import Any, Callable, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int


def max_norm(v: Array) -> Array:
    """∞-norm of a vector (0 for an empty vector)."""
    return jnp.max(jnp.abs(v), initial=0.0)


def l2_norm(v: Array) -> Array:
    """Euclidean norm of a vector."""
    return jnp.sqrt(jnp.sum(v * v))


_NORMS = {"inf": max_norm, "l2": l2_norm}


class _Problem(eqx.Module):
    fn: Callable
    kind: str = eqx.field(static=True)  # "fixed_point" or "root"
    norm: Callable = eqx.field(static=True)

    def residual(self, x, args):
        out = self.fn(x, args)
        return out - x if self.kind == "fixed_point" else out

    def norm_of(self, r):
        return jax.lax.stop_gradient(self.norm(r))


class AbstractSolver(eqx.Module):
    """Base class of the solvers. Concrete solvers implement `init`, `step` and `output`."""

    supports_root: ClassVar[bool] = False

    @abc.abstractmethod
    def init(self, prob: _Problem, x: Array, args: Any) -> Any:
        """Evaluate the problem at `x` and build the solver state."""

    @abc.abstractmethod
    def step(self, prob: _Problem, state: Any, args: Any) -> Any:
        """One iteration: propose a new iterate and evaluate the problem there."""

    @abc.abstractmethod
    def output(self, state: Any) -> tuple[Array, Array, Array]:
        """`(x, residual_norm_at_x, nonfinite_flag)` for the current state."""


# ----------------------------------------------------------------------------- Picard


class _PicardState(eqx.Module):
    x: Float[Array, " n"]
    r: Float[Array, " n"]
    rnorm: Float[Array, ""]


class Picard(AbstractSolver):
    """Plain (optionally damped) fixed-point iteration x ← (1 − damping)·g(x) + damping·x.

    **Arguments:**

    - `damping`: in [0, 1). 0 is the plain iteration; larger values slow each step down but
      make oscillating maps (e.g. mean-field equations at strong coupling) converge.
    """

    damping: float = 0.0

    def __check_init__(self):
        if not (0.0 <= self.damping < 1.0):
            raise ValueError(f"Picard(damping={self.damping}) must satisfy 0 <= damping < 1.")

    def init(self, prob, x, args):
        r = prob.residual(x, args)
        return _PicardState(x, r, prob.norm_of(r))

    def step(self, prob, state, args):
        x = state.x + (1.0 - self.damping) * state.r
        r = prob.residual(x, args)
        return _PicardState(x, r, prob.norm_of(r))

    def output(self, state):
        return state.x, state.rnorm, ~jnp.isfinite(state.rnorm)


# ----------------------------------------------------------------------------- Anderson


class _AndersonState(eqx.Module):
    x: Float[Array, " n"]  # current iterate
    r: Float[Array, " n"]  # g(x) - x
    rnorm: Float[Array, ""]
    X: Float[Array, "m n"]  # history of iterates
    R: Float[Array, "m n"]  # history of residuals
    gram: Float[Array, "m m"]  # R @ R.T, kept up to date one row at a time
    mask: Bool[Array, " m"]  # which history slots are filled
    pos: Int[Array, ""]  # next slot to overwrite
    best_x: Float[Array, " n"]
    best_r: Float[Array, " n"]
    best_rnorm: Float[Array, ""]
    restarted: Bool[Array, ""]  # the previous step restarted from the best iterate
    nonfinite: Bool[Array, ""]


class Anderson(AbstractSolver):
    """Anderson acceleration (type II, Walker & Ni 2011) with a relative ridge and a safeguard.

    Each step solves the regularised least-squares problem
    min_α ‖Σ_i α_i r_i‖² + ridge·s‖α‖², Σ_i α_i = 1, over the last `history` residuals
    r_i = g(x_i) − x_i (s is the largest ‖r_i‖², so the ridge is relative to the residuals' own
    size and does not stall once they are small), then moves to
    x ← Σ_i α_i (x_i + mixing · r_i). Acceleration starts at the first step with whatever
    history exists (the first step is a Picard step).

    With `safeguard=True`: if the mixing coefficients are non-finite or huge (ill-conditioned
    history: Σ|α_i| > `max_coefficient`) the step falls back to a Picard step; if the new
    residual is non-finite or larger than `safeguard_growth` times the best residual so far,
    the history is cleared and the iteration restarts from the best iterate.

    **Arguments:**

    - `history`: number of past iterates used (m ≥ 1; m = 1 is damped Picard).
    - `mixing`: β in (0, 1]; 1 uses the extrapolated maps g(x_i) fully.
    - `ridge`: relative Tikhonov regularisation of the least-squares problem.
    - `safeguard`: enable the fallback and restart described above.
    """

    history: int = 5
    mixing: float = 1.0
    ridge: float = 1e-4
    safeguard: bool = True
    safeguard_growth: float = 10.0
    max_coefficient: float = 1e4

    def __check_init__(self):
        if not (isinstance(self.history, int) and self.history >= 1):
            raise ValueError(f"Anderson(history={self.history!r}) must be an int >= 1.")
        if not (0.0 < self.mixing <= 1.0):
            raise ValueError(f"Anderson(mixing={self.mixing}) must be in (0, 1].")
        if not self.ridge >= 0.0:
            raise ValueError(f"Anderson(ridge={self.ridge}) must be >= 0.")
        if not self.safeguard_growth > 1.0:
            raise ValueError(f"Anderson(safeguard_growth={self.safeguard_growth}) must be > 1.")

    def _fresh(self, x, r, rnorm, nonfinite, restarted):
        m, n = self.history, x.shape[0]
        X = jnp.zeros((m, n), x.dtype).at[0].set(x)
        R = jnp.zeros((m, n), x.dtype).at[0].set(r)
        gram = jnp.zeros((m, m), x.dtype).at[0, 0].set(jnp.vdot(r, r))
        mask = jnp.zeros((m,), bool).at[0].set(True)
        pos = jnp.asarray(1 % m, jnp.int32)
        return _AndersonState(
            x, r, rnorm, X, R, gram, mask, pos, x, r, rnorm, restarted, nonfinite
        )

    def init(self, prob, x, args):
        r = prob.residual(x, args)
        rnorm = prob.norm_of(r)
        return self._fresh(x, r, rnorm, ~jnp.isfinite(rnorm), jnp.asarray(False))

    def _coefficients(self, s):
        dtype = s.x.dtype
        maskf = s.mask.astype(dtype)
        diag = jnp.diagonal(s.gram)
        scale = jnp.max(jnp.where(s.mask, diag, 0.0))
        scale = jax.lax.stop_gradient(jnp.where(scale > 0, scale, 1.0))
        eye = jnp.eye(self.history, dtype=dtype)
        G = s.gram / scale * jnp.outer(maskf, maskf)
        G = G + eye * (1.0 - maskf)[None, :] + self.ridge * eye * maskf[None, :]
        w = jnp.linalg.solve(G, maskf)
        return w / jnp.sum(w)

    def step(self, prob, s, args):
        alpha = self._coefficients(s)
        x_acc = alpha @ (s.X + self.mixing * s.R)
        x_pic = s.x + self.mixing * s.r
        if self.safeguard:
            ok = jnp.all(jnp.isfinite(alpha)) & (
                jnp.sum(jnp.abs(alpha)) <= self.max_coefficient
            )
            x_new = jnp.where(ok, x_acc, x_pic)
        else:
            x_new = x_acc
        r_new = prob.residual(x_new, args)
        rn = prob.norm_of(r_new)
        finite = jnp.isfinite(rn)

        improved = finite & (rn < s.best_rnorm)
        best_x = jnp.where(improved, x_new, s.best_x)
        best_r = jnp.where(improved, r_new, s.best_r)
        best_rnorm = jnp.where(improved, rn, s.best_rnorm)

        # Normal update: put (x_new, r_new) in the history.
        p = s.pos
        X = s.X.at[p].set(x_new)
        R = s.R.at[p].set(r_new)
        row = R @ r_new
        gram = s.gram.at[p, :].set(row).at[:, p].set(row)
        mask = s.mask.at[p].set(True)
        normal = _AndersonState(
            x_new, r_new, rn, X, R, gram, mask, (p + 1) % self.history,
            best_x, best_r, best_rnorm, jnp.asarray(False), ~finite,
        )
        if not self.safeguard:
            return normal
        bad = (~finite | (rn > self.safeguard_growth * s.best_rnorm)) & ~s.restarted
        restart = self._fresh(
            best_x, best_r, best_rnorm, ~finite & s.restarted, jnp.asarray(True)
        )
        # A failure right after a restart is not retried: it is reported.
        normal = eqx.tree_at(lambda t: t.nonfinite, normal, ~finite & s.restarted)
        return jax.tree.map(lambda a, b: jnp.where(bad, a, b), restart, normal)

    def output(self, state):
        return state.best_x, state.best_rnorm, state.nonfinite


# ----------------------------------------------------------------------------- Broyden


class _BroydenState(eqx.Module):
    x: Float[Array, " n"]
    F: Float[Array, " n"]
    rnorm: Float[Array, ""]
    H: Float[Array, "n n"]  # approximate inverse Jacobian of the residual


class Broyden(AbstractSolver):
    """Broyden's ("good") quasi-Newton method with a dense inverse-Jacobian estimate.

    For fixed points the residual is F(x) = g(x) − x and the estimate starts at −I, so the
    first step is a Picard step; for roots it starts at the exact inverse Jacobian at `x0`.
    Memory is O(n²): meant for states up to a few thousand entries.
    """

    supports_root: ClassVar[bool] = True

    def init(self, prob, x, args):
        F = prob.residual(x, args)
        n = x.shape[0]
        if prob.kind == "fixed_point":
            H = -jnp.eye(n, dtype=x.dtype)
        else:
            J = jax.jacfwd(lambda y: prob.residual(y, args))(x)
            H = jnp.linalg.inv(J)
        return _BroydenState(x, F, prob.norm_of(F), H)

    def step(self, prob, s, args):
        dx = -s.H @ s.F
        x = s.x + dx
        F = prob.residual(x, args)
        dF = F - s.F
        HdF = s.H @ dF
        denom = jnp.vdot(dx, HdF)
        safe = jnp.abs(denom) > 1e-30
        upd = jnp.outer((dx - HdF) / jnp.where(safe, denom, 1.0), dx @ s.H)
        H = jnp.where(safe, s.H + upd, s.H)
        return _BroydenState(x, F, prob.norm_of(F), H)

    def output(self, state):
        return state.x, state.rnorm, ~jnp.isfinite(state.rnorm)


# ----------------------------------------------------------------------------- Newton


class _NewtonState(eqx.Module):
    x: Float[Array, " n"]
    F: Float[Array, " n"]
    rnorm: Float[Array, ""]


class Newton(AbstractSolver):
    """Newton's method with the exact (dense, forward-mode) Jacobian of the residual.

    **Arguments:**

    - `damping`: step length in (0, 1]; 1 is the full Newton step.

    Each step costs one Jacobian (n forward-mode evaluations, vectorised) and one dense solve:
    meant for small and medium states. A singular Jacobian ends the solve as `nonfinite`.
    """

    damping: float = 1.0
    supports_root: ClassVar[bool] = True

    def __check_init__(self):
        if not (0.0 < self.damping <= 1.0):
            raise ValueError(f"Newton(damping={self.damping}) must be in (0, 1].")

    def init(self, prob, x, args):
        F = prob.residual(x, args)
        return _NewtonState(x, F, prob.norm_of(F))

    def step(self, prob, s, args):
        J = jax.jacfwd(lambda y: prob.residual(y, args))(s.x)
        dx = jnp.linalg.solve(J, -s.F)
        x = s.x + self.damping * dx
        F = prob.residual(x, args)
        return _NewtonState(x, F, prob.norm_of(F))

    def output(self, state):
        return state.x, state.rnorm, ~jnp.isfinite(state.rnorm)


# ----------------------------------------------------------------------------- jaxopt


class _JaxoptState(eqx.Module):
    params: Float[Array, " n"]
    inner: Any
    rnorm: Float[Array, ""]


class JaxoptAnderson(AbstractSolver):
    """`jaxopt.AndersonAcceleration` (the seeds' solver) behind spinformer's interface.

    Each step is one `AndersonAcceleration.update`, so iterates match jaxopt's own `run`
    exactly; the loop, termination, statistics and gradients (`adjoint=`) are spinformer's.
    jaxopt starts extrapolating only once its history is full and regularises with an
    absolute ridge. As in jaxopt, `value` is g(x_k) and `residual` is measured at x_k.
    Kept as the reference the tests and benchmarks compare `Anderson` against.
    """

    history: int = 5
    mixing: float = 1.0
    ridge: float = 1e-5

    def __check_init__(self):
        if self.history < 2:
            raise ValueError("JaxoptAnderson(history=...) must be >= 2 (a jaxopt requirement).")

    def _solver(self, prob):
        import jaxopt

        if prob.kind != "fixed_point":
            raise ValueError("JaxoptAnderson only solves fixed points.")
        return jaxopt.AndersonAcceleration(
            fixed_point_fun=prob.fn,
            history_size=self.history,
            beta=self.mixing,
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
        rnorm = prob.norm_of(inner.residuals_history[pos])
        return _JaxoptState(params, inner, rnorm.astype(s.rnorm.dtype))

    def output(self, state):
        return state.params, state.rnorm, jnp.isnan(state.rnorm) | (
            state.rnorm == jnp.inf
        ) & (state.inner.iter_num > 0)
