"""The reversible fixed-point iteration and its adjoint: exact gradients of the iterations
taken, at memory that does not depend on how many were taken.

After McCallum, Arora & Foster, "Reversible Deep Equilibrium Models", arXiv:2509.12917
(2025), and the authors' JAX code (github.com/sammccallum/reversible-deq). Two iterates are
coupled so that every step can be undone algebraically: the backward pass rebuilds the
trajectory from its end, one step at a time, and backpropagates through each step as it
goes, so nothing of the forward trajectory is stored.

What was checked against the source (the abstract, secondary summaries of the paper's
equations, and the reference code; the derivations below were redone here):

- The forward step, the inverse step and the backward recursion below: the inverse is
  exact algebra (for any β ≠ 1), and the recursion agrees with the reference code's.
- The reference code measures convergence by a relative 2-norm, ‖z − f(z)‖/(10⁻⁵ + ‖f(z)‖);
  here it is the library's rule, ‖f(z) − z‖ ≤ tol in the solver's norm.
- The paper calls the gradient exact. It is the exact gradient of the discrete iteration
  in exact arithmetic only: in floating point it matches `Unrolled()` to rounding for a
  few steps. The forward step contracts (its Jacobian determinant is (1 − β)^{2n}), so
  running it backwards expands rounding errors, and once the forward iteration has
  converged to rounding level the early iterates cannot be rebuilt from the last one. What
  reaches the gradient is derived in `ReversibleAdjoint`'s docstring: for
  parameters that multiply the state it loses accuracy geometrically in N, at a rate set by
  how strongly f contracts, and can be wrong by orders of magnitude, silently, for weakly
  contracting maps. (Only the abstract and summaries of the paper's body were at hand;
  whether it discusses this was not checked.)
- A summary of the paper gives β ∈ (0, 2). The inverse exists for any β ≠ 1, and the
  linearised iteration below also converges for β ∈ (1, 2) (over-relaxation); only (0, 1)
  is offered here.
- A fixed point of the coupled iteration is a pair y = f(z), z = f(y), which includes the
  2-cycles of f (y ≠ z), not only its fixed points; the convergence test ‖f(z) − z‖ ≤ tol
  rejects them.
"""

from __future__ import annotations

from typing import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from ._adjoint import AbstractAdjoint, _stop
from ._solvers import AbstractFixedPointSolver, _FixedPointProblem, max_norm


def _coefficients(beta, dtype):
    """`(β, 1 − β)` in the iterates' dtype; the forward and backward steps share them, so that
    the backward step inverts the forward one up to rounding."""
    b = jnp.asarray(beta, dtype)
    return b, jnp.asarray(1.0, dtype) - b


class _ReversibleState(eqx.Module):
    y: Float[Array, " n"]
    z: Float[Array, " n"]  # the iterate returned
    fz: Float[Array, " n"]  # f(z): the residual's evaluation, reused by the next step
    rnorm: Float[Array, ""]  # ‖f(z) − z‖


