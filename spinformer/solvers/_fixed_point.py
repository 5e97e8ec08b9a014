"""`fixed_point` and `root_find`: the driver shared by every solver and adjoint."""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import sys
from typing import Any, Callable, Optional, Union

import equinox as eqx
import equinox.internal as eqxi
import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree
from jaxtyping import Array, Bool, Float, Int, PyTree

from ._adjoint import AbstractAdjoint, Implicit, OneStep, Phantom, Shine, _fallback_as_set
from ._lanes import while_lanes
from ._linear import Auto
from ._reversible import Reversible, ReversibleAdjoint
from ._results import _CODES, RESULTS, Solution, backward_error_if
from ._solvers import (
    AbstractFixedPointSolver,
    AbstractRootFinder,
    AbstractSolver,
    Anderson,
    Newton,
    _BestSoFar,
    _BestState,
    _FixedPointProblem,
    _RootProblem,
    batched_like,
    matmul_precision,
)


def check_solver(solver, adjoint, *, root: bool = False, where: str = "") -> None:
    """Raise `ValueError` unless `solver` and `adjoint` can solve and differentiate a fixed
    point together (`root=True`: a root F(x) = 0, which needs a root finder and an adjoint
    that differentiates roots: `Implicit()` or `Unrolled()`); `where` leads the message.
    `fixed_point` and `root_find` call it; a config section calls it to refuse a bad pair
    when it is read."""
    lead = f"{where}: " if where else ""
    if not isinstance(solver, AbstractRootFinder if root else
                      (AbstractFixedPointSolver, AbstractRootFinder)):
        if isinstance(solver, AbstractSolver):
            raise ValueError(
                f"{lead}{type(solver).__name__} iterates a map x = g(x), not a root "
                "F(x) = 0. Use solver=Newton() or Broyden(), or write the problem as a fixed "
                "point and call fixed_point."
            )
        raise ValueError(
            f"{lead}`solver` must be a spinformer solver such as Anderson() or Newton(); "
            f"got {solver!r}."
        )
    if not isinstance(adjoint, AbstractAdjoint):
        raise ValueError(
            f"{lead}`adjoint` must be one of Implicit(), Shine(), Unrolled(), Phantom(), "
            f"OneStep(), ReversibleAdjoint(); got {adjoint!r}."
        )
    if root and isinstance(adjoint, (Phantom, OneStep, ReversibleAdjoint)):
        raise ValueError(
            f"{lead}{type(adjoint).__name__}() differentiates fixed points only; a root "
            "takes Implicit(), Shine() or Unrolled()."
        )
    if (isinstance(adjoint, Shine) or getattr(adjoint, "precondition", False)) and (
            type(solver).inverse_jacobian_t is AbstractSolver.inverse_jacobian_t):
        what = ("Shine()" if isinstance(adjoint, Shine) else "Implicit(precondition=True)")
        raise ValueError(
            f"{lead}adjoint={what} reuses the forward solver's estimate of the inverse "
            f"Jacobian, which solver=Anderson() and Broyden() keep and "
            f"{type(solver).__name__}() does not. Use one of those, or adjoint=Implicit().")
    if isinstance(adjoint, ReversibleAdjoint) and not isinstance(solver, Reversible):
        raise ValueError(
            f"{lead}adjoint=ReversibleAdjoint() runs the steps of solver=Reversible() "
            f"backwards and fits no other solver; got solver={type(solver).__name__}(). Use "
            "solver=Reversible(damping=...), or another adjoint (Implicit(), Unrolled())."
        )


# where the guide compares the call with optimistix's, jaxopt's and banax's
_COMING_FROM = ("docs/guides/solvers.md, \"Coming from optimistix, jaxopt or banax\"")

