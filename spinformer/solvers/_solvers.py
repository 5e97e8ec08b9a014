"""Iterative solvers: `Picard`, `Anderson` (fixed points) and `Broyden`,
`Newton` (roots, and fixed points written as roots).

Every solver works on one flat vector `x` (the driver ravels pytrees) and is a small Equinox
module with `init`, `step`, `terminate` and `output`, after optimistix's solvers. A solver
carries its own stopping rule: the tolerance `tol` on the residual measured in `norm`, and
the iteration budget `max_steps`. The driver (`fixed_point` / `root_find`) runs the loop,
keeps the best iterate (`_BestSoFar`, the same for every solver) and attaches gradients.

Two abstract types say what a solver can do: an `AbstractFixedPointSolver` iterates a map
x = g(x); an `AbstractRootFinder` drives a residual F(x) to 0, and also solves fixed points
through F(x) = g(x) − x.

`damping` has one meaning everywhere: the fraction of the old iterate kept in a step, in
[0, 1); 0 is the undamped method.
"""

from __future__ import annotations

import abc
import contextlib
from typing import Any, Callable, ClassVar, Optional

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.scipy.linalg  # noqa: F401  (lu_factor, lu_solve)
from jaxtyping import Array, Bool, Float, Int

from ._results import RESULTS


def max_norm(v: Array) -> Array:
    """∞-norm of a vector (0 for an empty vector)."""
    return jnp.max(jnp.abs(v), initial=0.0)


def batched_like(tree: Any, ref: Array) -> Any:
    """`tree` with the same values, batched under `vmap` wherever `ref` is: a loop's initial
    carry, made to vary over the examples from the start.

    `jax.lax.while_loop`'s batching rule finds out which carries vary over the examples by
    batching the loop body again and again until no carry changes from unbatched to batched:
    one more pass through the body per carry that starts unbatched (a history of zeros, a
    mask, a counter) and is written with batched values. Nested `vmap`s (examples × heads)
    and loops inside loops (a backward solve's fallback) repeat those passes at every level.
    A solve's stopping test depends on its example, so every carry ends up batched anyway:
    tying them all to `ref` (a value of the solve, e.g. its first residual) at the start
    changes nothing in the compiled loop and makes the first pass the last, which shortens
    the tracing of a vmapped solve's gradient.
    The values are unchanged: each numeric leaf gets an exact zero added (a `select`, so a
    NaN or inf in `ref` does not leak in), each boolean leaf is or-ed with False; no
    gradient flows through the tie, and without `vmap` XLA folds it away."""
    r = jax.lax.stop_gradient(jnp.ravel(ref)[:1].sum())
    zero = jnp.where(True, jnp.zeros((), r.dtype), r)

    def tie(a):
        a = jnp.asarray(a)
        if a.dtype == jnp.bool_:
            return a | (zero != 0)
        if jnp.issubdtype(a.dtype, jnp.number):
            return a + zero.astype(a.dtype)
        return a  # e.g. PRNG keys: left as they are

    return jax.tree.map(tie, tree)


def l2_norm(v: Array) -> Array:
    """Euclidean norm of a vector."""
    return jnp.sqrt(jnp.sum(v * v))


#: the values `precision` takes (those of `jax.default_matmul_precision`)
PRECISIONS = ("highest", "float32", "high", "tensorfloat32", "bfloat16", "default")


def matmul_precision(precision: Optional[str]):
    """The context that traces matrix products at `precision` (None: no change)."""
    return contextlib.nullcontext() if precision is None else jax.default_matmul_precision(
        precision)


# ----------------------------------------------------------------------------- problems


class _AbstractProblem(eqx.Module):
    fn: eqx.AbstractVar[Callable]
    precision: eqx.AbstractVar[Optional[str]]

    @abc.abstractmethod
    def residual(self, x, args):
        """The vector that vanishes at a solution."""


class _FixedPointProblem(_AbstractProblem):
    """x = fn(x, args); the residual is fn(x) − x."""

    fn: Callable
    precision: Optional[str] = eqx.field(default=None, static=True)

    def residual(self, x, args):
        return self.fn(x, args) - x


class _RootProblem(_AbstractProblem):
    """fn(x, args) = 0; the residual is fn(x)."""

    fn: Callable
    precision: Optional[str] = eqx.field(default=None, static=True)

    def residual(self, x, args):
        return self.fn(x, args)


# ----------------------------------------------------------------------------- base types


