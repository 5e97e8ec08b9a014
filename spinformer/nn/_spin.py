"""Spin-transformer attention: the response of driven vector-spin models (M. Bal,
"Spin-Model Transformers" (2023), mcbal.github.io; the carried state and the FFN fields follow
M. Bal, "Transformers Are Secretly Collectives of Spin Systems" (2021), mcbal.github.io).

Per head h the module builds a vector-spin model on the h-th `D/H`-dimensional subspace:

- external fields: the input's h-th slice, rescaled to the sphere of radius
  `R = sqrt(D_h/2 - 1)` (plus `FFN(x)` if `field_ffn > 0`);
- couplings: `J_h = softmax(q_h k_hᵀ / sqrt(D_h))` with `q`, `k` linear maps of the *full*
  input (masked before the softmax, so a causal mask is a triangular coupling matrix);
- output: the magnetizations, either the steady state (`mode="fixed_point"`) or after
  `num_steps` time steps of the first-order (`update="mean_field"`) or TAP mean-field
  dynamics (`mode="steps"`).

The H spin models are independent given their couplings: H heads equal H single-head models
on the corresponding subspaces (each head is solved on its own, with its own convergence).
All physics is in `spinformer.spins.vector`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal, Optional, Union

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from .. import solvers
from .._schema import (Choice, ConfigError, check_solvers, check_values, choice, option,
                       register_attention, register_choice)
from ..spins import vector
from ._block import FeedForward
from ._attention_diagnostics import Diagnostics, Stats
from ._heads import (check_heads, decode_scores, masked_softmax, merge_heads, qk_scores,
                     split_heads)
from ._literal import check_literal

# The spins live on spheres of radius sqrt(D_h/2 - 1): a head needs D_h > 2.
_MIN_HEAD_DIM = 3


# -- the update rule of the spin layer, an object (names in configs: `register_choice`) --


# `mode="steps"` runs up to this many time steps unrolled (see `SpinAttention._time_steps`).
_UNROLL_STEPS = 8


def _failed(x) -> Int[Array, ""]:
    """How many solves of `x` (a `Solution` or `Stats`, one solve or one per head) failed."""
    return jnp.sum(x.result != solvers.RESULTS.successful).astype(jnp.int32)


class SpinUpdate(Choice):
    """The mean-field equations of the vector-spin model (`update=`): `MeanFieldUpdate`
    (`"mean_field"`, first order) or `TAPUpdate` (`"tap"`, with the Onsager/feed-forward
    corrections). `solve` holds the solver keywords (`solver`, `adjoint`, `throw`)."""

    def step(self, m_prev, x, J, *, beta, R, solve) -> tuple[Array, Stats]:
        """One time step `m_t` `(n, D_h)` from `m_{t-1}`, and its solver `Stats`."""
        raise NotImplementedError

    def ness(self, x, J, *, beta, R, **solve):
        """The steady state `m* = update(m*, m*)` as a `solvers.Solution`."""
        raise NotImplementedError

    def ness_map(self, m, x, J, *, beta, R):
        """The steady-state map `m -> update(m, m)` whose fixed point `ness` solves."""
        raise NotImplementedError

    def row_field(self, m, M, x, J, *, beta, R):
        """The field `(D_h,)` on one spin with magnetization `m (D_h,)`, field `x (D_h,)`
        and couplings `J (L,)` to the magnetizations `M (L, D_h)` of the previous time step
        (incremental decoding solves one position at a time)."""
        raise NotImplementedError

    def row_context(self, M, x, J, pos, *, beta, R):
        """What the steady-state field of row `pos` needs from the cached rows `M (L, D_h)`
        (incremental decoding), as a pytree of arrays computed once per position; by
        default the rows themselves."""
        return (M, x, J, pos)

    def context_field(self, m, ctx, *, beta, R):
        """The steady-state field `(D_h,)` of row pos at `m`, from `row_context`: by default
        `row_field` with m written into row pos of the cached rows."""
        M, x, J, pos = ctx
        return self.row_field(m, M.at[pos].set(m), x, J, beta=beta, R=R)

    def decode_step(self, x, J, M_prev, *, beta, R, solve):
        """One time step of the newest position given every position's previous
        magnetizations `M_prev (L, D_h)`: `(m (D_h,), failed)`."""
        m0 = vector.magnetization(x + J @ M_prev, beta=beta, R=R)
        sol = solvers.fixed_point(
            lambda m, a: vector.magnetization(self.row_field(m, *a, beta=beta, R=R), beta=beta,
                                              R=R),
            m0, (M_prev, x, J), **solve)
        return sol.value, _failed(sol)


@register_choice("spin.update", "mean_field")
@dataclasses.dataclass(frozen=True)
class MeanFieldUpdate(SpinUpdate):
    """First-order mean field: `m_t = φ(x + J m_{t-1})` (no solve per time step)."""

    def step(self, m_prev, x, J, *, beta, R, solve):
        m = vector.mean_field_step(m_prev, x, J, beta=beta, R=R)
        none = Stats.none((), m.dtype)
        return m, Stats(none.num_steps + 1, none.residual, none.result)

    def ness(self, x, J, *, beta, R, **solve):
        return vector.mean_field_ness(x, J, beta=beta, R=R, **solve)

    def ness_map(self, m, x, J, *, beta, R):
        return vector.mean_field_step(m, x, J, beta=beta, R=R)

    def row_field(self, m, M, x, J, *, beta, R):
        del m
        return x + J @ M

    def row_context(self, M, x, J, pos, *, beta, R):
        # the field x + Σ_j J_j m_j with row pos = m: the other rows' sum, once
        return (x + J @ M - J[pos] * M[pos], J[pos])

    def context_field(self, m, ctx, *, beta, R):
        base, Jp = ctx
        return base + Jp * m

    def decode_step(self, x, J, M_prev, *, beta, R, solve):
        return vector.magnetization(x + J @ M_prev, beta=beta, R=R), jnp.zeros((), jnp.int32)


@register_choice("spin.update", "tap")
@dataclasses.dataclass(frozen=True)
class TAPUpdate(SpinUpdate):
    """Second-order (TAP) mean field: each time step is itself a fixed point in `m_t`,
    solved with the layer's solver (`spins.vector.tap_step`)."""

    def step(self, m_prev, x, J, *, beta, R, solve):
        sol = vector.tap_step(m_prev, x, J, beta=beta, R=R, **solve)
        return sol.value, Stats.of(sol)

    def ness(self, x, J, *, beta, R, **solve):
        return vector.tap_ness(x, J, beta=beta, R=R, **solve)

    def ness_map(self, m, x, J, *, beta, R):
        return vector.ness_update(m, x, J, beta=beta, R=R)

    def row_field(self, m, M, x, J, *, beta, R):
        return vector._tap_field(m[None], M, x[None], J[None], beta, R)[0]

    def row_context(self, M, x, J, pos, *, beta, R):
        return vector._tap_row_context(M, x, J, pos, beta, R)

    def context_field(self, m, ctx, *, beta, R):
        return vector._tap_row_field(m, ctx, beta, R)


