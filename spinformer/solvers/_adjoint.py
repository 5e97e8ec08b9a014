"""How gradients flow through a solve: `Implicit`, `Shine`, `Unrolled`, `Phantom`, `OneStep`.

An adjoint is passed as `adjoint=` to `fixed_point` / `root_find` (the optimistix pattern:
an object, not a boolean flag). Each one decides how the forward loop is run and how its
output is connected to the inputs for reverse-mode differentiation.
"""

from __future__ import annotations

import abc
import contextlib
import contextvars
import functools
from typing import Callable, Optional, Union

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.flatten_util import ravel_pytree
from jaxtyping import Array, Float, PyTree

from ._linear import AbstractLinearSolver, Auto, is_lineax_solver, linear_solve
from ._solvers import (
    AbstractFixedPointSolver,
    Anderson,
    _check_damping,
    _FixedPointProblem,
    batched_like,
    l2_norm,
    matmul_precision,
)


def _stop(tree):
    dyn, static = eqx.partition(tree, eqx.is_array)
    return eqx.combine(jax.lax.stop_gradient(dyn), static)


class AbstractAdjoint(eqx.Module):
    """Base class of the adjoints."""

    @abc.abstractmethod
    def attach(self, prob, args, run_loop, throw):
        """Run the forward loop, `run_loop(prob, args, differentiable=..., last=False)` (the
        driver's `_run_loop`), and return its `(value, stats)` with gradients attached."""


class Unrolled(AbstractAdjoint):
    """Backpropagate through every iteration of the forward loop.

    Exact gradients of the computation actually performed: the reference the implicit
    gradients are tested against. The loop stops as soon as the solve converges (as without
    gradients); its iterates are stored at about √(2·max_steps) checkpoints and recomputed
    in the backward pass (`equinox.internal.while_loop(kind="checkpointed")`, the online
    treeverse scheme optimistix's `RecursiveCheckpointAdjoint` uses), so memory grows like
    the square root of the step budget rather than linearly. Reverse mode only (`jax.grad`, `jax.vjp`); forward mode (`jax.jvp`,
    `jax.jacfwd`) is available through `Phantom`, `OneStep` or plain autodiff of a loop
    you unroll yourself.
    """

    def attach(self, prob, args, run_loop, throw):
        return run_loop(prob, args, differentiable=True)