def _check_damping(name, damping):
    if not (0.0 <= damping < 1.0):
        raise ValueError(
            f"{name}(damping={damping}) must be in [0, 1): the fraction of the old iterate "
            "kept in each step (0 is the undamped method)."
        )


class AbstractSolver(eqx.Module):
    """Base of every solver: `init`, `step`, `terminate`, `output` on one flat vector.

    Every solver has `tol` (converged when the residual norm is ≤ tol), `max_steps` (most
    iterations after the first evaluation) and `norm` (a callable `vector -> scalar`, e.g.
    `max_norm` or `l2_norm`).

    The fixed-point solvers `Picard` and `Anderson` also take `unroll`: with `unroll=True`
    the driver runs exactly `max_steps` iterations as straight-line code instead of a while
    loop; an example that has converged stops changing (its later steps are computed and
    discarded), and the stopping rule is checked once, at the end, so a solve that needed
    more steps reports `max_steps_reached` as usual. On a GPU every iteration of a while
    loop waits for the host to read its condition, and a small solve (one decoded position)
    costs more in those waits and launches than in arithmetic; unrolled, the whole solve is
    a fixed sequence of kernels. Use it with a small `max_steps` that the problem is known
    to converge in (the compiled program grows with it).

    Every solver also takes the keyword `precision` (default `"highest"`): the
    `jax.default_matmul_precision` under which the map, the solver's own products and the
    implicit adjoint's backward solve are traced. `"highest"` makes float32 matrix products
    float32 on every platform. On NVIDIA GPUs JAX's default is TensorFloat-32 (a 10-bit
    mantissa) for float32 products, whose rounding, about 1e-3 relative, is a floor
    under the residual: a tolerance below it is reached late or not at all, so a solve
    takes many more iterations than in float32 (docs/results/peers.md). On a CPU float32
    products are float32 anyway and the setting changes nothing. `None` keeps the caller's setting (for example TF32, for large
    products where speed matters more than a tight tolerance; then set `tol` above
    about 1e-3).

    **Arguments** (every solver):

    - `tol`: converged when the residual norm is ≤ tol.
    - `max_steps`: most iterations after the first evaluation.
    - `norm`: the residual norm, a callable `vector -> scalar` (`max_norm`, `l2_norm`).
    - `unroll`: `Picard`, `Anderson`: exactly `max_steps` iterations as straight-line code,
      no while loop (small solves on a GPU); the stopping rule is checked once, at the end.
    - `precision`: the matrix-product precision of the solve (`jax.default_matmul_precision`;
      `"highest"`: float32 products in float32, also on GPUs; None: the caller's setting).
    """

    #: run exactly `max_steps` iterations without a while loop (`Picard`, `Anderson`)
    unroll: ClassVar[bool] = False

    tol: eqx.AbstractVar[float]
    max_steps: eqx.AbstractVar[int]
    norm: eqx.AbstractVar[Callable[[Array], Array]]
    #: matrix-product precision of the solve (keyword only; see the class docstring)
    precision: Optional[str] = eqx.field(default="highest", static=True, kw_only=True)

    def __check_init__(self):
        name = type(self).__name__
        if self.precision is not None and self.precision not in PRECISIONS:
            raise ValueError(
                f"{name}(precision={self.precision!r}) must be None (the caller's setting) or "
                f"one of {', '.join(map(repr, PRECISIONS))} (jax.default_matmul_precision)."
            )
        tol = self.tol
        if isinstance(tol, (int, float)) and (isinstance(tol, bool) or not tol >= 0):
            raise ValueError(f"{name}(tol={tol!r}) must be a non-negative number.")
        if isinstance(self.max_steps, bool) or not isinstance(self.max_steps, int) or (
            self.max_steps < 1
        ):
            raise ValueError(f"{name}(max_steps={self.max_steps!r}) must be an int >= 1.")
        if not callable(self.norm):
            raise ValueError(
                f"{name}(norm={self.norm!r}) must be a callable vector -> scalar, e.g. "
                "spinformer.solvers.max_norm or spinformer.solvers.l2_norm."
            )

    @abc.abstractmethod
    def init(self, prob: _AbstractProblem, x: Array, args: Any) -> Any:
        """Evaluate the problem at `x` and build the solver state."""

    @abc.abstractmethod
    def step(self, prob: _AbstractProblem, state: Any, args: Any) -> Any:
        """One iteration: propose a new iterate and evaluate the problem there."""

    @abc.abstractmethod
    def terminate(self, state: Any) -> tuple[Bool[Array, ""], Int[Array, ""]]:
        """`(done, result)`: whether to stop now, and the RESULTS code if so. The one test
        of convergence: the driver stops where it says done and reports its `result`
        (`max_steps_reached` where the step budget ran out first)."""

    @abc.abstractmethod
    def output(self, state: Any) -> tuple[Array, Array]:
        """`(x, residual_norm_at_x)` for the current iterate."""

    def inverse_jacobian_t(self, state: Any) -> Optional[Callable[[Array], Array]]:
        """`v ↦ Hᵀ v`, H the solver's own estimate of the inverse Jacobian (∂F/∂x)⁻¹ of the
        residual F at its last iterate (F(x) = g(x) − x for a fixed point), as a pytree
        (`jax.tree_util.Partial`) holding only the arrays it needs; None where the solver
        keeps no estimate. `Anderson` and `Broyden` keep one (secant methods); the adjoints
        `Shine` and `Implicit(precondition=True)` use it in the backward pass."""
        del state
        return None

    def _rnorm(self, r):
        return jax.lax.stop_gradient(self.norm(r))

    def _stop(self, rnorm, failed):
        """The usual stopping rule: converged, or failed (result nonfinite)."""
        ok = rnorm <= self.tol
        result = jnp.where(ok, RESULTS.successful, RESULTS.nonfinite).astype(jnp.int32)
        return ok | failed, result