# keywords of other libraries' calls, and where spinformer keeps what they say
_KEYWORD_HINTS = {
    "max_steps": "the step budget is a field of the solver: solver=Anderson(max_steps=...) "
                 "(a run-time cap without recompiling: step_budget=)",
    "maxiter": "the step budget is a field of the solver: solver=Anderson(max_steps=...)",
    "tol": "the tolerance is a field of the solver: solver=Anderson(tol=...), an absolute "
           "bound on the residual in the solver's norm",
    "rtol": "a forward solver stops on one absolute tolerance, ||fn(x) - x|| <= tol in its "
            "norm: solver=Anderson(tol=..., norm=solvers.l2_norm) (rtol is the implicit "
            "adjoint's, for the backward solve: adjoint=Implicit(rtol=...))",
    "y0": "the initial guess is the second argument, x0: fixed_point(fn, x0, args, "
          "solver=...)",
    "init_params": "the initial guess is the second argument, x0: fixed_point(fn, x0, args, "
                   "solver=...)",
    "implicit_diff": "how gradients flow is an object: adjoint=solvers.Implicit() (the "
                     "default) or adjoint=solvers.Unrolled()",
    "options": "settings are fields of the solver and adjoint objects; there is no options "
               "dict",
}
_KEYWORD_HINTS["atol"] = _KEYWORD_HINTS["rtol"]


def _explain_bad_calls(f):
    """`f` unchanged, except that a call its signature cannot take (too many positional
    arguments, an unknown keyword) raises a `TypeError` that says where spinformer keeps what
    the caller meant, for the spellings of optimistix, jaxopt and banax. Free on a good
    call: the signature is bound only after a `TypeError`."""
    sig = inspect.signature(f)

    @functools.wraps(f)
    def call(*args, **kwargs):
        try:
            return f(*args, **kwargs)
        except TypeError as e:
            try:
                sig.bind(*args, **kwargs)
            except TypeError:
                hints = list(dict.fromkeys(_KEYWORD_HINTS[k] for k in kwargs
                                           if k in _KEYWORD_HINTS))
                if len(args) > 3 or (len(args) > 1 and isinstance(args[1], AbstractSolver)):
                    hints.insert(0, f"the call is {f.__name__}(fn, x0, args, solver=..., "
                                 "adjoint=...): the solver is a keyword, after the initial "
                                 "guess x0")
                hints.append(f"see {_COMING_FROM}")
                raise TypeError(f"{e}: " + "; ".join(hints) + ".") from None
            raise

    return call


def _check_inputs(name, fn, x0, args, solver, adjoint, root, has_aux=False):
    if not callable(fn):
        raise ValueError(f"{name}: `fn` must be callable as fn(x, args); got {type(fn).__name__}.")
    if isinstance(x0, (AbstractSolver, AbstractAdjoint)):
        raise ValueError(
            f"{name}: x0 is {type(x0).__name__}(...), a solver object; the initial guess "
            f"comes second and the solver is a keyword: {name}(fn, x0, args, solver=...) "
            f"(see {_COMING_FROM}).")
    check_solver(solver, adjoint, root=root, where=name)
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
        out = eqx.filter_eval_shape(fn, x0, args)
    except Exception as e:  # shape errors inside fn: say where they came from
        raise ValueError(f"{name}: calling fn(x0, args) failed: {e}") from e
    if has_aux:
        if not (isinstance(out, tuple) and len(out) == 2):
            raise ValueError(f"{name}: with has_aux=True, fn(x, args) must return a pair "
                             f"(new x, aux); it returned {jax.tree.structure(out)}.")
        out = out[0]
    in_struct = jax.tree.structure(x0)
    out_struct = jax.tree.structure(out)
    if in_struct != out_struct:
        pair = (not has_aux and isinstance(out, tuple) and len(out) == 2
                and jax.tree.structure(out[0]) == in_struct)
        raise ValueError(
            f"{name}: fn(x, args) must return a pytree with the structure of x0.\n"
            f"  x0:     {in_struct}\n  fn out: {out_struct}"
            + ("\n  It returns a pair (x, aux): pass has_aux=True." if pair else "")
        )
    for i, (a, b) in enumerate(zip(leaves, jax.tree.leaves(out))):
        a_shape, a_dt = jnp.shape(a), jnp.result_type(a)
        if a_shape != b.shape or a_dt != b.dtype:
            raise ValueError(
                f"{name}: leaf {i} of fn(x, args) has shape {b.shape} and dtype {b.dtype}, "
                f"but x0's leaf has shape {a_shape} and dtype {a_dt}; they must match."
            )