class Implicit(AbstractAdjoint):
    r"""Implicit differentiation at the solution (implicit function theorem).

    For a fixed point `x* = g(x*, θ)` the cotangent `ḡ` of `x*` is pulled back by solving the
    adjoint linear system `(I − ∂g/∂x)ᵀ w = ḡ` at `x*` and returning `wᵀ ∂g/∂θ`; for a root
    `F(x*, θ) = 0` it solves `(∂F/∂x)ᵀ w = −ḡ`. Matrix-free: only vector–Jacobian products of the
    map are used, the Jacobian is never formed. Memory does not depend on how many forward
    iterations were taken.

    **Arguments:**

    - `linear_solver`: how the adjoint system is solved: a fixed-point solver run on the
      Richardson map w ← w + (b − Aᵀw) — `Anderson(history=5, safeguard=False)` (the default:
      a Krylov-like method with little overhead) or `Picard()` (the Neumann series, which
      needs a contractive map) — or a Krylov solver, `GMRES(restart=...)` or `BiCGStab()`.
      A fixed-point solver's own `tol`, `max_steps` and `norm` are replaced by `rtol`·‖b‖₂,
      `max_steps` and the 2-norm.
      `Dense()` forms the matrix and solves directly (small or ill-conditioned systems;
      with `Dense(matrix=...)` from a closed form); `Auto()` picks `Dense` up to 512
      unknowns, else GMRES(50). lineax's solvers work too (`lineax.LU()`,
      `lineax.GMRES(rtol, atol)`, ...: their own tolerances apply, the residual is checked
      against `rtol` like every other, and they report no product counts); ours count
      products, and `Dense(matrix=...)` takes a closed-form matrix.
    - `rtol`: relative tolerance ‖Aw − b‖₂ ≤ rtol·‖b‖₂ of the adjoint solve (a forward
      solver's `tol` is absolute, in its own norm: the two are named apart).
    - `max_steps`: most matrix–vector products the adjoint solve may use.
    - `fallback`: the solver tried when `linear_solver` misses its tolerance (default
      `Auto()`: a dense solve up to 512 unknowns, else GMRES(50) for at least 10 cycles;
      None: no second try). It runs only for the systems whose first solve failed, one at a
      time, also under (nested) `vmap`: a batch where every system succeeds pays nothing,
      and one failed system of 64 costs one system's fallback. The better of the two
      answers is kept.
    - `precondition`: start the backward solve at the forward solver's own estimate of the
      answer and precondition it with the same estimate (`Anderson` and `Broyden` keep one:
      their secant history approximates the inverse Jacobian, see `Shine`): the system
      solved is Aᵀ M y = b, w = M y, with M ≈ A⁻ᵀ from the forward pass, started at y = b,
      so w starts at the `Shine` gradient. The tolerance, the residual check and the
      fallback are unchanged (the residual of w in the original system is the residual of
      y in this one); only the products needed change, and memory holds the secant history
      (2 × history × n per solve) until the backward pass.

    The backward solve's products are traced at the forward solver's `precision` (float32
    products by default, also on GPUs; see `AbstractSolver`).

    A backward solve that misses its tolerance (checked on the true residual, after the
    solve and the fallback) raises when the forward call had `throw=True`, and otherwise
    makes the gradients NaN. It never returns silent zeros.

    The backward solves can be observed: `record_backward(Implicit(...))` gives the adjoint a
    zero `probe` array, and the gradient of a loss with respect to that probe is the sum,
    over every backward solve the loss went through, of `(1, matrix–vector products,
    relative residual ‖Aw − b‖/‖b‖, 1 if the fallback ran)` (products are −1 per solve for
    `BiCGStab` and lineax's solvers, which do not report them). Inside a model the probe is
    a leaf like any parameter, so stacked layers give per-layer sums and vmapped batches are
    summed; `backward_stats` reads them out of a gradient and zeroes them before an
    optimizer sees them.
    """

    linear_solver: Union[AbstractLinearSolver, AbstractFixedPointSolver] = Anderson(
        history=5, safeguard=False
    )
    rtol: float = 1e-5
    max_steps: int = eqx.field(default=200, static=True)
    probe: Optional[Float[Array, "4"]] = None
    fallback: Union[AbstractLinearSolver, AbstractFixedPointSolver, None] = Auto()
    precondition: bool = eqx.field(default=False, static=True)

    def __check_init__(self):
        ok = (AbstractLinearSolver, AbstractFixedPointSolver)
        if not (isinstance(self.linear_solver, ok) or is_lineax_solver(self.linear_solver)):
            raise ValueError(
                f"Implicit(linear_solver={self.linear_solver!r}) must be a linear solver "
                "(solvers.GMRES(), solvers.BiCGStab(), solvers.Dense(), solvers.Auto(), or "
                "lineax's, e.g. lineax.LU()) or a fixed-point solver (solvers.Anderson(), "
                "solvers.Picard()) run on the Richardson map."
            )
        if self.fallback is not None and not (isinstance(self.fallback, ok)
                                              or is_lineax_solver(self.fallback)):
            raise ValueError(f"Implicit(fallback={self.fallback!r}) must be a linear solver "
                             "(solvers.Auto(), solvers.Dense(), solvers.GMRES()) or None.")
        if not self.rtol > 0:
            raise ValueError(f"Implicit(rtol={self.rtol}) must be > 0.")
        if not (isinstance(self.max_steps, int) and self.max_steps >= 1):
            raise ValueError(f"Implicit(max_steps={self.max_steps!r}) must be an int >= 1.")
        if self.precondition and getattr(self.linear_solver, "matrix", None) is not None:
            raise ValueError("Implicit(precondition=True) cannot precondition Dense(matrix=...),"
                             " which solves with its closed-form matrix: use one or the other.")

    def attach(self, prob, args, run_loop, throw):
        out, stats = run_loop(_stop(prob), _stop(args), differentiable=False,
                              secant=self.precondition)
        value, secant = out if self.precondition else (out, None)
        value = _implicit_identity((prob, args, self.probe), value, _stop(self), throw, secant)
        return value, stats

    def solve_transpose(self, prob, vjp_x, b, point=None, secant=None):
        """Solve Aᵀ w = b with A = I − ∂g/∂x (fixed point) or ∂F/∂x (root) at `point =
        (x, args)`; `(w, ok, products, relative residual, fallback ran)`. `vjp_x(v) = vᵀ ∂g/∂x`
        (or vᵀ ∂F/∂x) must be a pytree (`jax.tree_util.Partial`), so that the fallback's
        batching rule can pick one example's linearisation out of a batch. `secant`: the
        forward solver's `inverse_jacobian_t` (`precondition=True`), else None."""
        fixed = isinstance(prob, _FixedPointProblem)
        matvec = _transpose_matvec(fixed, vjp_x)
        if secant is None:
            first = linear_solve(self.linear_solver, matvec, b, rtol=self.rtol,
                                 max_steps=self.max_steps, point=point)
        else:  # right preconditioning: Aᵀ M y = b, w = M y, the same residual
            M = functools.partial(_inverse_estimate, fixed, secant)
            y, *rest = linear_solve(self.linear_solver, lambda y: matvec(M(y)), b,
                                    rtol=self.rtol, max_steps=self.max_steps, point=point)
            first = (M(y), *rest)
        if self.fallback is None:
            return (*first, jnp.zeros((), bool))

        return _fallback_solve(self.fallback, self.rtol, self.max_steps,
                               isinstance(prob, _FixedPointProblem), vjp_x, b, point, first)