class AbstractFixedPointSolver(AbstractSolver):
    """A solver of x = g(x) that iterates the map g (`fixed_point` only)."""


class AbstractRootFinder(AbstractSolver):
    """A solver of F(x) = 0 (`root_find`); `fixed_point` uses it on F(x) = g(x) − x."""


# ----------------------------------------------------------------------------- Picard


class _PlainState(eqx.Module):
    x: Float[Array, " n"]
    r: Float[Array, " n"]  # the residual at x
    rnorm: Float[Array, ""]


class Picard(AbstractFixedPointSolver):
    """Plain (optionally damped) fixed-point iteration x ← damping·x + (1 − damping)·g(x).

    **Arguments:**

    - `damping`: in [0, 1). 0 is the plain iteration; larger values slow each step down but
      make oscillating maps (e.g. mean-field equations at strong coupling) converge.

    `tol`, `max_steps`, `norm`, `unroll`, `precision`: as for every solver (`AbstractSolver`).
    """

    damping: float = 0.0
    tol: float = 1e-5
    max_steps: int = eqx.field(default=100, static=True)
    norm: Callable = eqx.field(default=max_norm, static=True)
    unroll: bool = eqx.field(default=False, static=True)

    def __check_init__(self):
        _check_damping("Picard", self.damping)

    def init(self, prob, x, args):
        r = prob.residual(x, args)
        return _PlainState(x, r, self._rnorm(r))

    def step(self, prob, state, args):
        x = state.x + (1.0 - self.damping) * state.r
        r = prob.residual(x, args)
        return _PlainState(x, r, self._rnorm(r))

    def terminate(self, state):
        return self._stop(state.rnorm, ~jnp.isfinite(state.rnorm))

    def output(self, state):
        return state.x, state.rnorm


# ----------------------------------------------------------------------------- Anderson


def _spd_solve(G: Float[Array, "m m"], b: Float[Array, " m"]) -> Float[Array, " m"]:
    """G⁻¹ b for a small symmetric positive definite G, by a Cholesky factorisation written
    out entry by entry (m is static: Anderson's history).

    The m³/6 scalar operations fuse into one kernel, also batched under `vmap`; a LAPACK or
    cuSOLVER call per iteration (`jnp.linalg.solve`) costs more than the map itself on small
    problems such as the DEQ and TAP solves of `experiments/bench/peers.py`. A singular
    G gives non-finite entries, which Anderson's safeguard turns into a Picard step, as it
    did with the LU solve.
    """
    m = G.shape[-1]
    L = [[None] * m for _ in range(m)]
    for j in range(m):
        d = jnp.sqrt(G[j, j] - sum((L[j][k] ** 2 for k in range(j)), jnp.zeros((), G.dtype)))
        L[j][j] = d
        for i in range(j + 1, m):
            L[i][j] = (G[i, j] - sum((L[i][k] * L[j][k] for k in range(j)),
                                     jnp.zeros((), G.dtype))) / d
    y = []
    for i in range(m):
        y.append((b[i] - sum((L[i][k] * y[k] for k in range(i)), jnp.zeros((), G.dtype)))
                 / L[i][i])
    x = [None] * m
    for i in reversed(range(m)):
        x[i] = (y[i] - sum((L[k][i] * x[k] for k in range(i + 1, m)), jnp.zeros((), G.dtype))
                ) / L[i][i]
    return jnp.stack(x)