# ----------------------------------------------------------------------------- the loop


class _Carry(eqx.Module):
    """What the solve loop carries from one step to the next."""

    state: _BestState  # the solver's own state and the best iterate so far
    steps: Int[Array, ""]  # steps taken
    trace: Optional[Float[Array, " T"]]  # `trace=True`: the residual after each step


class _Loop(eqx.Module):
    """One solve's stopping test and step, and everything they read besides the carry (a
    module, so that `while_lanes` can gather its arrays)."""

    best: _BestSoFar
    prob: Any
    args: Any
    limit: Int[Array, ""]  # `max_steps`, or a smaller run-time `step_budget`
    name: str = eqx.field(static=True)
    verbose: bool = eqx.field(static=True)

    def going(self, carry: _Carry) -> Bool[Array, ""]:
        """Whether to take another step: the solver has not stopped and steps remain."""
        done, _ = self.best.terminate(carry.state)
        return ~done & (carry.steps < self.limit)

    def step(self, carry: _Carry) -> _Carry:
        state = self.best.step(self.prob, carry.state, self.args)
        steps = carry.steps + 1
        if self.verbose:
            steps = steps + _report(self.name, self.best, state, steps)
        trace = carry.trace
        if trace is not None:  # the residual of the newest iterate after `steps` steps
            trace = trace.at[steps].set(self.best.best(state)[2])
        return _Carry(state, steps, trace)


def _report(name, best, state, steps):
    """`verbose=True`: print a progress line on the host. `pure_callback` with `expand_dims`
    sees every example of a vmapped solve at once; its output, zero, is added to the step
    counter so that the call is not dropped as dead code."""
    _, rnorm, _ = best.best(state)
    done, code = best.terminate(state)
    return jax.pure_callback(
        lambda *a: _print_progress(name, *a), jax.ShapeDtypeStruct((), jnp.int32),
        steps, rnorm, done & (code == RESULTS.successful), vmap_method="expand_dims")


def _print_progress(name, step, rnorm, converged):
    """Host side of `verbose=True`: one line per step over every example of a vmapped solve."""
    step, rnorm, converged = (np.asarray(a) for a in (step, rnorm, converged))
    worst = float(np.max(np.where(np.isfinite(rnorm), rnorm, np.inf)))
    print(
        f"{name}: step {int(np.max(step))}  worst residual {worst:.3e}  "
        f"converged {int(np.sum(converged))}/{converged.size}",
        file=sys.stderr,
        flush=True,
    )
    return np.zeros(np.shape(step), np.int32)


# The loop strategies: `(loop, init, max_steps) -> final carry`, chosen by `_strategy`.


def _unrolled(loop: _Loop, init: _Carry, max_steps: int) -> _Carry:
    """`max_steps` steps as straight-line code, no while loop (`solver.unroll`); a stopped
    example keeps its carry."""
    carry = init
    for _ in range(max_steps):
        go = loop.going(carry)
        carry = jax.tree.map(lambda new, old: jnp.where(go, new, old), loop.step(carry), carry)
    return carry


def _checkpointed(loop: _Loop, init: _Carry, max_steps: int) -> _Carry:
    """A while loop that reverse mode differentiates (`Unrolled`): its carries kept at about
    √(2·max_steps) checkpoints and recomputed in the backward pass."""
    return eqxi.while_loop(lambda c: loop.going(c), lambda c: loop.step(c), init,
                           max_steps=max_steps, kind="checkpointed")


def _plain(loop: _Loop, init: _Carry, max_steps: int) -> _Carry:
    """`jax.lax.while_loop`: under `vmap` every example steps until the last one stops. One
    copy of the step is compiled."""
    del max_steps
    return jax.lax.while_loop(lambda c: loop.going(c), lambda c: loop.step(c), init)


