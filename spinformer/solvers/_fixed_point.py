"""`fixed_point` and `root_find`: the drivers shared by every solver and adjoint."""

from __future__ import annotations

from typing import Any, Callable

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.flatten_util import ravel_pytree
from jaxtyping import PyTree

from ._adjoint import AbstractAdjoint, Implicit
from ._results import RESULTS, Solution
from ._solvers import _NORMS, AbstractSolver, Anderson, Newton, _Problem


def _check_inputs(name, fn, x0, args, solver, adjoint, tol, max_steps, norm):
    if not callable(fn):
        raise ValueError(f"{name}: `fn` must be callable as fn(x, args); got {type(fn).__name__}.")
    if not isinstance(solver, AbstractSolver):
        raise ValueError(
            f"{name}: `solver` must be a spinformer solver such as Anderson() or Picard(); "
            f"got {solver!r}."
        )
    if not isinstance(adjoint, AbstractAdjoint):
        raise ValueError(
            f"{name}: `adjoint` must be one of Implicit(), Unrolled(), Phantom(), OneStep(); "
            f"got {adjoint!r}."
        )
    if isinstance(tol, bool) or not isinstance(tol, (int, float)) or not tol >= 0:
        raise ValueError(f"{name}: tol={tol!r} must be a non-negative number.")
    if isinstance(max_steps, bool) or not isinstance(max_steps, int) or max_steps < 1:
        raise ValueError(f"{name}: max_steps={max_steps!r} must be an int >= 1.")
    if norm not in _NORMS:
        raise ValueError(f"{name}: norm={norm!r}; choose one of {sorted(_NORMS)}.")
    leaves = jax.tree.leaves(x0)
    if not leaves:
        raise ValueError(f"{name}: x0 has no array leaves; pass the initial guess as arrays.")
    for leaf in leaves:
        dt = jnp.result_type(leaf)
        if not jnp.issubdtype(dt, jnp.floating):
            raise ValueError(
                f"{name}: every leaf of x0 must be a real floating array, found dtype {dt}. "
                "Convert the initial guess with jnp.asarray(x0, jnp.float32)."
            )
    try:
        out = jax.eval_shape(fn, x0, args)
    except Exception as e:  # shape errors inside fn: say where they came from
        raise ValueError(f"{name}: calling fn(x0, args) failed: {e}") from e
    in_struct = jax.tree.structure(x0)
    out_struct = jax.tree.structure(out)
    if in_struct != out_struct:
        raise ValueError(
            f"{name}: fn(x, args) must return a pytree with the structure of x0.\n"
            f"  x0:     {in_struct}\n  fn out: {out_struct}"
        )
    for i, (a, b) in enumerate(zip(leaves, jax.tree.leaves(out))):
        a_shape, a_dt = jnp.shape(a), jnp.result_type(a)
        if a_shape != b.shape or a_dt != b.dtype:
            raise ValueError(
                f"{name}: leaf {i} of fn(x, args) has shape {b.shape} and dtype {b.dtype}, "
                f"but x0's leaf has shape {a_shape} and dtype {a_dt}; they must match."
            )


def _make_loop(solver, tol, max_steps, throw, name):
    """Returns run_loop(prob, args, differentiable) -> (x, (num_steps, residual, result)).

    With `throw`, the failure check is attached to `x` here, before any adjoint sees it;
    `_checked_gradient` repeats it in the backward pass.
    """

    def run_loop(prob, args, *, differentiable, x0):
        def status(state):
            x, rn, nonfinite = solver.output(state)
            return x, rn, nonfinite

        state0 = solver.init(prob, x0, args)
        _, rn0, nf0 = status(state0)
        dtype = rn0.dtype
        tol_ = jnp.asarray(tol, dtype)

        def done(state, k):
            _, rn, nf = status(state)
            return (rn <= tol_) | nf | (k >= max_steps)

        if differentiable:

            def body(carry, _):
                state, k = carry
                stop = done(state, k)
                state = jax.lax.cond(
                    stop, lambda s: s, lambda s: solver.step(prob, s, args), state
                )
                return (state, jnp.where(stop, k, k + 1)), None

            (state, k), _ = jax.lax.scan(
                body, (state0, jnp.asarray(0, jnp.int32)), None, length=max_steps
            )
        else:
            def cond(carry):
                state, k = carry
                return ~done(state, k)

            def body(carry):
                state, k = carry
                return solver.step(prob, state, args), k + 1

            state, k = jax.lax.while_loop(
                cond, body, (state0, jnp.asarray(0, jnp.int32))
            )
        x, rn, nf = status(state)
        result = jnp.where(
            rn <= tol_,
            RESULTS.successful,
            jnp.where(nf, RESULTS.nonfinite, RESULTS.max_steps_reached),
        ).astype(jnp.int32)
        if throw:
            x = eqx.branched_error_if(
                x, result != RESULTS.successful, result, _failure_messages(name)
            )
        return x, (k, jax.lax.stop_gradient(rn), result)

    return run_loop