def _inverse_estimate(fixed_point, secant, v):
    """M v with M ≈ A⁻ᵀ from the forward solver's `secant` (v ↦ Hᵀ v, H ≈ (∂F/∂x)⁻¹ for the
    residual F): A = −∂F/∂x for a fixed point (F = g − x), A = ∂F/∂x for a root."""
    w = secant(v)
    return -w if fixed_point else w


def _transpose_matvec(fixed_point, vjp_x):
    """w ↦ Aᵀw for the adjoint system: A = I − ∂g/∂x (fixed point) or ∂F/∂x (root)."""
    return (lambda w: w - vjp_x(w)) if fixed_point else vjp_x


def _fallback_solve(solver, rtol, max_steps, fixed_point, vjp_x, b, point, first):
    """The first solve `first = (w, ok, products, rel)` with `solver` tried where it failed:
    `(w, ok, products, rel, fallback ran)`, keeping the better of the two answers.

    The fallback must cost nothing where no system failed and, in a batch, only the failed
    systems' share where some did. A `lax.cond` under `vmap` runs both branches for every
    example, and a loop that runs at most once (the earlier design) still reserves its
    body's batch-sized buffers at every call, so even a fallback that never runs slows
    every batched backward pass down. So the batched rule is our own
    (`custom_vmap`): a loop over the failed examples only, each solved alone (buffers of one
    system's size), and with no vmap a plain conditional.
    """
    dyn, static = eqx.partition((vjp_x, point), eqx.is_array)

    def run(dyn, b, first):
        w, ok, steps, rel = first
        vjp_x, point = eqx.combine(dyn, static)
        matvec = _transpose_matvec(fixed_point, vjp_x)
        w2, ok2, steps2, rel2 = linear_solve(solver, matvec, b, rtol=rtol, max_steps=max_steps,
                                             point=point)
        better = ok2 | (rel2 < rel)
        return (jnp.where(better, w2, w), ok | ok2, steps + steps2,
                jnp.where(better, rel2, rel), jnp.ones((), bool))

    # jitted once here, so that the rule below, which nested vmaps (and while_loop's
    # batching) trace several times, reuses one trace of the solve per shape
    run = jax.jit(run)

    @jax.custom_batching.custom_vmap
    def fallback(dyn, b, first):  # no vmap: a plain conditional
        return jax.lax.cond(first[1], lambda: (*first, jnp.zeros((), bool)),
                            lambda: run(dyn, b, first))

    @fallback.def_vmap
    def _batched(axis_size, in_batched, dyn, b, first):
        def batch(x, batched):
            return x if batched else jnp.broadcast_to(x, (axis_size, *jnp.shape(x)))

        first = tuple(batch(x, bt) for x, bt in zip(first, in_batched[2]))
        rest = batch(b, in_batched[1])

        def pick(i):
            d = jax.tree.map(lambda x, bt: x[i] if bt else x, dyn, in_batched[0])
            return d, rest[i], tuple(x[i] for x in first)

        def body(c):
            todo, out = c
            i = jnp.argmax(todo)
            needed = todo[i]  # False only in lanes of an enclosing vmap that are done
            # The barrier ties the picked system to the loop's state: where i is a constant
            # (a batch of one) XLA would otherwise hoist the whole fallback out of the loop
            # and pay for it at every call.
            (d, bi, (w, ok, steps, rel)), needed = jax.lax.optimization_barrier(
                (pick(i), needed))
            # `fallback` itself, not `run`: an enclosing vmap batches this call with this
            # same rule, so it too solves only its failed systems.
            one = fallback(d, bi, (w, ok | ~needed, steps, rel))
            old = tuple(o[i] for o in out)
            one = tuple(jnp.where(needed, a, b) for a, b in zip(one, old))
            out = tuple(o.at[i].set(v) for o, v in zip(out, one))
            return todo.at[i].set(False), out

        ran = jnp.zeros((axis_size,), bool)
        init = batched_like((~first[1], (*first, ran)), first[3])  # (for an enclosing vmap)
        _, out = jax.lax.while_loop(lambda c: jnp.any(c[0]), body, init)
        return out, (True,) * 5

    return fallback(dyn, b, first)