def _compacting(loop: _Loop, init: _Carry, max_steps: int) -> _Carry:
    """A while loop in which, under `vmap`, the stopped examples stop costing
    (`while_lanes`); it compiles one copy of the step per level (log2 of the systems)."""
    del max_steps
    return while_lanes(_Loop.going, _Loop.step, loop, init)


# The step cap from which a vmapped solve compacts its finished systems. Compaction saves the
# steps a batch's slowest system takes beyond the others, and costs a compiled copy of the
# step per level. Under a cap of 30 the tail is short: on the quickstart's trained model
# (Anderson, cap 30, 64 systems: 5.3 steps on average) it made the training step 2.6 % faster
# and took 13 s more to compile, which 1500 steps do not pay back. Picard's linear
# convergence, with caps of 50-100, leaves long tails (modern Hopfield on characters: 21 on
# average, 73 at most), where it halved the forward pass (docs/results/cost.md) for 17 s
# more compilation of the training step.
COMPACT_FROM_STEPS = 50

# Set by `plain_loops()`: no compaction in the solves traced meanwhile.
_PLAIN_LOOPS = contextvars.ContextVar("plain_loops", default=False)


@contextlib.contextmanager
def plain_loops():
    """While active, the solves traced run plain batched loops, never compacting: for
    programs called too few times to pay back compaction's compilation (the evaluation step,
    `train.evaluate`: on modern Hopfield's characters cell it took 27 s to compile with
    compaction and 7 s without). It decides how a solve is traced, so it must surround the
    first call of a jitted function, and a function traced once keeps its loops."""
    token = _PLAIN_LOOPS.set(True)
    try:
        yield
    finally:
        _PLAIN_LOOPS.reset(token)


# Set by `cut_solves(k)`: every solve traced meanwhile stops after k steps.
_CUT_SOLVES = contextvars.ContextVar("cut_solves", default=None)


@contextlib.contextmanager
def cut_solves(steps: int):
    """While active, every fixed-point and root solve traced stops after `steps` iterations
    of its own solver (0: the starting point itself; the best iterate so far, as always) and
    reports success, never raising, so that a layer uses the value as it would a converged
    one (a layer that zeroes a failed solve's output would otherwise hide it): for asking
    whether a trained model's solves matter (`spinformer.train.solver_effect`), not for
    training. Like `plain_loops` it acts when a solve is traced, so it must surround the
    first trace of a function (a fresh `jax.jit`); one traced before keeps its solves.

    `steps` may be a 0-d integer array, traced inside the function (an argument of the
    jitted function): then one compiled program serves every cut (`train.evaluate`'s
    `cut_solves` is such an argument)."""
    if isinstance(steps, jax.Array) and not isinstance(steps, bool):
        if steps.shape != () or not jnp.issubdtype(steps.dtype, jnp.integer):
            raise ValueError(f"cut_solves(steps={steps!r}): an array of steps must be a 0-d "
                             "integer array.")
    elif isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise ValueError(f"cut_solves(steps={steps!r}): steps must be an int >= 0.")
    token = _CUT_SOLVES.set(steps)
    try:
        yield
    finally:
        _CUT_SOLVES.reset(token)


def _strategy(solver: AbstractSolver, differentiable: bool, plain: bool):
    """The loop that runs a solve: straight-line code (`unroll`), a loop reverse mode can
    differentiate (`differentiable`), a compacting loop for a step cap of at least
    `COMPACT_FROM_STEPS`, else (or with `plain`: under `plain_loops()`, or `verbose`, whose
    progress line counts every example at every step) a plain loop."""
    if solver.unroll:
        return _unrolled
    if differentiable:
        return _checkpointed
    if plain or solver.max_steps < COMPACT_FROM_STEPS:
        return _plain
    return _compacting