def _failure_messages(name):
    return [
        f"{name}: " + RESULTS.message(c) if c else ""
        for c in (RESULTS.successful, RESULTS.max_steps_reached, RESULTS.nonfinite)
    ]


@eqx.filter_custom_vjp
def _checked_gradient(value, result, name):
    del result, name
    return value


@_checked_gradient.def_fwd
def _checked_gradient_fwd(perturbed, value, result, name):
    del perturbed, result, name
    return value, None


@_checked_gradient.def_bwd
def _checked_gradient_bwd(residuals, g, perturbed, value, result, name):
    # Raised in the backward pass itself: a forward check whose output only the (discarded)
    # primal uses is removed as dead code under `jit(grad(...))`.
    del residuals, perturbed, value
    return eqx.branched_error_if(g, result != RESULTS.successful, result, _failure_messages(name))


def _solve(name, kind, fn, x0, args, solver, adjoint, tol, max_steps, throw, norm):
    _check_inputs(name, fn, x0, args, solver, adjoint, tol, max_steps, norm)
    x0_flat, unravel = ravel_pytree(x0)
    x0_flat = jax.lax.stop_gradient(x0_flat)

    def fn_flat(x, a):
        return ravel_pytree(fn(unravel(x), a))[0]

    # Closed-over arrays (e.g. model parameters captured by `fn`) become explicit leaves, so
    # the implicit adjoint can differentiate with respect to them.
    fn_conv = eqx.filter_closure_convert(fn_flat, x0_flat, args)
    prob = _Problem(fn_conv, kind, _NORMS[norm])
    loop = _make_loop(solver, tol, max_steps, throw, name)

    def run_loop(p, a, *, differentiable):
        return loop(p, a, differentiable=differentiable, x0=x0_flat)

    value, (k, rn, result) = adjoint.attach(prob, args, run_loop, throw)
    if throw:
        value = _checked_gradient(value, result, name)
    return Solution(unravel(value), k, rn, result)


def fixed_point(
    fn: Callable[[PyTree, Any], PyTree],
    x0: PyTree,
    args: Any = None,
    *,
    solver: AbstractSolver = Anderson(),
    adjoint: AbstractAdjoint = Implicit(),
    tol: float = 1e-5,
    max_steps: int = 100,
    throw: bool = True,
    norm: str = "inf",
) -> Solution:
    """Solve x = fn(x, args) for one problem (vmap for a batch).

    **Arguments:**

    - `fn`: the map, `fn(x, args) -> pytree with x's structure, shapes and dtypes`. Arrays it
      closes over are differentiated like `args`.
    - `x0`: initial guess, any pytree of floating arrays.
    - `args`: anything `fn` needs (gradients flow to its floating arrays).
    - `solver`: `Anderson()` (default), `Picard(damping)`, `Broyden()`, `Newton()` or the
      reference `JaxoptAnderson()`.
    - `adjoint`: how gradients are computed: `Implicit()` (default), `Unrolled()`,
      `Phantom(steps, damping)`, `OneStep()`.
    - `tol`: converged when ‖fn(x) − x‖ ≤ tol.
    - `max_steps`: most iterations after the first evaluation.
    - `throw`: raise (at run time, via `eqx.error_if`) if the solve fails; with `False` the
      failure is reported in `Solution.result` per example instead.
    - `norm`: `"inf"` (default) or `"l2"`, the norm of the residual.

    **Returns:** a `Solution(value, num_steps, residual, result)`.

    Under `vmap` each example iterates until it converges and then stops changing; its
    `num_steps`, `residual` and `result` are its own.
    """
    return _solve(
        "fixed_point", "fixed_point", fn, x0, args, solver, adjoint, tol, max_steps, throw, norm
    )


def root_find(
    fn: Callable[[PyTree, Any], PyTree],
    x0: PyTree,
    args: Any = None,
    *,
    solver: AbstractSolver = Newton(),
    adjoint: AbstractAdjoint = Implicit(),
    tol: float = 1e-5,
    max_steps: int = 100,
    throw: bool = True,
    norm: str = "inf",
) -> Solution:
    """Solve F(x, args) = 0 for one problem (vmap for a batch).

    As `fixed_point`, with `fn` the residual F (same structure as x) and `solver` one of
    `Newton()` (default) or `Broyden()`. Gradients: `Implicit()` solves (∂F/∂x)ᵀ w = −ḡ;
    `Unrolled()` backpropagates through the iterations.
    """
    if isinstance(solver, AbstractSolver) and not type(solver).supports_root:
        raise ValueError(
            f"root_find: {type(solver).__name__} iterates a map x = g(x), not a root F(x) = 0. "
            "Use solver=Newton() or Broyden(), or write the problem as a fixed point and call "
            "fixed_point."
        )
    return _solve("root_find", "root", fn, x0, args, solver, adjoint, tol, max_steps, throw, norm)