# Set by `without_fallbacks()`: backward solves traced meanwhile leave their fallback out.
_FALLBACKS = contextvars.ContextVar("fallbacks", default=True)


@contextlib.contextmanager
def without_fallbacks(active: bool = True):
    """While active (`active` True), the `Implicit` solves traced leave their backward
    pass's `fallback` out, unless the call had `throw=True`: a backward solve that misses its
    tolerance gives NaN gradients at once (`Implicit`), which a training step skips. The
    fallback is a second solver, compiled into every backward pass that has one, for the
    rare solve that needs it (a few seconds of compiling per training step); the training
    loop compiles its step without it and, at the first skipped step of a model that has
    one, compiles it in and takes that step again (`spinformer.train.fit`). Like
    `cut_solves` it acts when a solve is traced, so it must surround the first trace of a
    function."""
    token = _FALLBACKS.set(not active)
    try:
        yield
    finally:
        _FALLBACKS.reset(token)


def _fallback_as_set(adjoint, throw: bool):
    """`adjoint` without its fallback where `without_fallbacks` is active and `throw` False.
    Read by the solve before its compiled part, of which the adjoint is a static argument,
    so a solve compiled before with the other choice is not reused."""
    if _FALLBACKS.get() or throw or not _is_implicit(adjoint) or adjoint.fallback is None:
        return adjoint
    return eqx.tree_at(lambda a: a.fallback, adjoint, None, is_leaf=lambda x: x is None)


def has_fallback(tree: PyTree) -> bool:
    """Whether any `Implicit` adjoint in `tree` (a model, say) has a `fallback`."""
    return any(_is_implicit(x) and x.fallback is not None
               for x in jax.tree.leaves(tree, is_leaf=_is_implicit))


def _is_implicit(x) -> bool:
    return isinstance(x, Implicit)