def _run_loop(prob, args, *, differentiable: bool, last: bool = False, secant: bool = False,
              solver, x0, budget, throw, verbose, trace, name, plain=False):
    """Solve `prob` from `x0`: `(x, (num_steps, residual at x, residual at the last iterate,
    result, trace or None))`, x the best iterate. `_solve_traced` binds the keywords after
    `last`; an adjoint calls the rest and attaches gradients to `x`.

    `differentiable=True`: a loop reverse mode can differentiate (`Unrolled`).
    `last=True`: `x` is `(solver, its own state after the last step)` instead, with the
    residual of that last iterate, for an adjoint that continues from the solver's state
    (`ReversibleAdjoint`).
    `secant=True`: `x` is `(x, the solver's inverse_jacobian_t at its last state)`, for an
    adjoint that reuses the forward solver's estimate (`Shine`, `Implicit(precondition=True)`).

    The solver's `terminate` alone decides whether the solve converged. With `throw`, the
    failure check is attached to `x` here, before any adjoint sees it; `backward_error_if`
    repeats it in the backward pass.
    """
    best = _BestSoFar(solver)
    max_steps = solver.max_steps
    limit = jnp.asarray(max_steps if budget is None else jnp.minimum(budget, max_steps))
    loop = _Loop(best, prob, args, limit, name, verbose)
    state = best.init(prob, x0, args)
    r0 = best.best(state)[2]
    history = (jnp.full((max_steps + 1,), jnp.nan, r0.dtype).at[0].set(r0) if trace
               else None)
    # (tied to r0: fewer passes of while_loop's batching rule, see `batched_like`)
    init = batched_like(_Carry(state, jnp.asarray(0, jnp.int32), history), r0)
    out = _strategy(solver, differentiable, plain or verbose)(loop, init, max_steps)

    done, code = best.terminate(out.state)
    result = jnp.where(done, code, RESULTS.max_steps_reached).astype(jnp.int32)
    if last:
        x = out.state.inner
        rn = rn_last = solver.output(x)[1]
    else:
        x, rn, rn_last = best.best(out.state)
    if throw:
        x = eqx.branched_error_if(x, result != RESULTS.successful, result,
                                  _failure_messages(name))
    history = None if out.trace is None else jax.lax.stop_gradient(out.trace)
    stats = (out.steps, jax.lax.stop_gradient(rn), jax.lax.stop_gradient(rn_last), result,
             history)
    if secant:
        x = (x, jax.lax.stop_gradient(solver.inverse_jacobian_t(out.state.inner)))
    return ((solver, x) if last else x), stats


def _failure_messages(name):
    return [f"{name}: " + RESULTS.message(c) if c else "" for c in range(len(_CODES))]


def _as_array_scalars(args):
    """Python floats and complex numbers in `args` become 0-d arrays, so a solve closed over
    at a float (`fixed_point(fn, x0, 1.0)`) and differentiated (where it becomes a tracer)
    sees the same structure. Ints and bools stay Python values (they may be shapes or flags).
    """

    def conv(a):
        if isinstance(a, (float, complex)) and not isinstance(a, bool):
            return jnp.asarray(a)
        return a

    return jax.tree.map(conv, args)


def _as_array_leaves(x0):
    """The initial guess with Python and NumPy numbers as JAX arrays (`root_find(fn, 0.0)`),
    so `fn(x0)` returns arrays whose shapes and dtypes can be compared with x0's."""
    return jax.tree.map(lambda a: a if isinstance(a, jax.Array) else jnp.asarray(a), x0)


def _check_budget(name, step_budget):
    """`step_budget` as an int32 array (a run-time value: changing it does not recompile)."""
    if step_budget is None:
        return None
    b = jnp.asarray(step_budget)
    if b.shape != () or not jnp.issubdtype(b.dtype, jnp.integer):
        raise ValueError(f"{name}: step_budget must be an integer scalar (a Python int or a "
                         f"0-d integer array); got {step_budget!r}.")
    if not isinstance(b, jax.core.Tracer) and int(b) < 0:
        raise ValueError(f"{name}: step_budget={int(b)} must be >= 0.")
    return b.astype(jnp.int32)