# -- the choices that switch a code path, an initial state or a readout: Literal fields --

#: `mode=`: solve for the non-equilibrium steady state (`"fixed_point"`, solved and
#: differentiated by the layer's solver and adjoint) or take `num_steps` time steps from the
#: `init` state (`"steps"`).
Mode = Literal["fixed_point", "steps"]
#: `init=`, the initial magnetizations of `mode="steps"`: the decoupled magnetizations φ(x),
#: fresh each call (`"reset"`), a trained vector per head (`"learned"`) or the `state=` the
#: caller passes (`"carried"`, e.g. the previous call's `diagnostics.state`; φ(x) without one).
Init = Literal["reset", "learned", "carried"]
#: `output=`, what the layer returns: the magnetizations m (`"magnetization"`) or m − φ(x),
#: the part of m the couplings cause (`"response"`).
Output = Literal["magnetization", "response"]


@dataclasses.dataclass(frozen=True)
class SpinConfig:
    """Settings of spin attention: a config's `model.attention: {name: spin, ...}`."""

    beta: float = option(2.0, "inverse temperature β of the vector-spin model (2 trains "
                         "better than 1; see experiments/results/spin_lm)")
    update: SpinUpdate = option(TAPUpdate(), "mean-field equations: mean_field (first order) or tap (second "
                         "order, with Onsager/feed-forward corrections)", kind="spin.update")
    mode: Mode = option("fixed_point", "fixed_point: solve for the steady state; steps: take "
                       "num_steps time steps")
    num_steps: int = option(2, "steps mode: number of time steps K")
    init: Init = option("reset", "steps mode: initial magnetizations: reset (fresh each call), "
                       "learned (a trained per-head vector) or carried (passed in by the "
                       "caller)")
    solver: solvers.AbstractSolver = option(
        solvers.Anderson(tol=1e-3, max_steps=30),
        "the solver of the steady state and of the TAP step", kind="solver")
    adjoint: solvers.AbstractAdjoint = option(
        solvers.Implicit(linear_solver=solvers.GMRES(restart=5), rtol=1e-3),
        "how gradients flow through the steady state", kind="adjoint")
    output_proj: bool = option(True, "mix the heads' magnetizations with a learned linear map")
    field_ffn: int = option(0, "hidden width of an FFN added to the external fields "
                            "(x -> x + FFN(x)); 0 for none")
    value_proj: bool = option(False, "pass the input through a learned linear map before it "
                              "becomes the external fields (the spin analogue of values)")
    normalize_fields: bool = option(True, "rescale each head's field to norm R (Bal, "
                                    "\"Spin-Model Transformers\"); false keeps the magnitudes")
    learn_beta: bool = option(False, "learn one inverse temperature per head, "
                              "beta_h = beta * exp(a_h), a_h initialised at 0")
    output: Output = option("magnetization", "what the layer returns: magnetization (m) or "
                            "response (m - phi(x): the part of m the couplings cause; the "
                            "block's residual already carries the input)")
    coupling_scale: float = option(1.0, "coupling strength c: J = c * softmax(q k^T / "
                                   "sqrt(D_h)) (rows sum to c instead of 1)")

    def __post_init__(self):
        if not self.num_steps >= 1:
            raise ConfigError(f"num_steps={self.num_steps} must be >= 1.")
        if not self.beta > 0:
            raise ConfigError(f"beta={self.beta} must be > 0.")
        check_solvers(self)
        if not self.coupling_scale > 0:
            raise ConfigError(f"coupling_scale={self.coupling_scale} must be > 0.")
        if not self.field_ffn >= 0:
            raise ConfigError(f"field_ffn={self.field_ffn} must be >= 0.")