class _AndersonState(eqx.Module):
    x: Float[Array, " n"]  # current iterate
    r: Float[Array, " n"]  # g(x) - x
    rnorm: Float[Array, ""]
    X: Float[Array, "m n"]  # history of iterates
    R: Float[Array, "m n"]  # history of residuals
    gram: Float[Array, "m m"]  # R @ R.T, kept up to date one row at a time
    mask: Bool[Array, " m"]  # which history slots are filled
    pos: Int[Array, ""]  # next slot to overwrite
    anchor_x: Float[Array, " n"]  # the safeguard's restart point: the best iterate so far
    anchor_r: Float[Array, " n"]
    anchor_rnorm: Float[Array, ""]
    restarted: Bool[Array, ""]  # the previous step restarted from the anchor
    nonfinite: Bool[Array, ""]


class Anderson(AbstractFixedPointSolver):
    """Anderson acceleration (type II, Walker & Ni 2011) with a relative ridge and a safeguard.

    Each step solves the regularised least-squares problem
    min_α ‖Σ_i α_i r_i‖² + ridge·s‖α‖², Σ_i α_i = 1, over the last `history` residuals
    r_i = g(x_i) − x_i (s is the newest residual's ‖r‖², so the ridge is relative to the
    residuals' own size and does not stall once they are small), then moves to
    x ← Σ_i α_i (x_i + (1 − damping) · r_i). Acceleration starts at the first step with
    whatever history exists (the first step is a Picard step).

    With `safeguard=True`: if the mixing coefficients are non-finite or huge (ill-conditioned
    history: Σ|α_i| > `max_coefficient`) the step falls back to a Picard step; if the new
    residual is non-finite or larger than `safeguard_growth` times the best residual so far,
    the history is cleared and the iteration restarts from the best iterate (a failure right
    after a restart ends the solve as `nonfinite`).

    **Arguments:**

    - `history`: number of past iterates used (m ≥ 1; m = 1 is damped Picard).
    - `damping`: in [0, 1), as `Picard`'s (jaxopt's `beta` is 1 − damping).
    - `ridge`: relative Tikhonov regularisation of the least-squares problem.
    - `safeguard`: enable the fallback and restart described above.
    - `safeguard_growth`: restart when the residual exceeds this multiple of the best so far.
    - `max_coefficient`: fall back to a Picard step when Σ|α_i| exceeds this.

    `tol`, `max_steps`, `norm`, `unroll`, `precision`: as for every solver (`AbstractSolver`).
    """

    history: int = eqx.field(default=5, static=True)
    damping: float = 0.0
    ridge: float = 1e-4
    safeguard: bool = eqx.field(default=True, static=True)
    safeguard_growth: float = 10.0
    max_coefficient: float = 1e4
    tol: float = 1e-5
    max_steps: int = eqx.field(default=100, static=True)
    norm: Callable = eqx.field(default=max_norm, static=True)
    unroll: bool = eqx.field(default=False, static=True)

    def __check_init__(self):
        if not (isinstance(self.history, int) and self.history >= 1):
            raise ValueError(f"Anderson(history={self.history!r}) must be an int >= 1.")
        _check_damping("Anderson", self.damping)
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
        rnorm = self._rnorm(r)
        return self._fresh(x, r, rnorm, ~jnp.isfinite(rnorm), jnp.asarray(False))

    def _coefficients(self, s):
        dtype = s.x.dtype
        maskf = s.mask.astype(dtype)
        # the ridge is relative to the newest residual's ‖r‖², the row the step moves from
        scale = s.gram[(s.pos - 1) % self.history, (s.pos - 1) % self.history]
        scale = jax.lax.stop_gradient(jnp.where(scale > 0, scale, 1.0))
        eye = jnp.eye(self.history, dtype=dtype)
        G = s.gram / scale * jnp.outer(maskf, maskf)
        G = G + eye * (1.0 - maskf)[None, :] + self.ridge * eye * maskf[None, :]
        w = _spd_solve(G, maskf)
        return w / jnp.sum(w)

    def step(self, prob, s, args):
        alpha = self._coefficients(s)
        keep = 1.0 - self.damping
        x_acc = alpha @ (s.X + keep * s.R)
        x_pic = s.x + keep * s.r
        if self.safeguard:
            ok = jnp.all(jnp.isfinite(alpha)) & (
                jnp.sum(jnp.abs(alpha)) <= self.max_coefficient
            )
            x_new = jnp.where(ok, x_acc, x_pic)
        else:
            x_new = x_acc
        r_new = prob.residual(x_new, args)
        rn = self._rnorm(r_new)
        finite = jnp.isfinite(rn)

        improved = finite & (rn < s.anchor_rnorm)
        anchor_x = jnp.where(improved, x_new, s.anchor_x)
        anchor_r = jnp.where(improved, r_new, s.anchor_r)
        anchor_rnorm = jnp.where(improved, rn, s.anchor_rnorm)
        # A failure right after a restart is not retried: it is reported.
        nonfinite = ~finite & s.restarted
        if self.safeguard:
            bad = (~finite | (rn > self.safeguard_growth * s.anchor_rnorm)) & ~s.restarted
        else:
            bad = jnp.zeros((), bool)
            nonfinite = ~finite

        # Normal update: (x_new, r_new) goes into history slot p. A restart clears the
        # history to the best iterate alone: that iterate goes into slot p and the mask keeps
        # only p, so the (m, n) history is written one row at a time either way (selecting
        # between a fresh and an updated history copied the whole history twice per step).
        p = s.pos
        x = jnp.where(bad, anchor_x, x_new)
        r = jnp.where(bad, anchor_r, r_new)
        X = s.X.at[p].set(x)
        R = s.R.at[p].set(r)
        row = R @ r
        gram = s.gram.at[p, :].set(row).at[:, p].set(row)
        onehot = jnp.arange(self.history) == p
        mask = jnp.where(bad, onehot, s.mask | onehot)
        gram = jnp.where(bad, gram * jnp.outer(onehot, onehot), gram)
        return _AndersonState(
            x, r, jnp.where(bad, anchor_rnorm, rn), X, R, gram, mask, (p + 1) % self.history,
            anchor_x, anchor_r, anchor_rnorm, bad, nonfinite,
        )

    def terminate(self, state):
        return self._stop(state.rnorm, state.nonfinite)

    def output(self, state):
        return state.x, state.rnorm

    def inverse_jacobian_t(self, state):
        """The multisecant estimate behind Anderson's step (Fang & Saad 2009; used by SHINE,
        Ramzi et al. 2022): with the differences ΔX, ΔR (k × n) of the stored iterates and
        residuals from the newest, H = −I + (ΔX + ΔR)ᵀ (ΔR ΔRᵀ + λ)⁻¹ ΔR, the matrix nearest
        −I that maps every ΔRᵢ to ΔXᵢ (the secant conditions; λ: `ridge`, with every pair
        scaled to ‖ΔRᵢ‖ = 1). Anderson's own step is x − H r with −I replaced by −(1 − damping)·I;
        the estimate keeps −I, the inverse Jacobian of a map with ∂g/∂x = 0, since a damped
        step length is no statement about the Jacobian. With an empty history, Hᵀ = −I.
        Returns `v ↦ Hᵀ v` = −v + ΔRᵀ C v with C = (ΔR ΔRᵀ + λ)⁻¹ (ΔX + ΔR), formed here."""
        m = self.history
        newest = (state.pos - 1) % m
        valid = state.mask & (jnp.arange(m) != newest)
        dX = state.X - state.X[newest]
        dR = state.R - state.R[newest]
        # each pair scaled to ‖ΔRᵢ‖ = 1 (H does not change; the ridge becomes relative to
        # each direction, where residuals that shrank by orders of magnitude would leave the
        # newest directions under a ridge relative to the largest)
        size = jnp.sqrt(jnp.sum(dR * dR, axis=1))
        valid = valid & (size > 0)
        inv = jnp.where(valid, 1.0 / jnp.where(valid, size, 1.0), 0.0)[:, None]
        dX, dR = dX * inv, dR * inv
        validf = valid.astype(dR.dtype)
        eye = jnp.eye(m, dtype=dR.dtype)
        G = dR @ dR.T + eye * (1.0 - validf) + self.ridge * eye * validf
        C = jax.vmap(lambda c: _spd_solve(G, c), in_axes=1, out_axes=1)(dX + dR)
        C = jnp.where(jnp.all(jnp.isfinite(C)), C, 0.0)  # a singular history: Hᵀ = −I
        return jax.tree_util.Partial(_low_rank_t, dR, C)


