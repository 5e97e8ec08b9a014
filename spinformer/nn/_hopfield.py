"""Modern Hopfield attention: each query is a state pattern that retrieves from the keys,
the stored patterns (H. Ramsauer et al., "Hopfield Networks is All You Need", ICLR 2021,
arXiv:2008.02217; the physics is `spinformer.spins.hopfield`).

Per head h and query i the state ξ starts at the query q_hi, the stored patterns are the
keys k_hj the query may see, and β = `beta`/√D_h. The update ξ ← K_hᵀ softmax(β K_h ξ)
lowers the Hopfield energy E(ξ) = −lse(β, K_h ξ) + ½|ξ|² + const; the output reads the
values with the weights of the retrieved state, softmax(β K_h ξ*)·V_h. The dynamics
(`mode`):

- `"one_step"`: no update, ξ* = q: exactly softmax attention with the same projections
  (tested);
- `"steps"`: `num_steps` updates, backpropagated;
- `"fixed_point"`: the fixed point of the update (a stationary point of E), solved for all
  queries of a head together with `solver` and differentiated with `adjoint`, its forward
  steps and backward products recorded like every solved attention.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal, Optional

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from .. import solvers
from .._schema import ConfigError, check_solvers, check_values, option, register_attention
from ..spins import hopfield as hp
from ._attention_diagnostics import Diagnostics, Stats
from ._heads import check_heads, check_shapes, linear_maps, mix_values, project_heads
from ._literal import check_literal
from ._masks import combine_masks

def _update(xi, args):
    """The Hopfield update of every query's state `xi (n, D_h)` at once, over the keys
    `K (s, D_h)` each may see (`spins.hopfield.update`, `allowed (n, s)` or None)."""
    K, beta, allowed = args
    return hp.update(xi, K, beta=beta, mask=allowed)


#: How far the state patterns move before the read-out (`mode=`): `"fixed_point"` (the
#: fixed point ξ* = Kᵀ softmax(β K ξ*), solved and differentiated with the solver and
#: adjoint), `"steps"` (`num_steps` updates from the query, backpropagated: an unrolled scan)
#: or `"one_step"` (no update: the query is the state, and the layer is softmax attention).
HopfieldMode = Literal["fixed_point", "steps", "one_step"]


@dataclasses.dataclass(frozen=True)
class HopfieldConfig:
    """Settings of modern Hopfield attention: a config's `model.attention: {name: hopfield, ...}`."""

    beta: float = option(1.0, "inverse temperature in units of 1/sqrt(D_h) (1: the scale of "
                         "softmax attention; larger: retrieval of single keys)")
    mode: HopfieldMode = option("fixed_point", "fixed_point: retrieve to the update's fixed point; "
                       "steps: num_steps updates; one_step: no update (softmax attention)")
    num_steps: int = option(1, "steps mode: updates of each query's state")
    solver: solvers.AbstractSolver = option(
        solvers.Picard(tol=1e-3, max_steps=100),
        "fixed_point: the retrieval's solver (picard: the plain updates, which never raise "
        "the energy)", kind="solver")
    adjoint: solvers.AbstractAdjoint = option(
        solvers.Phantom(),
        "fixed_point: how gradients flow through the retrieval (phantom: 5 damped updates "
        "backpropagated; implicit fails near the retrieval's bifurcations, see the class)", kind="adjoint")

    def __post_init__(self):
        if not self.beta > 0:
            raise ConfigError(f"beta={self.beta} must be > 0.")
        if not self.num_steps >= 1:
            raise ConfigError(f"num_steps={self.num_steps} must be >= 1.")
        check_solvers(self)


# the constructor's defaults are the settings' (one source of defaults)
_DEFAULTS = HopfieldConfig()


@register_attention("hopfield", config=HopfieldConfig, help="modern Hopfield retrieval",
                    coupling_fields=("to_q", "to_k"))