# the constructor's defaults are the settings' (one source of defaults)
_DEFAULTS = SpinConfig()


# The query/key maps build the couplings J: they form the optimizer group "couplings".
@register_attention("spin", config=SpinConfig, help="vector-spin mean field",
                    min_head_dim=_MIN_HEAD_DIM, coupling_fields=("to_q", "to_k"),
                    carries_state={"mode": "steps", "init": "carried"},
                    default=True)
class SpinAttention(eqx.Module):
    """Multi-head spin attention; one example per call.

    **Arguments:**

    - `dim`: model width D; `num_heads`: H, with `D_h = D/H > 2`.
    - `causal`: causal couplings (spin i feels only spins j ≤ i).
    - `beta`: inverse temperature β (default `SpinConfig.beta`, which trains better than 1: see
      `experiments/results/spin_lm/`). With fields of norm R the steady state's response to
      the other spins is β/(1 + √(1 + β²)) per unit of coupling: 0.41 at β = 1, 0.62 at 2.

    - `update`: the update rule, an object (`SpinUpdate`) or its config name:
      `MeanFieldUpdate()` (`"mean_field"`, first-order mean field) or `TAPUpdate()`
      (`"tap"`, second order); the module holds the object.
    - `mode`: `"fixed_point"` (the non-equilibrium steady state, found by `solver` and
      differentiated with `adjoint`) or `"steps"` (`num_steps` time steps).
    - `num_steps`: K for `mode="steps"`.
    - `init`: initial magnetizations for `mode="steps"`: `"reset"` (the decoupled
      magnetizations φ(x), fresh each call), `"learned"` (a trained vector `m_init (H, D_h)`
      per head) or `"carried"` (the `state=` passed by the caller, e.g. the previous call's
      `diagnostics.state`; φ(x) if None).
    - `solver`, `adjoint`, `throw`: passed to the fixed-point solves; the solver carries the
      tolerance and step budget (defaults: `SpinConfig.solver` and `SpinConfig.adjoint`, as
      for every argument with a default here), and `throw=False` (the default) reports
      non-convergence in the diagnostics instead of raising.
    - `output_proj`: mix the heads' magnetizations with a learned `D × D` map (default on).
    - `field_ffn`: hidden width of an FFN whose output is added to the fields (0: none).
    - `normalize_fields`: rescale each head's field to norm R (as in Bal, "Spin-Model
      Transformers").
    - `value_proj`: pass the input through a learned `D × D` map before it becomes the fields
      (the analogue of softmax attention's values; the fields are then `W_v x`).
    - `learn_beta`: learn one inverse temperature per head, `β_h = beta · exp(a_h)` with
      `a_h` initialised at 0. Implemented exactly as β fixed and the head's fields and
      couplings scaled by `exp(a_h)`: the model with (β, x, J) equals the model with
      (1, βx, βJ) at every order of the mean-field expansion (tested against the TAP and
      first-order maps), so every solver, adjoint and diagnostic sees an ordinary system.
    - `output`: `"magnetization"` returns m; `"response"` returns m − φ(x), the part of the
      magnetizations the couplings cause (to first order the attention term of Bal's
      expansion, whose other term, φ(x), plays the residual connection the block already
      has). The carried `state` is m either way.
    - `coupling_scale`: the coupling strength c, `J = c · softmax(·)`: each spin feels the
      others with total weight c against its own field's weight 1.
    - `key`: PRNG key.
    """

    to_q: eqx.nn.Linear
    to_k: eqx.nn.Linear
    out_proj: Optional[eqx.nn.Linear]
    field_mlp: Optional[FeedForward]
    m_init: Optional[Float[Array, "h dh"]]
    to_v: Optional[eqx.nn.Linear]
    log_beta: Optional[Float[Array, " h"]]
    beta: float
    coupling_scale: float
    solver: solvers.AbstractSolver
    adjoint: solvers.AbstractAdjoint
    dim: int = eqx.field(static=True)
    num_heads: int = eqx.field(static=True)
    causal: bool = eqx.field(static=True)
    update: SpinUpdate = eqx.field(static=True)
    mode: Mode = eqx.field(static=True)
    num_steps: int = eqx.field(static=True)
    init: Init = eqx.field(static=True)
    throw: bool = eqx.field(static=True)
    normalize_fields: bool = eqx.field(static=True)
    output: Output = eqx.field(static=True)

    def __init__(
        self, dim: int, num_heads: int = 1, causal: bool = False, *,
        beta: float = _DEFAULTS.beta,
        update: Union[SpinUpdate, str] = _DEFAULTS.update,
        mode: Mode = _DEFAULTS.mode,
        num_steps: int = _DEFAULTS.num_steps,
        init: Init = _DEFAULTS.init,
        solver: solvers.AbstractSolver = _DEFAULTS.solver,
        adjoint: solvers.AbstractAdjoint = _DEFAULTS.adjoint,
        throw: bool = False,
        output_proj: bool = _DEFAULTS.output_proj,
        field_ffn: int = _DEFAULTS.field_ffn,
        normalize_fields: bool = _DEFAULTS.normalize_fields,
        value_proj: bool = _DEFAULTS.value_proj,
        learn_beta: bool = _DEFAULTS.learn_beta,
        coupling_scale: float = _DEFAULTS.coupling_scale,
        output: Output = _DEFAULTS.output,
        key: PRNGKeyArray,
    ):
        check_heads("SpinAttention", dim, num_heads)
        if dim // num_heads < _MIN_HEAD_DIM:
            raise ValueError(
                f"SpinAttention: the head width D_h = dim/num_heads = {dim // num_heads} must be "
                "> 2 (spins live on spheres of radius sqrt(D_h/2 - 1)); use fewer heads."
            )
        update = choice("spin.update", update, where="SpinAttention: update")
        mode = check_literal("SpinAttention", "mode", mode, Mode)
        init = check_literal("SpinAttention", "init", init, Init)
        output = check_literal("SpinAttention", "output", output, Output)
        check_values(SpinConfig, "SpinAttention", num_steps=num_steps, beta=beta,
                     coupling_scale=coupling_scale, field_ffn=field_ffn)
        kq, kk, ko, kf, km = jax.random.split(key, 5)
        self.to_q = eqx.nn.Linear(dim, dim, use_bias=False, key=kq)
        self.to_k = eqx.nn.Linear(dim, dim, use_bias=False, key=kk)
        self.out_proj = eqx.nn.Linear(dim, dim, use_bias=False, key=ko) if output_proj else None
        self.field_mlp = FeedForward(dim, field_ffn, key=kf) if field_ffn > 0 else None
        dh = dim // num_heads
        self.m_init = (0.1 * jax.random.normal(km, (num_heads, dh)) if init == "learned"
                       else None)
        self.to_v = (eqx.nn.Linear(dim, dim, use_bias=False, key=jax.random.fold_in(kq, 1))
                     if value_proj else None)
        self.log_beta = jnp.zeros((num_heads,)) if learn_beta else None
        self.beta, self.solver, self.throw = beta, solver, throw
        self.coupling_scale = coupling_scale
        self.output = output
        # the adjoint as given: a caller that reads the backward solves passes a recorded one
        # (solvers.record_backward, as train.build_model does)
        self.adjoint = adjoint
        self.dim, self.num_heads, self.causal = dim, num_heads, causal
        self.update, self.mode, self.num_steps, self.init = update, mode, num_steps, init
        self.normalize_fields = normalize_fields

    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads

    @property
    def radius(self) -> float:
        """Spin radius R = sqrt(D_h/2 - 1) (the large-D convention of Bal, "Spin-Model
        Transformers")."""
        return math.sqrt(self.head_dim / 2 - 1)

    def couplings(
        self,
        x: Float[Array, "n d"],
        context: Optional[Float[Array, "s d"]] = None,
        mask: Optional[Bool[Array, "n s"]] = None,
    ) -> Float[Array, "h n s"]:
        """Row-stochastic couplings `J_h = softmax(q_h k_hᵀ/sqrt(D_h))`, masked entries 0."""
        scores, allowed = qk_scores("SpinAttention", self.to_q, self.to_k, x, context, mask,
                                    num_heads=self.num_heads, causal=self.causal)
        return masked_softmax(scores, allowed)

    def fields(self, x: Float[Array, "n d"]) -> Float[Array, "h n dh"]:
        """Per-head external fields: the input's subspaces (plus FFN(x)), norm R each."""
        if self.field_mlp is not None:
            x = x + jax.vmap(self.field_mlp)(x)
        if self.to_v is not None:
            x = jax.vmap(self.to_v)(x)
        xh = split_heads(x, self.num_heads)
        if self.normalize_fields:
            norm = jnp.sqrt(jnp.sum(xh**2, axis=-1, keepdims=True) + 1e-12)
            xh = self.radius * xh / norm
        return xh

    def head_betas(self) -> Float[Array, " h"]:
        """The inverse temperature of each head `(H,)`: `beta`, times `exp(a_h)` if learned."""
        b = jnp.full((self.num_heads,), self.beta)
        return b if self.log_beta is None else b * jnp.exp(self.log_beta)

    def _gain(self, xh, J=None):
        """The fields `(H, ..., D_h)` and couplings `(H, ...)` the spins feel: the couplings
        times `coupling_scale`, and both times the learned exp(a_h) (the system with β_h
        equals the system with β and fields and couplings scaled by exp(a_h))."""
        if J is not None and self.coupling_scale != 1.0:
            J = J * self.coupling_scale
        if self.log_beta is not None:
            g = jnp.exp(self.log_beta).astype(xh.dtype)
            xh = xh * g.reshape((-1,) + (1,) * (xh.ndim - 1))
            if J is not None:
                J = J * g.reshape((-1,) + (1,) * (J.ndim - 1))
        return xh if J is None else (xh, J)

    def __call__(self, x: Float[Array, "n d"], *, context: Optional[Float[Array, "s d"]] = None,
                 mask: Optional[Bool[Array, "n s"]] = None,
                 state: Optional[Float[Array, "n d"]] = None,
                 key: Optional[PRNGKeyArray] = None, return_diagnostics: bool = False):
        """**Arguments:**

        - `x`: tokens `(n, d)` (the external fields).
        - `context`: `(s, d)` for cross-attention: couplings `softmax(q(x) k(c)ᵀ)`; the context
          spins feel their own fields (the context's subspaces, norm R) and no couplings, and
          their magnetizations act as the previous time step of the query spins, so the
          output is one (first-order or TAP) mean-field step driven by the context.
        - `mask`: boolean `(n, s)`, True where a coupling is allowed (combined with `causal`).
        - `state`: `(n, d)` magnetizations carried from a previous call (`init="carried"`).
        - `key`: unused (no randomness).
        - `return_diagnostics`: also return `Diagnostics` with `couplings` J `(H, n, s)`,
          `magnetizations (H, n, D_h)`, `fields (H, n, D_h)`, `state (n, d)` (the
          magnetizations, to pass as the next call's `state=`), `solver`, the `Stats` per
          head (`num_steps`, `residual`, `result`), and for self-attention
          `delayed_correlations (H, n, n)` and `entropy_production (H,)` (see
          `nonequilibrium`; between the last two time steps in `mode="steps"`).

        **Returns:** `(n, d)` magnetizations (through the output map `out_proj`, built when
        `output_proj=True`), or
        `(output, diagnostics)`.
        """
        del key
        J_out = self.couplings(x, context, mask)
        xh_out = self.fields(x)
        xh, J = self._gain(xh_out, J_out)
        beta, R = self.beta, self.radius

        if context is not None:
            # The context spins are driven by their own fields and feel no couplings; the
            # decoder spins feel them through J as the previous time step's magnetizations.
            ch = self._gain(self.fields(context))
            m_prev = vector.magnetization(ch, beta=beta, R=R)
            m, stats = jax.vmap(lambda xx, jj, cc, mp: self._cross_step(mp, cc, xx, jj))(
                xh, J, ch, m_prev
            )
        else:
            m, m_prev, stats = self._run(xh, J, state)

        out = merge_heads(m)
        y = self._respond(m, xh)
        if return_diagnostics:
            corr = sigma = None
            if context is None:
                corr, sigma = self.nonequilibrium(m, m_prev, J)
            return y, Diagnostics(couplings=J_out, magnetizations=m, fields=xh_out, state=out,
                                  solver=stats, delayed_correlations=corr,
                                  entropy_production=sigma)
        return y

    def nonequilibrium(
        self, m: Float[Array, "h n dh"], m_prev: Float[Array, "h n dh"],
        J: Float[Array, "h n n"],
    ) -> tuple[Float[Array, "h n n"], Float[Array, " h"]]:
        """First-order delayed correlations D_ij,t `(H, n, n)` and entropy production σ_t
        `(H,)` of each head's spins, from the magnetizations at t and t−1 (equal in a
        steady state) and the couplings (`spins.vector.delayed_correlations`,
        `spins.vector.entropy_production`, large-D covariances). σ_t ≥ 0 in a steady state
        and for causal couplings; it may be negative after a time step off the steady
        state (`mode="steps"`)."""
        beta, R = self.beta, self.radius

        def one(mm, mp, jj):
            D = vector.delayed_correlations(mm, mp, jj, beta=beta, R=R)
            return D, vector.entropy_production(jj, D, beta=beta)

        return jax.vmap(one)(m, m_prev, J)

    def _respond(self, m: Float[Array, "h n dh"], xh: Float[Array, "h n dh"]
                 ) -> Float[Array, "n d"]:
        """The layer's output `(n, d)` from the magnetizations and gained fields of every
        head: the `output` choice, heads merged, through `out_proj` when there is one."""
        y = merge_heads(self._output(m, xh))
        return jax.vmap(self.out_proj)(y) if self.out_proj is not None else y

    def _output(self, m, xh):
        """The `output` choice from the magnetizations `m` and the gained fields `xh` (same
        shape, any leading axes): m, or m − φ(x) for `output="response"`."""
        if self.output == "response":
            return m - vector.magnetization(xh, beta=self.beta, R=self.radius)
        return m

    # -- the spin dynamics, every head -----------------------------------------------------

    def _run(self, xh, J, state):
        """The magnetizations `(H, n, D_h)` of the gained fields `xh (H, n, D_h)` and
        couplings `J (H, n, n)`, those one step earlier (equal in a steady state) and the
        per-head solver `Stats`: the steady state, or `num_steps` time steps (`mode`)."""
        if self.mode == "steps":
            return self._steps(xh, J, state)[:3]
        m, stats = jax.vmap(self._steady_state)(xh, J)
        return m, m, stats

    def _steps(self, xh, J, state):
        """`_time_steps` of every head from the `init` state: `(m, m_prev, stats, levels
        (H, K, n, D_h))`."""
        m0 = self._initial(xh, state)  # φ of the gained fields
        return jax.vmap(lambda xx, jj, m0_: self._time_steps(m0_, xx, jj))(xh, J, m0)

    def _initial(self, xh, state):
        """`(H, n, D_h)` initial magnetizations of `mode="steps"` (the `init` choice) for the
        gained fields `xh (H, n, D_h)` and the caller's `state (n, d)` or None."""
        if self.init == "learned":
            h, n, dh = xh.shape
            return jnp.broadcast_to(self.m_init[:, None, :], (h, n, dh)).astype(xh.dtype)
        if self.init == "carried" and state is not None:
            n = xh.shape[1]
            if state.shape != (n, self.dim):
                raise ValueError(
                    f"SpinAttention: state must have shape ({n}, {self.dim}) like x; got "
                    f"{state.shape}. Pass the previous call's diagnostics.state."
                )
            return split_heads(state, self.num_heads)
        return vector.magnetization(xh, beta=self.beta, R=self.radius)

    # -- the spin dynamics, one head -------------------------------------------------------

    def _solve_kwargs(self):
        return dict(solver=self.solver, adjoint=self.adjoint, throw=self.throw)

    def _one_step(self, m_prev, x, J):
        """One mean-field time step m_t = update(m_{t-1}), and its solver `Stats`."""
        return self.update.step(m_prev, x, J, beta=self.beta, R=self.radius,
                                solve=self._solve_kwargs())

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

    def _steady_state(self, x, J):
        """The NESS m* = update(m*, m*) solved as a fixed point, started at φ(x)."""
        sol = self.update.ness(x, J, beta=self.beta, R=self.radius, **self._solve_kwargs())
        return sol.value, Stats.of(sol)

    def _time_steps(self, m0, x, J):
        """K time steps from m0: the last magnetizations, those one step before, stats
        (total inner solver steps, last change, worst result) and the states before each
        step `(K, n, D_h)` (what incremental decoding caches; unused ones cost nothing)."""

        def body(carry, _):
            m, steps, result = carry
            m_new, st = self._one_step(m, x, J)
            return (m_new, steps + st.num_steps, jnp.maximum(result, st.result)), m

        zero = jnp.asarray(0, jnp.int32)
        # A few steps run as straight-line code: in a loop, the backward pass accumulates
        # the couplings' (n, n) cotangent in the loop's carry and transposes J in every
        # iteration; unrolled, XLA fuses across the steps, which makes the layer's forward
        # + backward faster.
        (m, steps, result), levels = jax.lax.scan(
            body, (m0, zero, zero), None, length=self.num_steps,
            unroll=self.num_steps <= _UNROLL_STEPS)
        m_prev = levels[-1]
        return m, m_prev, Stats(steps, jnp.max(jnp.abs(m - m_prev)), result), levels

    # -- incremental decoding (see nn.decode_step) -----------------------------------------
    #
    # With causal couplings spin i feels only spins j <= i, so the steady state (or each time
    # step) of the first i spins does not depend on the later ones: position i's
    # magnetizations solve a D_h-dimensional fixed point given the cached magnetizations of
    # positions < i. This is exact when every solve is exact; the whole-sequence solve
    # (`__call__`) stops when the residual of all positions together is below `tol`, so the
    # two agree to the solver tolerance, not bit for bit (see `decode`).

    def decode_init(self, max_len: int, dtype=jnp.float32) -> dict:
        """An empty cache for `max_len` positions: keys `k (H, max_len, D_h)`, the cached
        magnetizations `m` (`(H, max_len, D_h)` steady states for `mode="fixed_point"`;
        `(K, H, max_len, D_h)`, time steps 0..K−1, for `mode="steps"`) and `failures`, the
        number of solves so far that did not converge."""
        H, dh = self.num_heads, self.head_dim
        levels = (self.num_steps,) if self.mode == "steps" else ()
        return {"k": jnp.zeros((H, max_len, dh), dtype),
                "m": jnp.zeros((*levels, H, max_len, dh), dtype),
                "failures": jnp.zeros((), jnp.int32)}

    def decode(self, x: Float[Array, " d"], cache: dict, pos: Int[Array, ""]
               ) -> tuple[Float[Array, " d"], dict]:
        """The output at position `pos` given the cache of positions `< pos`: `(y (d,),
        cache)`. Row `pos` of `__call__` on the whole prefix up to the solver tolerance:
        position `pos`'s fixed point is solved on its own, to `tol` in its own residual, from
        the cached magnetizations of the earlier positions (which were solved the same way).
        With `init="carried"` decoding starts from φ(x) like a call without `state=`."""
        scores, visible, cache = decode_scores(self, x, cache, pos, self.causal)
        J = masked_softmax(scores[:, None], visible[None])[:, 0]  # (H, L), zero after pos
        xh = self.fields(x[None])[:, 0]  # (H, D_h)
        xh, J = self._gain(xh, J)
        m, new_m, failed = self._decode_position(xh, J, cache["m"], pos)
        out = self._output(m, xh).reshape(-1)
        y = self.out_proj(out) if self.out_proj is not None else out
        return y, {**cache, "m": new_m, "failures": cache["failures"] + failed}

    def prefill(self, x: Float[Array, "L d"]) -> tuple[Float[Array, "L d"], dict]:
        """Every position at once (the whole-sequence solve of `__call__`) and the decoding
        cache `decode` would have built over the same `L` positions, to the solver
        tolerance: `(y (L, d), cache)`, cache length L. Restarting a generation window this
        way costs one sequence call instead of L decoding steps. Positions past the prompt
        are harmless: `decode` writes over them and never looks at positions after its
        own (with causal couplings the earlier positions' solution does not depend on them,
        though the whole-sequence solve iterates until they too have converged)."""
        if not self.causal:
            raise ValueError("SpinAttention.prefill: incremental decoding needs causal "
                             "attention; build the model with causal=True.")
        xh, J = self._gain(self.fields(x), self.couplings(x))
        if self.mode == "steps":
            # the levels are the states before each step, as `decode` stores them
            m, _, stats, levels = self._steps(xh, J, None)
            M = jnp.moveaxis(levels, 1, 0)
        else:
            m, _, stats = self._run(xh, J, None)
            M = m
        failed = _failed(stats)
        y = self._respond(m, xh)
        k = split_heads(jax.vmap(self.to_k)(x), self.num_heads)
        return y, {"k": k.astype(x.dtype), "m": M.astype(x.dtype), "failures": failed}

    def _decode_position(self, xh, J, M, pos):
        """One new position's magnetizations `(H, D_h)` from its gained fields `xh (H, D_h)`,
        couplings `J (H, L)` and the cache's magnetizations `M`: `(m, new M, failed solves)`.
        `mode="fixed_point"` solves its steady state; `mode="steps"` takes the time steps,
        writing the state before each into `M (K, H, L, D_h)`."""
        if self.mode == "steps":
            # the initial state: the trained vector, else φ of the gained fields
            if self.init == "learned":
                m = self.m_init.astype(xh.dtype)
            else:
                m = vector.magnetization(xh, beta=self.beta, R=self.radius)
            failed = jnp.zeros((), jnp.int32)
            for k in range(self.num_steps):
                # time step k of positions <= pos, written into the cache in place (building
                # the levels anew and stacking them copied the whole cache: on a GPU each
                # copy is a kernel of a decode step's few hundred)
                M = M.at[k, :, pos].set(m)
                m, f = jax.vmap(self._decode_step)(xh, J, M[k])
                failed = failed + jnp.sum(f)
            return m, M, failed
        m, failed = jax.vmap(lambda xx, jj, MM: self._decode_ness(xx, jj, MM, pos))(xh, J, M)
        return m, M.at[:, pos].set(m), jnp.sum(failed)

    def _decode_ness(self, x, J, M, pos):
        """Steady state of one head's position `pos`: m = F(m) with the other rows of the
        steady-state map fixed at the cached `M (L, D_h)`; returns `(m (D_h,), failed)`."""
        beta, R = self.beta, self.radius
        # the other rows' part of the field, summed once: an iteration then writes no
        # (L, D_h) array (mean field: elementwise; TAP: two (L, D_h) products, not three)
        ctx = self.update.row_context(M, x, J, pos, beta=beta, R=R)

        def row_map(m, ctx_):
            theta = self.update.context_field(m, ctx_, beta=beta, R=R)
            return vector.magnetization(theta, beta=beta, R=R)

        m0 = vector.magnetization(x, beta=beta, R=R)
        sol = solvers.fixed_point(row_map, m0, ctx, **self._solve_kwargs())
        return sol.value, _failed(sol)

    def _decode_step(self, x, J, M_prev):
        """One time step of one head's newest position given all positions' previous
        magnetizations `M_prev (L, D_h)`; returns `(m (D_h,), failed)`."""
        return self.update.decode_step(x, J, M_prev, beta=self.beta, R=self.radius,
                                       solve=self._solve_kwargs())