def _low_rank_t(dR, C, v):
    """−v + ΔRᵀ (C v): `Anderson.inverse_jacobian_t`'s product."""
    return -v + dR.T @ (C @ v)


def _dense_t(H, v):
    """Hᵀ v for a dense estimate `H` (`Broyden(history=None)`)."""
    return H.T @ v


# ----------------------------------------------------------------------------- Broyden


class _BroydenState(eqx.Module):
    x: Float[Array, " n"]
    F: Float[Array, " n"]
    rnorm: Float[Array, ""]
    H: Float[Array, "n n"]  # approximate inverse Jacobian of the residual


class _LimitedBroydenState(eqx.Module):
    x: Float[Array, " n"]
    F: Float[Array, " n"]
    rnorm: Float[Array, ""]
    U: Float[Array, "m n"]  # H = H0 + Σ_i u_i v_iᵀ (rows of U and V; unused rows are zero)
    V: Float[Array, "m n"]
    k: Int[Array, ""]  # updates made (the next one overwrites row k mod m)
    lu: Any  # roots: the LU factors of ∂F/∂x at x0 (H0 = its inverse); fixed points: None


class Broyden(AbstractRootFinder):
    """Broyden's ("good") quasi-Newton method.

    For fixed points the residual is F(x) = g(x) − x and the inverse-Jacobian estimate
    starts at −I, so the first step is a Picard step; for roots it starts at the exact
    inverse Jacobian at `x0` (an LU factorisation, applied by two triangular solves).

    **Arguments:**

    - `history`: None keeps a dense n×n estimate, updated by a rank-one product each step
      (O(n²) memory and work per step: states up to a few thousand entries). An int m keeps
      the rank-one updates, H = H0 + Σ uᵢvᵢᵀ, and restarts from H0 once m are stored
      (limited memory: O(mn) per step for fixed points; roots keep H0's LU factors, O(n²)).
    - `tol`, `max_steps`, `norm` as every solver.
    """

    history: Optional[int] = eqx.field(default=None, static=True)
    tol: float = 1e-5
    max_steps: int = eqx.field(default=100, static=True)
    norm: Callable = eqx.field(default=max_norm, static=True)

    def __check_init__(self):
        if self.history is not None and not (isinstance(self.history, int)
                                             and self.history >= 1):
            raise ValueError(f"Broyden(history={self.history!r}) must be None or an int >= 1.")

    def init(self, prob, x, args):
        F = prob.residual(x, args)
        n = x.shape[0]
        lu = None
        if not isinstance(prob, _FixedPointProblem):
            J = jax.jacfwd(lambda y: prob.residual(y, args))(x)
            lu = jax.scipy.linalg.lu_factor(J)
        if self.history is None:
            H = (-jnp.eye(n, dtype=x.dtype) if lu is None
                 else jax.scipy.linalg.lu_solve(lu, jnp.eye(n, dtype=x.dtype)))
            return _BroydenState(x, F, self._rnorm(F), H)
        zeros = jnp.zeros((self.history, n), x.dtype)
        return _LimitedBroydenState(x, F, self._rnorm(F), zeros, zeros,
                                    jnp.zeros((), jnp.int32), lu)

    def step(self, prob, s, args):
        if self.history is not None:
            return self._limited_step(prob, s, args)
        dx = -s.H @ s.F
        x = s.x + dx
        F = prob.residual(x, args)
        dF = F - s.F
        HdF = s.H @ dF
        denom = jnp.vdot(dx, HdF)
        safe = jnp.abs(denom) > 1e-30
        upd = jnp.outer((dx - HdF) / jnp.where(safe, denom, 1.0), dx @ s.H)
        H = jnp.where(safe, s.H + upd, s.H)
        return _BroydenState(x, F, self._rnorm(F), H)

    @staticmethod
    def _apply(s, y, transpose=False):
        """H y (or Hᵀ y) with H = H0 + Uᵀ V (rows u_i, v_i)."""
        if s.lu is None:
            base = -y
        else:
            base = jax.scipy.linalg.lu_solve(s.lu, y, trans=1 if transpose else 0)
        if transpose:
            return base + s.V.T @ (s.U @ y)
        return base + s.U.T @ (s.V @ y)

    def _limited_step(self, prob, s, args):
        dx = -self._apply(s, s.F)
        x = s.x + dx
        F = prob.residual(x, args)
        dF = F - s.F
        HdF = self._apply(s, dF)
        denom = jnp.vdot(dx, HdF)
        safe = jnp.abs(denom) > 1e-30
        u = (dx - HdF) / jnp.where(safe, denom, 1.0)
        v = self._apply(s, dx, transpose=True)
        # a full history restarts from H0 (dropping only the oldest update would leave the
        # later ones, each made relative to it, inconsistent, and the iteration diverges)
        full = s.k >= self.history
        U = jnp.where(full, 0.0, s.U)
        V = jnp.where(full, 0.0, s.V)
        k = jnp.where(full, 0, s.k)
        U = jnp.where(safe, U.at[k].set(u), U)
        V = jnp.where(safe, V.at[k].set(v), V)
        return _LimitedBroydenState(x, F, self._rnorm(F), U, V, k + safe.astype(jnp.int32),
                                    s.lu)

    def terminate(self, state):
        return self._stop(state.rnorm, ~jnp.isfinite(state.rnorm))

    def output(self, state):
        return state.x, state.rnorm

    def inverse_jacobian_t(self, state):
        """`v ↦ Hᵀ v` with H the inverse-Jacobian estimate the iteration kept."""
        if self.history is None:
            return jax.tree_util.Partial(_dense_t, state.H)
        return jax.tree_util.Partial(_limited_t, state)