def record_backward(tree: PyTree) -> PyTree:
    """`tree` with a zero `probe` on every `Implicit` adjoint in it that has none, so that
    the backward solves of a model built with it are recorded (see `Implicit`).

    **Arguments:** `tree`, an adjoint (other adjoints have no backward solve and are
    returned unchanged) or any pytree holding adjoints, such as a module's constructor
    arguments.

    The caller that reads the records passes recorded adjoints to the modules it builds and
    reads the records out of its gradients with `backward_stats`, as the training step
    does; a module keeps the adjoint it is given. Record before building: layers stacked
    with `eqx.filter_vmap` then get one probe per layer, which recording a built model
    cannot give them.
    """
    def add(x):
        if _is_implicit(x) and x.probe is None:
            return eqx.tree_at(lambda a: a.probe, x, jnp.zeros(4, jnp.float32),
                               is_leaf=lambda v: v is None)
        return x

    return jax.tree.map(add, tree, is_leaf=_is_implicit)


def backward_stats(grads):
    """Split the backward-solve records out of a gradient.

    **Arguments:** `grads`, a gradient pytree of a model whose adjoints were made by
    `record_backward` (e.g. from `eqx.filter_grad`).

    **Returns:** `(grads, records)`: the gradient with every probe cotangent set to zero (so
    the optimizer and gradient clipping never see it), and the list of the probes'
    cotangents in tree order, each `(..., 4)` = (solves, products, relative residual,
    fallbacks) summed over the solves (a leading layer axis when the layers are stacked).
    """
    records = []

    def take(x):
        if _is_implicit(x) and x.probe is not None:
            records.append(x.probe)
            return eqx.tree_at(lambda a: a.probe, x, jnp.zeros_like(x.probe))
        return x

    grads = jax.tree.map(take, grads, is_leaf=_is_implicit)
    return grads, records


_BACKWARD_MSG = (
    "Implicit adjoint: the backward linear solve (and its fallback, if it has one) did not "
    "reach its tolerance, so the gradient of this fixed point / root is unreliable "
    "(I - dg/dx may be near-singular: the fixed point is close to a bifurcation). Raise "
    "Implicit(max_steps=...), try linear_solver=GMRES(restart=20) or fallback=Dense(), use "
    "adjoint=Unrolled() or Phantom(), or pass throw=False to receive NaN gradients instead "
    "of this error."
)


@eqx.filter_custom_vjp
def _implicit_identity(vjp_arg, value, adjoint, throw, secant=None):
    del vjp_arg, adjoint, throw, secant
    return value


@_implicit_identity.def_fwd
def _implicit_fwd(perturbed, vjp_arg, value, adjoint, throw, secant=None):
    del perturbed, vjp_arg, adjoint, throw, secant
    return value, None


@_implicit_identity.def_bwd
def _implicit_bwd(residuals, g_value, perturbed, vjp_arg, value, adjoint, throw, secant=None):
    del residuals
    # the backward solve's own products at the forward solver's precision
    with matmul_precision(vjp_arg[0].precision):
        return _implicit_bwd_traced(g_value, perturbed, vjp_arg, value, adjoint, throw, secant)


def _implicit_bwd_traced(g_value, perturbed, vjp_arg, value, adjoint, throw, secant):
    prob = vjp_arg[0]
    # Only the leaves being differentiated get a cotangent (skips, e.g., a fixed J).
    diff, static = eqx.partition(vjp_arg[:2], perturbed[:2])

    def fn_of(d, x):
        p, a = eqx.combine(d, static)
        return p.fn(x, a)

    # one linearisation at the solution serves the backward solve's products (where the
    # parameters' cotangent is unused and compiled away) and the final parameter product
    _, vjp = jax.vjp(fn_of, diff, value)
    b = g_value if isinstance(prob, _FixedPointProblem) else -g_value
    w, ok, steps, rel, fell_back = adjoint.solve_transpose(
        prob, jax.tree_util.Partial(lambda f, v: f(v)[1], vjp), b,
        point=(value, jax.lax.stop_gradient(vjp_arg[1])), secant=secant)
    if throw:
        w = eqx.error_if(w, ~ok, _BACKWARD_MSG)
    else:
        w = jnp.where(ok, w, jnp.nan)
    g_diff = vjp(w)[0]
    record = None
    if perturbed[2]:  # the probe: (1 solve, its products, its relative residual, fallback)
        dt = vjp_arg[2].dtype
        record = jnp.stack([jnp.ones((), dt), steps.astype(dt), rel.astype(dt),
                            fell_back.astype(dt)])
    return (*g_diff, record)