class Reversible(AbstractFixedPointSolver):
    """The reversible fixed-point iteration of McCallum, Arora & Foster (arXiv:2509.12917).

    Two iterates start at the initial guess, y₀ = z₀ = x₀, and each step is

        y_{n+1} = (1 − β) y_n + β f(z_n)
        z_{n+1} = (1 − β) z_n + β f(y_{n+1})

    on flat vectors of shape `(n,)`. The iterate is z (`Solution.value` is z_N, or with an
    adjoint other than `ReversibleAdjoint` the best z seen, which is z_N whenever the solve
    converged) and the solve converges when ‖f(z_N) − z_N‖ ≤ tol. Each step costs two
    evaluations of f: f(y_{n+1}), and f(z_{n+1}), which the residual needs and the next step
    reuses.

    Every step can be undone exactly (in exact arithmetic):
    z_n = (z_{n+1} − β f(y_{n+1}))/(1 − β), then y_n = (y_{n+1} − β f(z_n))/(1 − β), which
    `ReversibleAdjoint` uses for exact gradients at constant memory. With any other adjoint
    it is an ordinary solver: a damped iteration in which z sees the newest y.

    Linearised at the fixed point with ∂f/∂x = λ (a scalar, for illustration), a step
    multiplies the error by a 2×2 matrix with determinant (1 − β)² and trace
    2(1 − β) + β²λ²: for real λ it contracts iff |λ| < 1, at the same rate μ₊ for λ and −λ
    (so oscillating maps converge as well as monotone ones), and stalls at |λ| = 1.

    **Arguments:**

    - `damping`: 1 − β, in (0, 1) (default 0.2, i.e. β = 0.8): the fraction of the old
      iterate kept, as for every solver here (the paper's coupling β is the weight of the new
      evaluation of f). damping = 0 would make the step impossible to undo (it divides by
      1 − β).
      Larger β takes fewer steps, but each step of `ReversibleAdjoint`'s backward pass
      amplifies rounding errors more (by κ = μ₊²/(1 − β)², see there); per unit of
      convergence β matters little, the contraction of f decides. β in [0.5, 0.9)
      (damping 0.1 to 0.5) is the useful range.
    """

    damping: float = 0.2
    tol: float = 1e-5
    max_steps: int = eqx.field(default=100, static=True)
    norm: Callable = eqx.field(default=max_norm, static=True)

    def __check_init__(self):
        if isinstance(self.damping, (int, float)) and not (0.0 < self.damping < 1.0):
            raise ValueError(
                f"Reversible(damping={self.damping}) must be in (0, 1), the open interval: "
                "each step keeps this fraction of the old iterate and adds 1 - damping (the "
                "paper's beta) of the new evaluation; undoing a step (ReversibleAdjoint) "
                "divides by damping, and damping = 1 never moves. Values in (0.1, 0.5] are "
                "the useful range."
            )

    @property
    def beta(self) -> float:
        """The paper's coupling β = 1 − damping."""
        return 1.0 - self.damping

    def init(self, prob, x, args):
        fz = prob.fn(x, args)
        return _ReversibleState(x, x, fz, self._rnorm(fz - x))

    def step(self, prob, state, args):
        b, c = _coefficients(self.beta, state.z.dtype)
        y = c * state.y + b * state.fz
        z = c * state.z + b * prob.fn(y, args)
        fz = prob.fn(z, args)
        return _ReversibleState(y, z, fz, self._rnorm(fz - z))

    def terminate(self, state):
        return self._stop(state.rnorm, ~jnp.isfinite(state.rnorm))

    def output(self, state):
        return state.z, state.rnorm


class ReversibleAdjoint(AbstractAdjoint):
    r"""Gradients of the `Reversible` iteration, exact in exact arithmetic, at memory
    independent of its length (McCallum, Arora & Foster, arXiv:2509.12917). Only with
    `solver=Reversible(...)`, and for fixed points only; reverse mode only (`jax.grad`,
    `jax.vjp`).

    The forward loop keeps nothing but its last state, (y_N, z_N) of shape `(n,)` each, and
    the number of steps N (a run-time value: the loop stops at convergence, and under `vmap`
    each example has its own N). The value returned is z_N, the last iterate (not the best
    one seen: they differ only when the solve failed), with its statistics. Given the
    cotangent z̄_N (and ȳ_N = 0), the backward pass runs N inverse steps, from n = N − 1 down
    to 0:

        z_n = (z_{n+1} − β f(y_{n+1}))/(1 − β)        ȳ' = ȳ_{n+1} + β J(y_{n+1})ᵀ z̄_{n+1}
        y_n = (y_{n+1} − β f(z_n))/(1 − β)            z̄_n = (1 − β) z̄_{n+1} + β J(z_n)ᵀ ȳ'
                                                      ȳ_n = (1 − β) ȳ'
        θ̄ += β (∂_θ f(y_{n+1})ᵀ z̄_{n+1} + ∂_θ f(z_n)ᵀ ȳ')

    with J = ∂f/∂x and θ every differentiable leaf of `args` and of the arrays `fn` closes
    over. Each inverse step costs two evaluations of f, each linearised once for its VJP;
    the memory is that of one step. The initial guess gets no gradient, as with every
    adjoint.

    Accuracy: the result equals backpropagation through the same iterations (`Unrolled()`)
    up to rounding errors, which the backward pass amplifies. Linearised with ∂f/∂x = λ, a
    forward step has eigenvalues μ₊ ≥ μ₋ with μ₊μ₋ = (1 − β)²; the error of a rebuilt
    iterate grows like 1/μ₋ per step while the cotangent meeting it decays like μ₊, so the
    gradient with respect to a parameter that multiplies the state (a weight matrix) has a
    relative error of about ε·κᴺ, κ = μ₊²/(1 − β)² (ε the machine epsilon). A parameter the
    iterates do not enter (an additive bias) stays exact. As the residual falls like μ₊ᴺ,
    stopping at a residual reduction τ gives an error of about ε·τ^(−p) with
    p = 2(log(1 − β)/log μ₊ − 1), nearly independent of β and set by λ: p ≈ 0.25 for
    λ = 0.1, 0.9 for 0.3, 2–2.7 for 0.5, 5–6 for 0.7, 18–25 for 0.9. A saturating map
    such as tanh(Wx + b) bounds the error even far past convergence, until the rebuilt
    iterates overflow (NaN); a weakly contracting linear map gives gradients that are finite
    and wrong by orders of magnitude (docs/results/peers.md has the errors against
    `Unrolled()`).

    So: use it where f contracts well (λ ≲ 0.5) at a moderate tolerance, as the paper does
    with few steps, preferably in float64, and check against `Unrolled()` on a sample; for
    weakly contracting maps use `Implicit()`. A non-finite gradient (the rebuilt iterates
    overflowed or left f's domain) raises when the forward call had `throw=True` and is NaN
    otherwise; a finite wrong one cannot be detected.
    """

    def attach(self, prob, args, run_loop, throw):
        if not isinstance(prob, _FixedPointProblem):
            raise ValueError("ReversibleAdjoint is defined for fixed_point with "
                             "solver=Reversible() only.")
        (solver, state), stats = run_loop(_stop(prob), _stop(args), differentiable=False,
                                          last=True)
        if not isinstance(solver, Reversible):
            raise ValueError(
                "ReversibleAdjoint runs the steps of solver=Reversible() backwards and fits "
                f"no other solver; got {type(solver).__name__}. Use "
                "solver=Reversible(damping=...), or another adjoint (Implicit(), Unrolled())."
            )
        value = _reversible_identity((prob, args), state, stats[0], solver.beta, throw)
        return value, stats