def _limited_t(state, v):
    """Hᵀ v for a limited-memory estimate (`Broyden(history=m)`)."""
    return Broyden._apply(state, v, transpose=True)


# ----------------------------------------------------------------------------- Newton


class Newton(AbstractRootFinder):
    """Newton's method with the exact (dense, forward-mode) Jacobian of the residual.

    **Arguments:**

    - `damping`: in [0, 1); each step moves x ← x + (1 − damping)·Δx, 0 is the full Newton
      step.
    - `tol`, `max_steps`, `norm` as every solver.

    Each step costs one Jacobian (n forward-mode evaluations, vectorised) and one dense solve:
    meant for small and medium states. A singular Jacobian ends the solve as `nonfinite`.
    """

    damping: float = 0.0
    tol: float = 1e-5
    max_steps: int = eqx.field(default=100, static=True)
    norm: Callable = eqx.field(default=max_norm, static=True)

    def __check_init__(self):
        _check_damping("Newton", self.damping)

    def init(self, prob, x, args):
        F = prob.residual(x, args)
        return _PlainState(x, F, self._rnorm(F))

    def step(self, prob, s, args):
        J = jax.jacfwd(lambda y: prob.residual(y, args))(s.x)
        dx = jnp.linalg.solve(J, -s.r)
        x = s.x + (1.0 - self.damping) * dx
        F = prob.residual(x, args)
        return _PlainState(x, F, self._rnorm(F))

    def terminate(self, state):
        return self._stop(state.rnorm, ~jnp.isfinite(state.rnorm))

    def output(self, state):
        return state.x, state.rnorm


# ----------------------------------------------------------------------------- best so far


class _BestState(eqx.Module):
    inner: Any
    best_x: Float[Array, " n"]
    best_rnorm: Float[Array, ""]


class _BestSoFar(eqx.Module):
    """Wraps any solver and keeps the iterate with the smallest finite residual; the driver
    wraps every solver in it, so `Solution.value` is the best point seen."""

    solver: AbstractSolver

    def init(self, prob, x, args):
        inner = self.solver.init(prob, x, args)
        x, rn = self.solver.output(inner)
        return _BestState(inner, x, jnp.where(jnp.isfinite(rn), rn, jnp.inf))

    def step(self, prob, state, args):
        inner = self.solver.step(prob, state.inner, args)
        x, rn = self.solver.output(inner)
        better = jnp.isfinite(rn) & (rn < state.best_rnorm)
        return _BestState(
            inner,
            jnp.where(better, x, state.best_x),
            jnp.where(better, rn, state.best_rnorm),
        )

    def terminate(self, state):
        return self.solver.terminate(state.inner)

    def best(self, state):
        """`(best_x, its residual norm, last residual norm)`."""
        return state.best_x, state.best_rnorm, self.solver.output(state.inner)[1]