@eqx.filter_jit
def _solve(name, problem_cls, fn, x0, args, solver, adjoint, throw, verbose, budget=None,
           trace=False, plain=False):
    # Everything traced here (the map, the loop, the adjoint's forward part) uses the
    # solver's matrix-product precision; the map is traced once (closure conversion), so its
    # products keep it wherever the problem is evaluated, in the backward pass too.
    with matmul_precision(solver.precision):
        return _solve_traced(name, problem_cls, fn, x0, args, solver, adjoint, throw,
                             verbose, budget, trace, plain)


def _solve_traced(name, problem_cls, fn, x0, args, solver, adjoint, throw, verbose, budget,
                  trace, plain=False):
    x0_flat, unravel = ravel_pytree(x0)
    x0_flat = jax.lax.stop_gradient(x0_flat)

    def fn_flat(x, a):
        return ravel_pytree(fn(unravel(x), a))[0]

    # Closed-over arrays (e.g. model parameters captured by `fn`) become explicit leaves, so
    # the implicit adjoint can differentiate with respect to them.
    fn_conv = eqx.filter_closure_convert(fn_flat, x0_flat, args)
    prob = problem_cls(fn_conv, solver.precision)
    run_loop = functools.partial(_run_loop, solver=solver, x0=x0_flat, budget=budget,
                                 throw=throw, verbose=verbose, trace=trace, name=name,
                                 plain=plain)
    value, (k, rn, last, result, history) = adjoint.attach(prob, args, run_loop, throw)
    if throw:
        value = backward_error_if(value, result != RESULTS.successful, result,
                                  _failure_messages(name))
    return Solution(unravel(value), k, rn, last, result, history)


@_explain_bad_calls
def fixed_point(
    fn: Callable[[PyTree, Any], PyTree],
    x0: PyTree,
    args: Any = None,
    *,
    solver: Union[AbstractFixedPointSolver, AbstractRootFinder] = Anderson(),
    adjoint: AbstractAdjoint = Implicit(),
    throw: bool = True,
    verbose: bool = False,
    step_budget: Any = None,
    trace: bool = False,
    has_aux: bool = False,
) -> Solution:
    """Solve x = fn(x, args) for one problem (vmap for a batch).

    **Arguments:**

    - `fn`: the map, `fn(x, args) -> pytree with x's structure, shapes and dtypes`. Arrays it
      closes over are differentiated like `args`.
    - `x0`: initial guess, any pytree of floating arrays.
    - `args`: any pytree of arrays and Python scalars `fn` needs (gradients flow to its
      floating leaves).
    - `solver`: `Anderson()` (default), `Picard(damping)`, `Reversible(damping)`, or a root
      finder (`Broyden()`, `Newton()`) applied to fn(x) − x.
      The solver carries the stopping rule: `tol` (converged when ‖fn(x) − x‖ ≤ tol),
      `max_steps` and `norm`, e.g. `Anderson(tol=1e-6, max_steps=300, norm=solvers.l2_norm)`.
    - `adjoint`: how gradients are computed: `Implicit()` (default), `Shine()` (the
      forward's secant estimate of the inverse, no backward solve), `Unrolled()`,
      `Phantom(steps, damping)`, `OneStep()`, or `ReversibleAdjoint()` (with
      `solver=Reversible()` only: the iterations' gradients at constant memory, exact up to
      rounding errors that grow with the steps).
    - `throw`: raise (at run time, via `eqx.error_if`) if the solve fails; with `False` the
      failure is reported in `Solution.result` per example instead.
    - `verbose`: print one line per iteration to stderr: the step, the largest residual over
      the examples of a vmapped solve and how many have converged. Off by default, and then
      free (nothing is added to the compiled loop).
    - `step_budget`: at most this many iterations, a run-time integer (a Python int or a 0-d
      integer array, possibly traced): changing it does not recompile, unlike the solver's
      static `max_steps`, which stays the ceiling. A solve stopped by the budget reports
      `max_steps_reached`.
    - `trace`: also return the residual after every iteration, `Solution.trace`
      `(max_steps + 1,)` (index k: after k steps; NaN after the last), per example under
      `vmap`. Off by default, and then free.
    - `has_aux`: `fn` returns a pair `(new x, aux)`; the solve iterates the first, and
      `Solution.aux` is the second evaluated once more at the solution (one extra call of
      `fn`; gradients flow through it to `args` and, by the adjoint, through `value`).

    **Returns:** a `Solution(value, num_steps, residual, final_residual, result, trace,
    aux)`.

    Under `vmap` each example iterates until it converges and then stops changing; its
    statistics are its own. The call is compiled once per `fn`, solver, adjoint and input
    shapes (`eqx.filter_jit`), so eager calls with the same function do not recompile.
    """
    return _solve_with_aux("fixed_point", _FixedPointProblem, fn, x0, args, solver, adjoint,
                           throw, verbose, step_budget, trace, has_aux)