_BACKWARD_MSG = (
    "ReversibleAdjoint: the gradient is not finite although the incoming one is. Running the "
    "Reversible iteration backwards amplifies rounding errors at every step, and the rebuilt "
    "iterates overflowed or left the map's domain (the more steps and the more weakly the "
    "map contracts, the sooner). Loosen the solver's tol (fewer steps), use float64, use "
    "adjoint=Unrolled() (stored iterates) or Implicit(), or pass throw=False to receive NaN "
    "gradients instead of this error."
)


def _nonfinite(tree):
    leaves = [jnp.any(~jnp.isfinite(x)) for x in jax.tree.leaves(tree)]
    return jnp.any(jnp.stack(leaves)) if leaves else jnp.asarray(False)


@eqx.filter_custom_vjp
def _reversible_identity(vjp_arg, state, steps, beta, throw):
    del vjp_arg, steps, beta, throw
    return state.z


@_reversible_identity.def_fwd
def _reversible_fwd(perturbed, vjp_arg, state, steps, beta, throw):
    del perturbed, vjp_arg, steps, beta, throw
    return state.z, None


@_reversible_identity.def_bwd
def _reversible_bwd(residuals, g_z, perturbed, vjp_arg, state, steps, beta, throw):
    del residuals
    # Only the leaves being differentiated get a cotangent.
    diff, static = eqx.partition(vjp_arg, perturbed)

    def fn_of(d, x):
        p, a = eqx.combine(d, static)
        return p.fn(x, a)

    if g_z is None:  # a symbolic zero
        g_z = jnp.zeros_like(state.z)
    b, c = _coefficients(beta, state.z.dtype)

    def body(carry):
        k, y1, z1, gy1, gz1, acc = carry
        # undo z's update and pull z̄_{n+1} back through it
        fy1, vjp_y1 = jax.vjp(fn_of, diff, y1)
        z0 = (z1 - b * fy1) / c
        d_theta_y, d_y = vjp_y1(gz1)
        gy = gy1 + b * d_y
        # undo y's update and pull ȳ' back through it
        fz0, vjp_z0 = jax.vjp(fn_of, diff, z0)
        y0 = (y1 - b * fz0) / c
        d_theta_z, d_z = vjp_z0(gy)
        acc = jax.tree.map(lambda t, u, v: (t + b * (u + v)).astype(t.dtype), acc,
                           d_theta_y, d_theta_z)
        return k - 1, y0, z0, c * gy, c * gz1 + b * d_z, acc

    acc0 = jax.tree.map(jnp.zeros_like, diff)
    carry = (steps, state.y, state.z, jnp.zeros_like(state.y), g_z, acc0)
    acc = jax.lax.while_loop(lambda carry: carry[0] > 0, body, carry)[-1]
    if throw:
        acc = eqx.error_if(acc, _nonfinite(acc) & ~_nonfinite(g_z), _BACKWARD_MSG)
    return acc
