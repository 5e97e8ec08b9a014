"""Spin-transformer attention: the response of driven vector-spin models (Spin-Model
Transformers seed, blog/1; carried state and FFN fields from blog/0).

Per head h the module builds a vector-spin model on the h-th `D/H`-dimensional subspace:

- external fields: the input's h-th slice, rescaled to the sphere of radius
  `R = sqrt(D_h/2 - 1)` (plus `FFN(x)` if `field_ffn > 0`);
- couplings: `J_h = softmax(q_h k_hᵀ / sqrt(D_h))` with `q`, `k` linear maps of the *full*
  input (masked before the softmax, so a causal mask is a triangular coupling matrix);
- output: the magnetizations, either the steady state (`mode="fixed_point"`) or after
  `num_steps` time steps of the naive or TAP mean-field dynamics (`mode="steps"`).

The H spin models are independent given their couplings: H heads equal H single-head models
on the corresponding subspaces (each head is solved on its own, with its own convergence).
All physics is in `spinformer.spins.vector`.
"""

from __future__ import annotations

import math
from typing import ClassVar, Optional

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, PRNGKeyArray

from .. import solvers
from ..spins import vector
from ._block import FeedForward
from ._masks import combine_masks
from ._softmax import _check_shapes

_UPDATES = ("naive", "tap")
_MODES = ("fixed_point", "steps")
_INITS = ("reset", "learned", "carried")