class Shine(AbstractAdjoint):
    r"""SHINE (Ramzi, Mannel, Bauschke, Ciuciu, Starck & Moreau, "SHINE: SHaring the INverse
    Estimate from the forward pass for bi-level optimization and implicit models", ICLR
    2022): the implicit gradient with the adjoint system's inverse taken from the forward
    solver instead of solved for, w = M ḡ with M ≈ (I − ∂g/∂x)⁻ᵀ (fixed point) or
    −(∂F/∂x)⁻ᵀ (root), built from the inverse-Jacobian estimate H the secant solvers keep:
    `Broyden`'s own, or `Anderson`'s multisecant one (`Anderson.inverse_jacobian_t`). No
    product with the Jacobian is taken: the backward pass costs one vector–Jacobian product
    with respect to the parameters, as `OneStep`'s, and memory holds the secant history
    until the backward pass. With no history (a solve that converged at its start) the
    estimate is H = −I and the gradient is `OneStep`'s.

    How good the gradient is depends on how much of the Jacobian the history saw: H is exact
    on the directions the iterates moved along and −I elsewhere. It is an approximation with
    no tolerance and no failure report; `Implicit(precondition=True)` uses the same estimate
    as the start and preconditioner of an exact solve. The forward pass is the same as
    `Implicit`'s. Forward solvers: `Anderson` or `Broyden`.
    """

    def attach(self, prob, args, run_loop, throw):
        (value, secant), stats = run_loop(_stop(prob), _stop(args), differentiable=False,
                                          secant=True)
        value = _implicit_identity((prob, args, None), value, _stop(self), throw, secant)
        return value, stats

    def solve_transpose(self, prob, vjp_x, b, point=None, secant=None):
        """`(M b, True, 0 products, NaN residual (not measured), no fallback)`."""
        del vjp_x, point
        w = _inverse_estimate(isinstance(prob, _FixedPointProblem), secant, b)
        return (w, jnp.ones((), bool), jnp.zeros((), jnp.int32),
                jnp.full((), jnp.nan, b.dtype), jnp.zeros((), bool))


class Phantom(AbstractAdjoint):
    """Phantom gradients (Geng et al., "On Training Implicit Models", NeurIPS 2021):
    backpropagate through `steps` damped steps x ← damping·x + (1 − damping)·g(x) started at
    the (gradient-stopped) solution.

    **Arguments:**

    - `steps`: the damped steps backpropagated (≥ 1).
    - `damping`: in [0, 1), the fraction of the old iterate kept, as for every solver (0 is
      the undamped map; the paper's λ is 1 − damping).

    The forward value is exactly the solved `x*`; only the gradient is approximate. Cheap and
    memory-light; the error shrinks as `steps` grows for a contractive map. Fixed points only.
    """

    steps: int = 5
    damping: float = 0.5

    def __check_init__(self):
        if not (isinstance(self.steps, int) and self.steps >= 1):
            raise ValueError(f"Phantom(steps={self.steps!r}) must be an int >= 1.")
        _check_damping("Phantom", self.damping)

    def attach(self, prob, args, run_loop, throw):
        if not isinstance(prob, _FixedPointProblem):
            raise ValueError("Phantom gradients are defined for fixed_point only.")
        value, stats = run_loop(_stop(prob), _stop(args), differentiable=False)
        y = jax.lax.stop_gradient(value)
        for _ in range(self.steps):
            y = self.damping * y + (1.0 - self.damping) * prob.fn(y, args)
        return value + (y - jax.lax.stop_gradient(y)), stats