class HopfieldAttention(eqx.Module):
    """Multi-head modern Hopfield attention; one example per call.

    **Arguments:**

    - `dim`: model width D; `num_heads`: H (D divisible by H); `causal`: query i retrieves
      only from keys j ≤ i (each query's retrieval sees its visible keys only, so the layer
      stays causal).
    - `beta`: β·√D_h, the inverse temperature in units of softmax attention's 1/√D_h.
    - `mode`: `"fixed_point"`, `"steps"` or `"one_step"`: how far each query's state moves
      before the read-out (see the module docstring).
    - `num_steps`: updates in `"steps"` mode.
    - `solver`, `adjoint`, `throw`: the retrieval's solve (defaults: `HopfieldConfig.solver`, a
      Picard iteration, and `HopfieldConfig.adjoint`, the phantom gradient); `throw=False` (the
      default) reports a failed retrieval in the diagnostics instead of raising. Why not
      `Implicit()`: on bracket matching (configs/brackets_hopfield.yaml) training moves the
      learned queries and keys to where retrievals sit near bifurcations of the update (its
      Jacobian β Kᵀ(diag p − ppᵀ)K nears an eigenvalue 1), where the implicit backward solve
      misses its tolerance and gives NaN gradients, so most training steps are skipped; phantom
      gradients (and `mode="steps"`) stay finite there and learn the task as softmax does
      (docs/families/hopfield.md has the run).
    - `use_bias`: biases on the q/k/v/out maps.
    - `key`: PRNG key.
    """

    to_q: eqx.nn.Linear
    to_k: eqx.nn.Linear
    to_v: eqx.nn.Linear
    to_out: eqx.nn.Linear
    beta: float
    solver: solvers.AbstractSolver
    adjoint: solvers.AbstractAdjoint
    dim: int = eqx.field(static=True)
    num_heads: int = eqx.field(static=True)
    causal: bool = eqx.field(static=True)
    mode: HopfieldMode = eqx.field(static=True)
    num_steps: int = eqx.field(static=True)
    throw: bool = eqx.field(static=True)

    def __init__(
        self, dim: int, num_heads: int = 1, causal: bool = False, *,
        beta: float = _DEFAULTS.beta,
        mode: HopfieldMode = _DEFAULTS.mode,
        num_steps: int = _DEFAULTS.num_steps,
        solver: solvers.AbstractSolver = _DEFAULTS.solver,
        adjoint: solvers.AbstractAdjoint = _DEFAULTS.adjoint,
        throw: bool = False,
        use_bias: bool = False,
        key: PRNGKeyArray,
    ):
        check_heads("HopfieldAttention", dim, num_heads)
        check_values(HopfieldConfig, "HopfieldAttention", beta=beta, num_steps=num_steps)
        self.to_q, self.to_k, self.to_v, self.to_out = linear_maps(
            dim, use_bias, *jax.random.split(key, 4))
        self.beta, self.solver, self.throw = beta, solver, throw
        self.adjoint = adjoint
        self.mode = check_literal("HopfieldAttention", "mode", mode, HopfieldMode)
        self.num_steps = num_steps
        self.dim, self.num_heads, self.causal = dim, num_heads, causal

    def _retrieve(self, q: Float[Array, "n dh"], K: Float[Array, "s dh"], beta: Array,
                  allowed: Optional[Bool[Array, "n s"]]) -> tuple[Array, Stats]:
        """The retrieved states `(n, D_h)` of one head from its queries `q (n, D_h)` and keys
        `K (s, D_h)` as `mode` says, and the solver `Stats`."""
        if self.mode == "fixed_point":
            sol = solvers.fixed_point(_update, q, (K, beta, allowed), solver=self.solver,
                                      adjoint=self.adjoint, throw=self.throw)
            return sol.value, Stats.of(sol)
        if self.mode == "steps":
            def body(xi, _):
                return _update(xi, (K, beta, allowed)), None

            xi, _ = jax.lax.scan(body, q, None, length=self.num_steps)
            none = Stats.none((), q.dtype)
            return xi, Stats(none.num_steps + self.num_steps, none.residual, none.result)
        return q, Stats.none((), q.dtype)

    @property
    def head_beta(self) -> float:
        """β = beta/√D_h, the inverse temperature of each head's Hopfield energy."""
        return self.beta / math.sqrt(self.dim // self.num_heads)

    def __call__(self, x: Float[Array, "n d"], *, context: Optional[Float[Array, "s d"]] = None,
                 mask: Optional[Bool[Array, "n s"]] = None, state: None = None,
                 key: Optional[PRNGKeyArray] = None, return_diagnostics: bool = False):
        """**Arguments:** `x (n, d)`; `context (s, d)` (the stored patterns come from it;
        default `x`); `mask (n, s)`, True where query i may retrieve key j (combined with
        `causal`); `state`, `key`: unused; `return_diagnostics`: also return `Diagnostics`
        with `weights (H, n, s)` (of the retrieved states), `magnetizations (H, n, D_h)`
        (the retrieved states ξ*) and the per-head solver `Stats`.

        **Returns:** `(n, d)`, or `((n, d), diagnostics)`.
        """
        del state, key
        ctx = x if context is None else context
        check_shapes("HopfieldAttention", x, ctx, self.dim)
        q = project_heads(self.to_q, x, self.num_heads)
        k = project_heads(self.to_k, ctx, self.num_heads)
        v = project_heads(self.to_v, ctx, self.num_heads)
        allowed = combine_masks(x.shape[0], ctx.shape[0], self.causal and context is None, mask)
        beta = jnp.asarray(self.head_beta, q.dtype)
        xi, stats = jax.vmap(lambda qq, kk: self._retrieve(qq, kk, beta, allowed))(
            q, k)
        weights = jax.vmap(lambda s, kk: hp.weights(s, kk, beta=beta, mask=allowed))(xi, k)
        out = jax.vmap(self.to_out)(mix_values(weights, v))
        if return_diagnostics:
            return out, Diagnostics(weights=weights, magnetizations=xi, solver=stats)
        return out

    # -- incremental decoding (see nn.decode_step) -----------------------------------------
    #
    # A causal query's retrieval sees only the keys up to its position, so position `pos`'s
    # state solves its own fixed point from the cached keys: row `pos` of `__call__` up to the
    # solver tolerance (the whole-sequence solve stops on the residual of all rows together).

    def decode_init(self, max_len: int, dtype=jnp.float32) -> dict:
        """An empty cache for `max_len` positions: keys and values `(H, max_len, D_h)` and
        `failures`, the number of retrievals so far that did not converge."""
        shape = (self.num_heads, max_len, self.dim // self.num_heads)
        return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype),
                "failures": jnp.zeros((), jnp.int32)}

    def decode(self, x: Float[Array, " d"], cache: dict, pos: Int[Array, ""]
               ) -> tuple[Float[Array, " d"], dict]:
        """The output at position `pos` given the cache of positions `< pos`: `(y (d,),
        cache)`."""
        if not self.causal:
            raise ValueError("HopfieldAttention: incremental decoding needs causal attention; "
                             "build the model with causal=True.")
        H = self.num_heads
        q = self.to_q(x).reshape(H, 1, -1)
        k = cache["k"].at[:, pos].set(self.to_k(x).reshape(H, -1))
        v = cache["v"].at[:, pos].set(self.to_v(x).reshape(H, -1))
        visible = (jnp.arange(k.shape[1]) <= pos)[None]
        beta = jnp.asarray(self.head_beta, q.dtype)
        xi, stats = jax.vmap(lambda qq, kk: self._retrieve(qq, kk, beta, visible))(
            q, k)
        w = jax.vmap(lambda s, kk: hp.weights(s, kk, beta=beta, mask=visible))(xi, k)[:, 0]
        y = self.to_out(jnp.einsum("hs,hsk->hk", w, v).reshape(-1))
        failed = jnp.sum(stats.result != solvers.RESULTS.successful).astype(jnp.int32)
        return y, {**cache, "k": k, "v": v, "failures": cache["failures"] + failed}