class SpinAttention(eqx.Module):
    """Multi-head spin attention; one example per call.

    **Arguments:**

    - `dim`: model width D; `num_heads`: H, with `D_h = D/H > 2`.
    - `causal`: causal couplings (spin i feels only spins j ≤ i).
    - `beta`: inverse temperature β.
    - `update`: `"naive"` (first-order mean field) or `"tap"` (second order).
    - `mode`: `"fixed_point"` (the non-equilibrium steady state, found by `solver` and
      differentiated with `adjoint`) or `"steps"` (`num_steps` time steps).
    - `num_steps`: K for `mode="steps"`.
    - `init`: initial magnetizations for `mode="steps"`: `"reset"` (the decoupled
      magnetizations φ(x), fresh each call), `"learned"` (a trained vector per head) or
      `"carried"` (the `state=` passed by the caller, e.g. the previous call's
      `diagnostics["state"]`; φ(x) if None).
    - `solver`, `adjoint`, `tol`, `max_steps`, `throw`: passed to the fixed-point solves
      (`throw=False` reports non-convergence in the diagnostics instead of raising).
    - `output_proj`: mix the heads' magnetizations with a learned `D × D` map.
    - `field_ffn`: hidden width of an FFN whose output is added to the fields (0: none).
    - `normalize_fields`: rescale each head's field to norm R (as in the seed).
    - `key`: PRNG key.
    """

    to_q: eqx.nn.Linear
    to_k: eqx.nn.Linear
    out_proj: Optional[eqx.nn.Linear]
    field_mlp: Optional[FeedForward]
    m_init: Optional[Float[Array, "h dh"]]
    beta: float
    tol: float
    solver: solvers.AbstractSolver
    adjoint: solvers.AbstractAdjoint
    dim: int = eqx.field(static=True)
    num_heads: int = eqx.field(static=True)
    causal: bool = eqx.field(static=True)
    update: str = eqx.field(static=True)
    mode: str = eqx.field(static=True)
    num_steps: int = eqx.field(static=True)
    init: str = eqx.field(static=True)
    max_steps: int = eqx.field(static=True)
    throw: bool = eqx.field(static=True)
    normalize_fields: bool = eqx.field(static=True)

    coupling_fields: ClassVar[tuple[str, ...]] = ("to_q", "to_k")

    def __init__(
        self,
        dim: int,
        num_heads: int = 1,
        causal: bool = False,
        *,
        beta: float = 1.0,
        update: str = "tap",
        mode: str = "fixed_point",
        num_steps: int = 2,
        init: str = "reset",
        solver: solvers.AbstractSolver = solvers.Anderson(),
        adjoint: solvers.AbstractAdjoint = solvers.Implicit(),
        tol: float = 1e-3,
        max_steps: int = 30,
        throw: bool = False,
        output_proj: bool = False,
        field_ffn: int = 0,
        normalize_fields: bool = True,
        key: PRNGKeyArray,
    ):
        if dim % num_heads:
            raise ValueError(
                f"SpinAttention: dim={dim} is not divisible by num_heads={num_heads}."
            )
        if dim // num_heads <= 2:
            raise ValueError(
                f"SpinAttention: the head width D_h = dim/num_heads = {dim // num_heads} must be "
                "> 2 (spins live on spheres of radius sqrt(D_h/2 - 1)); use fewer heads."
            )
        for name, value, allowed in (("update", update, _UPDATES), ("mode", mode, _MODES),
                                     ("init", init, _INITS)):
            if value not in allowed:
                raise ValueError(f"SpinAttention: {name}={value!r}; choose one of {allowed}.")
        if mode == "steps" and num_steps < 1:
            raise ValueError(f"SpinAttention: num_steps={num_steps} must be >= 1.")
        if not beta > 0:
            raise ValueError(f"SpinAttention: beta={beta} must be > 0.")
        kq, kk, ko, kf, km = jax.random.split(key, 5)
        self.to_q = eqx.nn.Linear(dim, dim, use_bias=False, key=kq)
        self.to_k = eqx.nn.Linear(dim, dim, use_bias=False, key=kk)
        self.out_proj = eqx.nn.Linear(dim, dim, use_bias=False, key=ko) if output_proj else None
        self.field_mlp = FeedForward(dim, field_ffn, key=kf) if field_ffn > 0 else None
        dh = dim // num_heads
        self.m_init = 0.1 * jax.random.normal(km, (num_heads, dh)) if init == "learned" else None
        self.beta = beta
        self.tol = tol
        self.solver = solver
        self.adjoint = adjoint
        self.dim = dim
        self.num_heads = num_heads
        self.causal = causal
        self.update = update
        self.mode = mode
        self.num_steps = num_steps
        self.init = init
        self.max_steps = max_steps
        self.throw = throw
        self.normalize_fields = normalize_fields

    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads

    @property
    def radius(self) -> float:
        """Spin radius R = sqrt(D_h/2 - 1) (large-D convention of the seed)."""
        return math.sqrt(self.head_dim / 2 - 1)

    def couplings(
        self,
        x: Float[Array, "n d"],
        context: Optional[Float[Array, "s d"]] = None,
        mask: Optional[Bool[Array, "n s"]] = None,
    ) -> Float[Array, "h n s"]:
        """Row-stochastic couplings `J_h = softmax(q_h k_hᵀ/sqrt(D_h))`, masked entries 0."""
        ctx = x if context is None else context
        n, s, h = x.shape[0], ctx.shape[0], self.num_heads
        q = jax.vmap(self.to_q)(x).reshape(n, h, -1).transpose(1, 0, 2)
        k = jax.vmap(self.to_k)(ctx).reshape(s, h, -1).transpose(1, 0, 2)
        scores = jnp.einsum("hnk,hsk->hns", q, k) / math.sqrt(self.head_dim)
        allowed = combine_masks(n, s, self.causal and context is None, mask)
        if allowed is not None:
            scores = jnp.where(allowed, scores, jnp.finfo(scores.dtype).min)
        return jax.nn.softmax(scores, axis=-1)

    def fields(self, x: Float[Array, "n d"]) -> Float[Array, "h n dh"]:
        """Per-head external fields: the input's subspaces (plus FFN(x)), norm R each."""
        if self.field_mlp is not None:
            x = x + jax.vmap(self.field_mlp)(x)
        xh = x.reshape(x.shape[0], self.num_heads, self.head_dim).transpose(1, 0, 2)
        if self.normalize_fields:
            norm = jnp.sqrt(jnp.sum(xh**2, axis=-1, keepdims=True) + 1e-12)
            xh = self.radius * xh / norm
        return xh

    def __call__(
        self,
        x: Float[Array, "n d"],
        *,
        context: Optional[Float[Array, "s d"]] = None,
        mask: Optional[Bool[Array, "n s"]] = None,
        state: Optional[Float[Array, "n d"]] = None,
        key: Optional[PRNGKeyArray] = None,
        return_diagnostics: bool = False,
    ):
        """**Arguments:**

        - `x`: tokens `(n, d)` (the external fields).
        - `context`: `(s, d)` for cross-attention: couplings `softmax(q(x) k(c)ᵀ)`; the context
          spins feel their own fields (the context's subspaces, norm R) and no couplings, and
          their magnetizations act as the previous time step of the query spins, so the
          output is one (naive or TAP) mean-field step driven by the context.
        - `mask`: boolean `(n, s)`, True where a coupling is allowed (combined with `causal`).
        - `state`: `(n, d)` magnetizations carried from a previous call (`init="carried"`).
        - `key`: unused (no randomness).
        - `return_diagnostics`: also return a dict with `couplings (H, n, s)`,
          `magnetizations (H, n, D_h)`, `state (n, d)`, and per head `num_steps`, `residual`,
          `result` (solver statistics; `result` 0 means converged).

        **Returns:** `(n, d)` magnetizations (through `out_proj` if present), or
        `(output, diagnostics)`.
        """
        del key
        ctx = x if context is None else context
        _check_shapes("SpinAttention", x, ctx, self.dim)
        n, h, dh = x.shape[0], self.num_heads, self.head_dim
        J = self.couplings(x, context, mask)
        xh = self.fields(x)
        beta, R = self.beta, self.radius

        if context is not None:
            # The context spins are driven by their own fields and feel no couplings; the
            # decoder spins feel them through J as the previous time step's magnetizations.
            ch = self.fields(ctx)
            m_prev = vector.magnetization(ch, beta=beta, R=R)
            m, stats = jax.vmap(lambda xx, jj, cc, mp: self._cross_step(mp, cc, xx, jj))(
                xh, J, ch, m_prev
            )
        elif self.mode == "fixed_point":
            m0 = vector.magnetization(xh, beta=beta, R=R)
            m, stats = jax.vmap(lambda xx, jj, m0_: self._steady_state(m0_, xx, jj))(
                xh, J, m0
            )
        else:
            m0 = self._initial_state(xh, state)
            m, stats = jax.vmap(lambda xx, jj, m0_: self._time_steps(m0_, xx, jj))(
                xh, J, m0
            )

        out = m.transpose(1, 0, 2).reshape(n, self.dim)
        y = jax.vmap(self.out_proj)(out) if self.out_proj is not None else out
        if return_diagnostics:
            num_steps, residual, result = stats
            diag = {
                "couplings": J,
                "magnetizations": m,
                "state": out,
                "num_steps": num_steps,
                "residual": residual,
                "result": result,
            }
            return y, diag
        return y

    # -- the spin dynamics, one head -------------------------------------------------------

    def _solve_kwargs(self):
        return dict(solver=self.solver, adjoint=self.adjoint, tol=self.tol,
                    max_steps=self.max_steps, throw=self.throw)

    def _one_step(self, m_prev, x, J):
        """One mean-field time step m_t = update(m_{t-1}); stats (steps, residual, result)."""
        if self.update == "naive":
            m = vector.naive_step(m_prev, x, J, beta=self.beta, R=self.radius)
            zero = jnp.asarray(0, jnp.int32)
            return m, (zero + 1, jnp.zeros((), m.dtype), zero)
        sol = vector.tap_step(m_prev, x, J, beta=self.beta, R=self.radius,
                              return_solution=True, **self._solve_kwargs())
        return sol.value, (sol.num_steps, sol.residual, sol.result)

    def _cross_step(self, m_ctx, x_ctx, x, J):
        """One step of the n query spins driven by s context spins through J (n, s).

        Embedded exactly as one square system of n + s spins: couplings [[0, J], [0, 0]],
        previous magnetizations [·, m_ctx], so the query rows get x + J m_ctx (+ the TAP
        correction from the context spins' variances) and the context rows are decoupled.
        """
        n, s = J.shape
        J_big = jnp.zeros((n + s, n + s), J.dtype).at[:n, n:].set(J)
        x_big = jnp.concatenate([x, x_ctx], axis=0)
        m_prev = jnp.concatenate([jnp.zeros_like(x), m_ctx], axis=0)
        m, stats = self._one_step(m_prev, x_big, J_big)
        return m[:n], stats

    def _steady_state(self, m0, x, J):
        """The NESS m* = update(m*, m*) solved as a fixed point."""
        if self.update == "tap":
            sol = vector.tap_ness(x, J, beta=self.beta, R=self.radius, m0=m0,
                                  return_solution=True, **self._solve_kwargs())
        else:
            beta, R = self.beta, self.radius
            sol = solvers.fixed_point(
                lambda m, a: vector.naive_step(m, a[0], a[1], beta=beta, R=R),
                m0, (x, J), **self._solve_kwargs(),
            )
        return sol.value, (sol.num_steps, sol.residual, sol.result)

    def _initial_state(self, xh, state):
        n, h, dh = xh.shape[1], self.num_heads, self.head_dim
        if self.init == "learned":
            return jnp.broadcast_to(self.m_init[:, None, :], (h, n, dh)).astype(xh.dtype)
        if self.init == "carried" and state is not None:
            if state.shape != (n, self.dim):
                raise ValueError(
                    f"SpinAttention: state must have shape ({n}, {self.dim}) like x; got "
                    f"{state.shape}. Pass the previous call's diagnostics['state']."
                )
            return state.reshape(n, h, dh).transpose(1, 0, 2)
        return vector.magnetization(xh, beta=self.beta, R=self.radius)

    def _time_steps(self, m0, x, J):
        """K time steps from m0; stats: total inner solver steps, last change, worst result."""

        def body(carry, _):
            m, steps, result = carry
            m_new, (k, _, res) = self._one_step(m, x, J)
            return (m_new, steps + k, jnp.maximum(result, res)), m_new - m

        zero = jnp.asarray(0, jnp.int32)
        (m, steps, result), deltas = jax.lax.scan(body, (m0, zero, zero), None,
                                                  length=self.num_steps)
        return m, (steps, jnp.max(jnp.abs(deltas[-1])), result)