class OneStep(AbstractAdjoint):
    """Jacobian-free backprop (Fung et al., "JFB: Jacobian-Free Backpropagation for Implicit
    Networks", AAAI 2022): the gradient of one application of the map
    at the solution, `∂g(x*, θ)/∂θ`, i.e. `(I − ∂g/∂x)⁻¹` replaced by `I`. Fixed points only.
    """

    def attach(self, prob, args, run_loop, throw):
        if not isinstance(prob, _FixedPointProblem):
            raise ValueError("OneStep gradients are defined for fixed_point only.")
        value, stats = run_loop(_stop(prob), _stop(args), differentiable=False)
        y = prob.fn(jax.lax.stop_gradient(value), args)
        return value + (y - jax.lax.stop_gradient(y)), stats


def _flat_map(fn, x, args):
    """`(x_flat, f_flat)` with f_flat(v) = ravel(fn(unravel(v), args)) on one flat vector."""
    x_flat, unravel = ravel_pytree(x)

    def f_flat(v):
        return ravel_pytree(fn(unravel(v), args))[0]

    return x_flat, f_flat


def jacobian_penalty(
    fn: Callable, x, args=None, *, key, num_samples: int = 1
) -> jax.Array:
    """Hutchinson estimate of ‖∂fn/∂x‖_F² at `x`, for Jacobian regularisation of DEQs.

    Uses E_ε‖εᵀ ∂fn/∂x‖² = ‖∂fn/∂x‖_F² with ε ~ N(0, I), averaged over `num_samples`
    vector–Jacobian products. Differentiable with respect to `x`, `args` and closed-over
    parameters.

    **Arguments:** `fn(x, args) -> pytree like x`; `x` any pytree of floating arrays; `key` a
    PRNG key. **Returns:** a scalar.
    """
    if not (isinstance(num_samples, int) and num_samples >= 1):
        raise ValueError(f"num_samples={num_samples!r} must be an int >= 1.")
    x_flat, f_flat = _flat_map(fn, x, args)
    out, vjp = jax.vjp(f_flat, x_flat)
    eps = jax.random.normal(key, (num_samples,) + out.shape, out.dtype)
    rows = jax.vmap(lambda e: vjp(e)[0])(eps)
    return jnp.mean(jnp.sum(rows**2, axis=-1))


def spectral_radius(
    fn: Callable, x, args=None, *, key, steps: int = 100
) -> jax.Array:
    """Estimate the spectral radius of ∂fn/∂x at `x`: whether a fixed point attracts.

    A fixed point `x* = fn(x*)` is stable (plain iteration converges to it) when the spectral
    radius ρ of the Jacobian is below 1. Anderson, Broyden and Newton also converge to
    unstable fixed points (ρ > 1) — e.g. the paramagnetic TAP solution below the critical
    temperature — so checking ρ tells which one was found. Uses Gelfand's formula
    ρ ≈ ‖Aᵏv‖^{1/k} with k = `steps` Jacobian–vector products (jvp; never the Jacobian),
    which converges for any matrix, including complex-conjugate dominant eigenvalues.

    **Arguments:** `fn(x, args) -> pytree like x`; `x` any pytree of floating arrays; `key` a
    PRNG key for the start vector. **Returns:** a scalar estimate of ρ.
    """
    if not (isinstance(steps, int) and steps >= 1):
        raise ValueError(f"steps={steps!r} must be an int >= 1.")
    x_flat, f_flat = _flat_map(fn, x, args)
    _, jvp = jax.linearize(f_flat, x_flat)
    v = jax.random.normal(key, x_flat.shape, x_flat.dtype)
    v = v / l2_norm(v)

    def body(_, carry):
        v, log_growth = carry
        w = jvp(v)
        nw = l2_norm(w)
        return w / jnp.where(nw > 0, nw, 1.0), log_growth + jnp.log(nw)

    _, log_growth = jax.lax.fori_loop(0, steps, body, (v, jnp.zeros((), x_flat.dtype)))
    return jnp.exp(log_growth / steps)
