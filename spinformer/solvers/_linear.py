"""Linear solvers for the backward pass of `Implicit`: the matrix-free `GMRES`, `BiCGStab`
and any fixed-point solver run on the Richardson map; `Dense` (the matrix formed, LU or
Cholesky); `Auto` (`Dense` for small systems, `GMRES` with a long Krylov basis for large).

They solve A w = b given only `matvec(w) = A w`, to the relative tolerance
‖A w − b‖₂ ≤ rtol·‖b‖₂ within `max_steps` matrix–vector products; the tolerance and budget
come from the adjoint (`Implicit(rtol=..., max_steps=...)`), the method from these objects.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
import math
from typing import Callable, Optional

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.scipy.linalg  # noqa: F401  (jax.scipy.linalg.cho_solve)
from jaxtyping import Array

from ._solvers import (
    AbstractFixedPointSolver,
    _BestSoFar,
    _FixedPointProblem,
    batched_like,
    l2_norm,
)


class AbstractLinearSolver(eqx.Module):
    """A matrix-free solver of A w = b (`solve(matvec, b, rtol=, max_steps=) -> (w, products)`)."""

    @abc.abstractmethod
    def solve(self, matvec: Callable[[Array], Array], b: Array, *, rtol, max_steps: int
              ) -> tuple[Array, Array]:
        """An approximate solution w of A w = b, started at w = b, and the number of
        matrix–vector products it took (−1 if the method does not report it)."""

    def solve_with_residual(self, matvec, b, *, rtol, max_steps, point=None):
        """`(w, products, ‖b − A w‖₂)`: `solve` and the true residual of its answer (one
        product more, unless a solver already has it). `point`: the forward solution and its
        arguments, for solvers that use them (`Dense(matrix=...)`)."""
        del point
        w, products = self.solve(matvec, b, rtol=rtol, max_steps=max_steps)
        return w, products, l2_norm(b - matvec(w))


class GMRES(AbstractLinearSolver):
    """Restarted GMRES started at w = b: each cycle builds an orthonormal Krylov basis of
    up to `restart` products from the current residual (Arnoldi, classical Gram–Schmidt
    applied twice), takes the minimal-residual combination, and checks the true residual
    with one product more; that residual starts the next cycle. A cycle stops adding to its
    basis as soon as the minimal residual it can reach (tracked by Givens rotations, free)
    meets the tolerance; the combination is then a back substitution in the rotated
    Hessenberg matrix. The budget is rounded up to whole cycles. So a solve costs
    1 + Σ_cycles (basis size + 1) products, at most 1 + cycles·(restart + 1): the starting
    residual, then per cycle the basis and the check, which is the residual `linear_solve`
    reports. No cycle runs when the starting guess already meets the tolerance.

    The starting residual and each cycle's check are one product site in the compiled
    loop (an iteration checks its candidate, then builds the next cycle's basis from the
    residual it keeps), so the map's product is compiled twice, not three times.

    (`jax.scipy.sparse.linalg.gmres` ends each cycle with a true residual of its own that a
    caller cannot read, so checking its answer costs restart + 2 products a cycle; this
    loop spends restart + 1. Starting at w = 0 would save the starting residual but search
    K_restart(A, b) instead of b + K_restart(A, b − Ab) ⊂ K_(restart+1)(A, b): on the
    spin-attention backward solves that cost a second cycle more often than it saved a
    product.)

    **Arguments:**

    - `restart`: products per cycle (the size of the Krylov basis).
    """

    restart: int = eqx.field(default=20, static=True)

    def __check_init__(self):
        if not (isinstance(self.restart, int) and self.restart >= 1):
            raise ValueError(f"GMRES(restart={self.restart!r}) must be an int >= 1.")

    def solve(self, matvec, b, *, rtol, max_steps):
        w, products, _ = self.solve_with_residual(matvec, b, rtol=rtol, max_steps=max_steps)
        return w, products

    def solve_with_residual(self, matvec, b, *, rtol, max_steps, point=None):
        del point
        restart = max(1, min(self.restart, b.size))
        cycles = max(1, math.ceil(max_steps / restart))
        target = rtol * l2_norm(b)

        def check_then_build(c):
            # check the candidate w + d (the first time: w = b), keep it if it lowered the
            # residual (always the first time: that is the starting residual), then build
            # the next cycle's correction from the residual kept; a system that stops
            # builds nothing (its basis loop ends at once) and keeps d at 0. Under vmap the
            # loop runs on for systems that have stopped; the loop's own select leaves
            # them as they are.
            w, d, r, rnorm, k, products, first, _ = c
            w_new = w + d
            r_new = b - matvec(w_new)
            rnorm_new = l2_norm(r_new)
            keep = first | (jnp.isfinite(rnorm_new) & (rnorm_new < rnorm))
            w, r = jnp.where(keep, w_new, w), jnp.where(keep, r_new, r)
            rnorm = jnp.where(keep, rnorm_new, rnorm)
            k = k + jnp.where(first, 0, 1)
            go = (rnorm > target) & (k < cycles)
            d, size = _arnoldi_correction(matvec, r, rnorm, restart,
                                          jnp.where(go, target, jnp.inf))
            return (w, jnp.where(go, d, 0.0), r, rnorm, k, products + 1 + size,
                    jnp.zeros_like(first), go)

        zero = jnp.zeros((), jnp.int32)
        init = (b, jnp.zeros_like(b), b, jnp.full((), jnp.inf, b.dtype), zero, zero,
                jnp.ones((), bool), jnp.ones((), bool))
        w, _, _, rnorm, _, products, _, _ = jax.lax.while_loop(
            lambda c: c[-1], check_then_build, batched_like(init, b))
        return w, products, rnorm


def _arnoldi_correction(matvec, r, rnorm, restart: int, target):
    """`(d, products)`: the correction d in K_k(A, r) minimising ‖r − A d‖₂, for the first
    basis size k ≤ `restart` whose minimal residual is ≤ `target` (else k = `restart`), and
    k, the products it took. The minimal residual of each k comes from Givens rotations of
    the Hessenberg matrix, as the basis grows; d itself from a back substitution in the
    rotated (upper triangular) matrix's first k columns. `target = inf` builds nothing
    (k = 0, d = 0)."""
    shape, dtype = r.shape, r.dtype
    dot = functools.partial(jnp.dot, precision=jax.lax.Precision.HIGHEST)  # as jax's GMRES
    tiny = jnp.finfo(dtype).tiny
    V = jnp.zeros((restart + 1, r.size), dtype)
    V = V.at[0].set(r.reshape(-1) / jnp.where(rnorm > tiny, rnorm, 1.0))
    R = jnp.zeros((restart + 1, restart), dtype)
    rows = jnp.arange(restart + 1)
    # the rotations so far (cosines, sines) and the rotated right-hand side rnorm·e1, whose
    # entry k + 1 is the minimal residual with k + 1 basis vectors (up to sign)
    cs, sn = jnp.zeros((restart,), dtype), jnp.zeros((restart,), dtype)
    g = jnp.zeros((restart + 1,), dtype).at[0].set(rnorm)

    def going(c):
        k, _, _, _, _, g = c
        return (k < restart) & (jnp.abs(g[k]) > target)

    def arnoldi(c):
        k, V, R, cs, sn, g = c
        v = matvec(V[k].reshape(shape)).reshape(-1)
        basis = rows <= k
        h = jnp.where(basis, dot(V, v), 0.0)
        v = v - dot(h, V)
        h2 = jnp.where(basis, dot(V, v), 0.0)  # the second pass keeps V orthonormal in float32
        v = v - dot(h2, V)
        norm = l2_norm(v)
        h = (h + h2).at[k + 1].set(norm)
        # a breakdown (norm 0: the basis spans the solution) leaves the next vectors at 0
        V = V.at[k + 1].set(jnp.where(norm > tiny, v / jnp.where(norm > tiny, norm, 1.0),
                                      0.0))

        def rotate(i, h):  # the earlier rotations, applied to the new column
            a, b = h[i], h[i + 1]
            on = i < k
            return h.at[i].set(jnp.where(on, cs[i] * a + sn[i] * b, a)).at[i + 1].set(
                jnp.where(on, -sn[i] * a + cs[i] * b, b))

        h = jax.lax.fori_loop(0, restart, rotate, h)
        rho = jnp.sqrt(h[k] ** 2 + h[k + 1] ** 2)
        c = jnp.where(rho > tiny, h[k] / jnp.where(rho > tiny, rho, 1.0), 1.0)
        s_ = jnp.where(rho > tiny, h[k + 1] / jnp.where(rho > tiny, rho, 1.0), 0.0)
        g = g.at[k + 1].set(-s_ * g[k]).at[k].set(c * g[k])
        R = R.at[:, k].set(h.at[k].set(rho).at[k + 1].set(0.0))  # rotated: upper triangular
        return k + 1, V, R, cs.at[k].set(c), sn.at[k].set(s_), g

    k, V, R, _, _, g = jax.lax.while_loop(
        going, arnoldi, batched_like((jnp.zeros((), jnp.int32), V, R, cs, sn, g), rnorm))
    # min ‖rnorm·e1 − H y‖ over the first k columns is R[:k, :k] y = g[:k]; the columns past
    # k are unused: an identity block there gives y = 0 for them
    used = jnp.arange(restart) < k
    R = jnp.where(used[:, None] & used[None, :], R[:restart],
                  jnp.eye(restart, dtype=dtype))
    y = jax.scipy.linalg.solve_triangular(R, jnp.where(used, g[:restart], 0.0), lower=False)
    return dot(y, V[:restart]).reshape(shape), k


class BiCGStab(AbstractLinearSolver):
    """BiCGSTAB (`jax.scipy.sparse.linalg.bicgstab`); two products per iteration."""

    def solve(self, matvec, b, *, rtol, max_steps):
        w, _ = jax.scipy.sparse.linalg.bicgstab(matvec, b, x0=b, tol=rtol, maxiter=max_steps)
        return w, -1  # jax's BiCGSTAB does not report its iterations


class Dense(AbstractLinearSolver):
    """A direct solve with the matrix formed: LU, or Cholesky when `positive_definite`.

    **Arguments:**

    - `matrix`: `matrix(x, args) -> A` `(n, n)`, the system's matrix in closed form at the
      solution `x` of the forward problem (`A = ∂F/∂x` for a root F(x) = 0,
      `A = I − ∂g/∂x` for a fixed point x = g(x)); `Implicit` passes the point. None: A is
      formed from n matrix–vector products (one per unit vector, vmapped), which suits
      small systems whose Jacobian has no cheap closed form.
    - `positive_definite`: A is symmetric positive definite: a Cholesky factorisation
      (half the work of LU, and a failed factorisation gives NaN, caught by the residual
      check of `linear_solve`).

    O(n³) work and O(n²) memory: for the systems where a matrix-free solver would need
    close to n products anyway (ill-conditioned, or small), or where the matrix is cheaper
    in closed form than n products (the free-energy saddle's Hessian,
    `spins.free_energy.SaddleImplicit`). It solves every non-singular system, where the
    Richardson iteration needs the spectrum of A near 1.
    """

    matrix: Optional[Callable] = eqx.field(default=None, static=True)
    positive_definite: bool = eqx.field(default=False, static=True)

    def solve(self, matvec, b, *, rtol, max_steps, point=None):
        del rtol, max_steps
        shape, n = b.shape, b.size
        if self.matrix is not None:
            if point is None:
                raise ValueError("Dense(matrix=...) needs the solution point: use it as "
                                 "Implicit's linear_solver, or leave matrix=None.")
            A = jnp.asarray(self.matrix(*point)).reshape(n, n)
            products = 0
        else:  # row i of A is (Aᵀ e_i)ᵀ: n transposed products
            eye = jnp.eye(n, dtype=b.dtype)
            A = jax.vmap(lambda e: matvec(e.reshape(shape)).reshape(-1))(eye)
            products = n
        rhs = b.reshape(-1)
        if self.positive_definite:
            w = jax.scipy.linalg.cho_solve(jax.scipy.linalg.cho_factor(A.T, lower=True), rhs)
        else:
            w = jnp.linalg.solve(A.T, rhs)
        return w.reshape(shape), products

    def solve_with_residual(self, matvec, b, *, rtol, max_steps, point=None):
        w, products = self.solve(matvec, b, rtol=rtol, max_steps=max_steps, point=point)
        return w, products + 1, l2_norm(b - matvec(w))  # the residual costs a product


class Auto(AbstractLinearSolver):
    """A solver for any non-singular system: `Dense()` when it has at most `dense_max`
    unknowns (n products and an LU factorisation: exact up to rounding, whatever the
    spectrum), else `GMRES(restart)` with a budget of at least `cycles` cycles.

    The default of `root_find`'s implicit adjoint (a root's Jacobian need not be near the
    identity, which the Richardson iteration needs) and of `Implicit`'s `fallback` (the
    solver tried when the first misses its tolerance). The choice is made from the static
    size of the system, when the backward pass is traced.

    **Arguments:**

    - `dense_max`: the most unknowns solved densely.
    - `restart`: GMRES's products per cycle above `dense_max`.
    - `cycles`: GMRES's least budget, in cycles.
    """

    dense_max: int = eqx.field(default=512, static=True)
    restart: int = eqx.field(default=50, static=True)
    cycles: int = eqx.field(default=10, static=True)

    def __check_init__(self):
        if not (isinstance(self.dense_max, int) and self.dense_max >= 0):
            raise ValueError(f"Auto(dense_max={self.dense_max!r}) must be an int >= 0.")
        if not (isinstance(self.restart, int) and self.restart >= 1
                and isinstance(self.cycles, int) and self.cycles >= 1):
            raise ValueError(f"Auto(restart={self.restart!r}, cycles={self.cycles!r}) must "
                             "be ints >= 1.")

    def choose(self, n: int) -> AbstractLinearSolver:
        """The solver used for a system of `n` unknowns."""
        return Dense() if n <= self.dense_max else GMRES(restart=self.restart)

    def _budget(self, n, max_steps):
        return max_steps if n <= self.dense_max else max(max_steps,
                                                         self.cycles * min(self.restart, n))

    def solve(self, matvec, b, *, rtol, max_steps, point=None):
        return self.choose(b.size).solve(matvec, b, rtol=rtol,
                                         max_steps=self._budget(b.size, max_steps))

    def solve_with_residual(self, matvec, b, *, rtol, max_steps, point=None):
        return self.choose(b.size).solve_with_residual(
            matvec, b, rtol=rtol, max_steps=self._budget(b.size, max_steps), point=point)


def richardson_solve(solver: AbstractFixedPointSolver, matvec, b, *, rtol, max_steps):
    """`(w, iterations)`: solve A w = b with a fixed-point solver on the Richardson map
    w ↦ w + (b − A w), whose fixed-point residual is the linear residual b − A w.

    `Picard()` gives the Neumann series (needs a contractive I − A); `Anderson()` a
    restarted-GMRES-like Krylov method with a short, cheap history. The solver's own `tol`,
    `max_steps` and `norm` are replaced by the adjoint's (‖·‖₂, relative to ‖b‖₂).
    """
    solver = dataclasses.replace(solver, tol=rtol * l2_norm(b), max_steps=max_steps,
                                 norm=l2_norm)
    prob = _FixedPointProblem(lambda w, _: w + (b - matvec(w)))
    best = _BestSoFar(solver)

    def cond(c):
        state, k = c
        done, _ = best.terminate(state)
        return (k < max_steps) & ~done

    def body(c):
        state, k = c
        return best.step(prob, state, None), k + 1

    state0 = best.init(prob, b, None)
    state, k = jax.lax.while_loop(cond, body,
                                  batched_like((state0, 0), best.best(state0)[2]))
    return best.best(state)[0], k


def is_lineax_solver(solver) -> bool:
    """A linear solver from lineax (`lineax.LU()`, `lineax.GMRES(...)`, ...)."""
    return type(solver).__module__.split(".")[0] == "lineax"


def _lineax_solve(solver, matvec, b):
    """`(w, products, ‖b − A w‖₂)` by `lineax.linear_solve` on the matrix-free operator
    (products −1: lineax does not report them; its direct solvers form A from n products)."""
    import lineax as lx

    op = lx.FunctionLinearOperator(matvec, jax.ShapeDtypeStruct(b.shape, b.dtype))
    w = lx.linear_solve(op, b, solver=solver, throw=False).value
    return w, -1, l2_norm(b - matvec(w))


def linear_solve(linear_solver, matvec, b, *, rtol, max_steps, point=None):
    """Dispatch to a linear solver or a fixed-point solver (`point = (x, args)`, the
    forward solution and its arguments, for a `Dense` solver with a closed-form matrix).

    **Returns:** `(w, ok, steps, rel)`: the solution; whether the true residual satisfies
    ‖A w − b‖₂ ≤ 10·rtol·‖b‖₂ and w is finite; the matrix–vector products used (−1 where the
    solver does not report them: `BiCGStab`); and ‖A w − b‖₂/‖b‖₂."""
    # one traced program for the product, called from each of the solver's call sites (the
    # starting residual, the loop, the final check): the same arithmetic (the step's
    # outputs are bit-identical), traced and lowered once instead of at every site
    matvec = jax.jit(matvec)
    if isinstance(linear_solver, AbstractFixedPointSolver):
        w, steps = richardson_solve(linear_solver, matvec, b, rtol=rtol, max_steps=max_steps)
        steps = steps + 1  # the first residual costs a product as well
        resid = l2_norm(matvec(w) - b)
    elif is_lineax_solver(linear_solver):  # its own tolerances (set on the solver object)
        w, steps, resid = _lineax_solve(linear_solver, matvec, b)
    else:  # (GMRES's last cycle already ends with the true residual)
        w, steps, resid = linear_solver.solve_with_residual(matvec, b, rtol=rtol,
                                                            max_steps=max_steps, point=point)
    bnorm = l2_norm(b)
    ok = resid <= 10.0 * rtol * bnorm + jnp.finfo(b.dtype).tiny
    rel = resid / jnp.where(bnorm > 0, bnorm, 1.0)
    return w, ok & jnp.all(jnp.isfinite(w)), jnp.asarray(steps, jnp.int32), rel
