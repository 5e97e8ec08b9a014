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
    meets the tolerance. The budget is rounded up to whole cycles. So a solve costs
    1 + Σ_cycles (basis size + 1) products, at most 1 + cycles·(restart + 1): the starting
    residual, then per cycle the basis and the check, which is the residual `linear_solve`
    reports. No cycle runs when the starting guess already meets the tolerance. It is one
    loop of one product per iteration (a check or an Arnoldi step), so that the product
    (the map's vector–Jacobian product, in an implicit adjoint) is compiled once, not three
    times (the start, the check, the basis): the quickstart's training step compiles in
    about 9 % less time.

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
        shape, dtype, n = b.shape, b.dtype, b.size
        dot = functools.partial(jnp.dot, precision=jax.lax.Precision.HIGHEST)  # as jax's
        tiny = jnp.finfo(dtype).tiny
        rows = jnp.arange(restart + 1)

        # One loop, one product per iteration, so that the map's product is traced once:
        # `check` says whether this iteration's product is the true residual of the
        # candidate `wc` (the starting guess b, then each cycle's answer) or the next
        # Arnoldi vector's (`V[k]`). A check keeps the candidate if its residual is finite
        # and smaller, and starts the next cycle from the kept residual while it is above
        # the target and cycles are left; an Arnoldi step that reaches the target or the
        # cycle's size turns the basis into the next candidate (the minimal-residual
        # combination, from the Hessenberg matrix's least squares).
        def cond(c):
            return ~c["done"]

        def body(c):
            check, k = c["check"], c["k"]
            y = matvec(jnp.where(check, c["wc"].reshape(-1), c["V"][k]).reshape(shape))
            y = y.reshape(-1)
            # the check: the candidate's residual, kept if better (the first always)
            r_new = b.reshape(-1) - y
            rnorm_new = l2_norm(r_new)
            keep = c["first"] | (jnp.isfinite(rnorm_new) & (rnorm_new < c["rnorm"]))
            w = jnp.where(keep, c["wc"].reshape(-1), c["w"])
            r = jnp.where(keep, r_new, c["r"])
            rnorm = jnp.where(keep, rnorm_new, c["rnorm"])
            started = jnp.where(c["first"], 0, c["cycles"] + 1)
            more = (rnorm > target) & (started < cycles)
            V0 = jnp.zeros_like(c["V"]).at[0].set(r / jnp.where(rnorm > tiny, rnorm, 1.0))
            g0 = jnp.zeros((restart + 1,), dtype).at[0].set(rnorm)
            # the Arnoldi step (classical Gram–Schmidt, twice: V stays orthonormal in float32)
            V, H, cs, sn, g = c["V"], c["H"], c["cs"], c["sn"], c["g"]
            basis = rows <= k
            h = jnp.where(basis, dot(V, y), 0.0)
            v = y - dot(h, V)
            h2 = jnp.where(basis, dot(V, v), 0.0)
            v = v - dot(h2, V)
            norm = l2_norm(v)
            h = (h + h2).at[k + 1].set(norm)
            # a breakdown (norm 0: the basis spans the solution) leaves the next vectors at 0
            V = V.at[k + 1].set(jnp.where(norm > tiny, v / jnp.where(norm > tiny, norm, 1.0),
                                          0.0))
            H = H.at[:, k].set(h)

            def rotate(i, h):  # the earlier rotations, applied to the new column
                a, b_ = h[i], h[i + 1]
                on = i < k
                return h.at[i].set(jnp.where(on, cs[i] * a + sn[i] * b_, a)).at[i + 1].set(
                    jnp.where(on, -sn[i] * a + cs[i] * b_, b_))

            h = jax.lax.fori_loop(0, restart, rotate, h)
            rho = jnp.sqrt(h[k] ** 2 + h[k + 1] ** 2)
            cos = jnp.where(rho > tiny, h[k] / jnp.where(rho > tiny, rho, 1.0), 1.0)
            sin = jnp.where(rho > tiny, h[k + 1] / jnp.where(rho > tiny, rho, 1.0), 0.0)
            g = g.at[k + 1].set(-sin * g[k]).at[k].set(cos * g[k])
            cs, sn, k1 = cs.at[k].set(cos), sn.at[k].set(sin), k + 1
            # the cycle ends at `restart` products or once its minimal residual |g[k1]| is
            # reached: the least-squares combination of its first k1 basis vectors
            ends = (k1 >= restart) | (jnp.abs(g[k1]) <= target)
            Hk = jnp.where(jnp.arange(restart)[None, :] < k1, H, 0.0)  # columns past k1
            e1 = jnp.zeros((restart + 1,), dtype).at[0].set(c["rnorm"])
            coef = jnp.linalg.lstsq(Hk, e1)[0]
            wc = c["w"] + dot(coef, V[:restart])

            def pick(on_check, on_arnoldi):
                return jax.tree.map(lambda a, b_: jnp.where(check, a, b_), on_check, on_arnoldi)

            new = {
                "w": pick(w, c["w"]), "r": pick(r, c["r"]), "rnorm": pick(rnorm, c["rnorm"]),
                "wc": pick(c["wc"], jnp.where(ends, wc, c["wc"].reshape(-1)).reshape(shape)),
                "V": pick(V0, V), "H": pick(jnp.zeros_like(H), H),
                "cs": pick(jnp.zeros_like(cs), cs), "sn": pick(jnp.zeros_like(sn), sn),
                "g": pick(g0, g), "k": pick(jnp.zeros_like(k), k1),
                "check": pick(~more, ends), "cycles": pick(started, c["cycles"]),
                "first": jnp.zeros_like(c["first"]),
                "products": c["products"] + 1,
                "done": pick(~more, jnp.zeros_like(c["done"])),
            }
            # under vmap the loop runs on for systems that are done: they keep their state
            return jax.tree.map(lambda a, b_: jnp.where(c["done"], b_, a), new, c)

        init = {"w": b.reshape(-1), "r": jnp.zeros((n,), dtype),
                "rnorm": jnp.full((), jnp.inf, dtype), "wc": b,
                "V": jnp.zeros((restart + 1, n), dtype), "H": jnp.zeros((restart + 1, restart), dtype),
                "cs": jnp.zeros((restart,), dtype), "sn": jnp.zeros((restart,), dtype),
                "g": jnp.zeros((restart + 1,), dtype), "k": jnp.zeros((), jnp.int32),
                "check": jnp.ones((), bool), "cycles": jnp.zeros((), jnp.int32),
                "first": jnp.ones((), bool), "products": jnp.zeros((), jnp.int32),
                "done": jnp.zeros((), bool)}
        out = jax.lax.while_loop(cond, body, batched_like(init, target))
        return out["w"].reshape(shape), out["products"], out["rnorm"]


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