@_explain_bad_calls
def root_find(
    fn: Callable[[PyTree, Any], PyTree],
    x0: PyTree,
    args: Any = None,
    *,
    solver: AbstractRootFinder = Newton(),
    adjoint: AbstractAdjoint = Implicit(linear_solver=Auto()),
    throw: bool = True,
    verbose: bool = False,
    step_budget: Any = None,
    trace: bool = False,
    has_aux: bool = False,
) -> Solution:
    """Solve F(x, args) = 0 for one problem (vmap for a batch).

    As `fixed_point`, with `fn` the residual F (same structure as x) and `solver` a root
    finder, `Newton()` (default) or `Broyden()`. Gradients: `Implicit()` solves
    (∂F/∂x)ᵀ w = −ḡ, by default with `Auto()` (a dense solve up to 512 unknowns, else
    GMRES(50)): a root's Jacobian need not be near the identity, where the Richardson
    iteration of `Implicit()`'s own default diverges; `Unrolled()` backpropagates through the
    iterations.
    """
    return _solve_with_aux("root_find", _RootProblem, fn, x0, args, solver, adjoint, throw,
                           verbose, step_budget, trace, has_aux)


class _NewX(eqx.Module):
    """The iterated part of a map that returns `(new x, aux)` (a module, not a lambda: equal
    for the same `fn`, so that the compiled solve is reused)."""

    fn: Callable

    def __call__(self, x, args):
        return self.fn(x, args)[0]


def _solve_with_aux(name, problem_cls, fn, x0, args, solver, adjoint, throw, verbose,
                    step_budget, trace, has_aux):
    """Check the inputs, solve, and with `has_aux` evaluate the auxiliary output at the
    solution (outside the compiled solve: its loop iterates the new x alone)."""
    x0 = _as_array_leaves(x0)
    _check_inputs(name, fn, x0, args, solver, adjoint, problem_cls is _RootProblem, has_aux)
    args = _as_array_scalars(args)
    step = _NewX(fn) if has_aux else fn
    cut = _CUT_SOLVES.get()
    if cut is not None:  # `cut_solves`: at most `cut` steps, reported as a success
        step_budget = cut if step_budget is None else jnp.minimum(cut, step_budget)
        throw = False
    adjoint = _fallback_as_set(adjoint, throw)  # (`without_fallbacks`)
    sol = _solve(name, problem_cls, step, x0, args, solver, adjoint, throw, verbose,
                 _check_budget(name, step_budget), bool(trace), _PLAIN_LOOPS.get())
    if cut is not None:
        sol = eqx.tree_at(lambda s: s.result, sol, jnp.full_like(sol.result,
                                                                 RESULTS.successful))
    if not has_aux:
        return sol
    with matmul_precision(solver.precision):
        aux = fn(sol.value, args)[1]
    return eqx.tree_at(lambda s: s.aux, sol, aux, is_leaf=lambda v: v is None)
