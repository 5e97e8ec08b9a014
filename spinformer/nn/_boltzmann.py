r"""Boltzmann attention: attention weights are the magnetizations of an Ising model over key
positions with learnable, input-independent couplings (G. Kim, D. K. Park, "Boltzmann
Attention: Learnable Ising Couplings for Cooperative Attention", arXiv:2606.12478 (2026)).

For query i and head h the attention pattern s ∈ {−1, +1}^T over the visible key positions
follows (Eq. 8, three-body term from Appendix C)

    P_i(s) ∝ exp( Σ_j h_ij s_j + Σ_{j<k} J_jk s_j s_k + Σ_{j<k<l} K_jkl s_j s_k s_l ),

with fields h_ij = q_i·k_j/√d_k and couplings J (K) shared by all queries and examples. The
weights are α_ij = (⟨s_j⟩_i + 1)/2 (Eq. 9), normalised over the visible positions, and the
output is Σ_j α̃_ij v_j as in softmax attention. With causal masking query i sees positions
j ≤ i and the couplings act only among them.

Modes (the paper's ablation): `softmax` (the baseline, no spins), `h` (J = 0: sigmoid
attention, α = σ(2h), computed in closed form), `hJ` (the proposed model), `J` (h = 0),
and the three-body variants `hK`, `hJK`, `JK`, `K`.

Note on `J` alone: with h = 0 and no K the energy is even under s → −s, so ⟨s_j⟩ = 0 for
every J and the attention is exactly uniform over the visible positions — J receives zero
gradient. Only K breaks that symmetry (modes `JK`, `K`).

Inference: `exact` (enumeration, `spins.ising.boltzmann_marginals`; exact gradients),
`mean_field` / `tap` (fixed points with implicit gradients), and the samplers `gibbs`,
`parallel_tempering`, `dqa` (simulated diabatic quantum annealing, T ≤ 12) of
`spins.samplers`, whose sample means carry straight-through gradients (see
`BoltzmannAttention`).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, PRNGKeyArray

from .. import solvers
from .._schema import ConfigError, option
from ..spins import ising, samplers
from ._diagnostics import Diagnostics, Stats
from ._heads import (check_heads, decode_scores, linear_maps, masked_softmax, mix_values,
                     project_heads, qk_scores)
from ._registry import register_attention

MODES = ("softmax", "hJ", "h", "J", "hK", "hJK", "JK", "K")
INFERENCES = ("exact", "mean_field", "tap", "gibbs", "parallel_tempering", "dqa")
_SAMPLERS = ("gibbs", "parallel_tempering", "dqa")


@dataclasses.dataclass(frozen=True)
class BoltzmannConfig:
    """Options of Boltzmann attention (the config section `model.boltzmann`)."""

    mode: str = option("hJ", "energy terms: hJ (fields + learnable couplings J), h (J=0: "
                       "sigmoid attention), J (h=0), softmax (plain softmax, for ablations), or "
                       "the three-body variants hK, hJK, JK, K", MODES)
    inference: str = option("exact", "how magnetizations are computed: exact (enumeration, "
                            "T<=24), mean_field, tap, gibbs, parallel_tempering, dqa (T<=12)",
                            INFERENCES)
    init_scale: float = option(0.0, "standard deviation of the initial couplings J (and K); "
                               "0 starts at sigmoid attention")
    num_samples: int = option(256, "samplers: samples per query and head")
    burn_in: int = option(32, "gibbs/parallel_tempering: sweeps discarded before sampling")
    dqa_steps: int = option(200, "dqa: Trotter steps of the simulated anneal")
    dqa_time: float = option(5.0, "dqa: total anneal time")
    solver: solvers.SolverOptions = option(
        solvers.SolverOptions(name="anderson", tol=1e-4, max_steps=100),
        "mean_field/tap: the fixed-point solver")
    adjoint: solvers.AdjointOptions = option(
        solvers.AdjointOptions(), "mean_field/tap: how gradients flow through the fixed point")

    _MOVED = {"tol": "solver.tol", "max_steps": "solver.max_steps"}

    def __post_init__(self):
        if not (self.num_samples >= 1 and self.dqa_steps >= 1):
            raise ConfigError("num_samples and dqa_steps must be >= 1.")
        if not (self.burn_in >= 0 and self.init_scale >= 0):
            raise ConfigError("burn_in and init_scale must be >= 0.")
        if not self.dqa_time > 0:
            raise ConfigError(f"dqa_time={self.dqa_time} must be > 0.")
        solvers.check_options(self)


# the constructor's defaults are the config section's (one source of defaults)
_DEFAULTS = BoltzmannConfig()


def _uses(mode: str) -> tuple[bool, bool, bool]:
    """(fields h, pair couplings J, three-body K) used by a mode."""
    if mode == "softmax":
        return True, False, False
    return "h" in mode, "J" in mode, "K" in mode


# Added to every visible α before normalising: float32 magnetizations near −1 round to α = 0
# (or to −1e-6: the enumeration's sums round too), and a query whose every α vanishes would
# divide 0 by 0, with NaN gradients (seen in training). Negligible whenever Σα ≫ T·1e-6.
_ALPHA_EPS = 1e-6


def normalized_weights(m, visible=1.0):
    """Attention weights α̃_ij = α_ij / Σ_k α_ik from magnetizations, α = (⟨s⟩ + 1)/2 (Kim
    and Park, Eq. 9), over the visible positions (`visible` 1/0, broadcast against `m (..., s)`).
    α is clipped to [0, 1] and given a floor of 1e-6, so a query whose magnetizations all
    sit at −1 attends uniformly instead of dividing by zero (a query that sees no position
    gets zero weights)."""
    alpha = (jnp.clip(0.5 * (m + 1.0), 0.0, 1.0) + _ALPHA_EPS) * visible
    total = jnp.sum(alpha, axis=-1, keepdims=True)
    return alpha / jnp.where(total > 0, total, 1.0)  # a query that sees nothing: all zero


# The Ising couplings form the optimizer group "couplings", with their own learning rate and
# weight decay (Kim and Park §4.1: LR_J).
@register_attention("boltzmann", config=BoltzmannConfig, takes_max_len=True,
                    help="Ising model over key positions", coupling_fields=("J", "K"))
class BoltzmannAttention(eqx.Module):
    """Multi-head Boltzmann attention (one example per call).

    **Arguments:**

    - `dim`: model width D; `num_heads`: H (D divisible by H, d_k = D/H).
    - `causal`: query i sees key positions j ≤ i (self-attention only).
    - `max_len`: the longest key sequence; J is a learnable `(H, max_len, max_len)` array
      (and K `(H, max_len, max_len, max_len)`), indexed by absolute position. Sequences
      shorter than `max_len` use the leading block.
    - `mode`: one of `"softmax", "hJ", "h", "J", "hK", "hJK", "JK", "K"` (which energy terms
      are present; `"softmax"` is plain softmax attention).
    - `inference`: how the magnetizations ⟨s_j⟩_i are computed:
      `"exact"` — enumeration of all 2^T configurations (T ≤ 24; exact gradients);
      `"mean_field"` — naive mean field m = tanh(h + J m [+ ½ K:mm]), solved with `solver`,
      implicit gradients; `"tap"` — TAP (Onsager-corrected) mean field, no K;
      `"gibbs"`, `"parallel_tempering"`, `"dqa"` — sample means from `spins.samplers`
      (DQA: Trotterised transverse-field anneal, T ≤ 12), with straight-through gradients
      from the surrogate m̃ = tanh(h + J m̂ [+ ½ K:m̂m̂]) evaluated at the (gradient-stopped)
      sample mean m̂ — one mean-field step, exact when the couplings vanish.
    - `init_scale`: standard deviation of the initial couplings (0: start at J = 0, i.e. at
      sigmoid attention).
    - `num_samples`, `burn_in`: sampler settings (per query and head; sweeps for Gibbs and
      parallel tempering, measurements for DQA).
    - `betas`: inverse temperatures of the parallel-tempering replicas (target β = 1 first).
    - `dqa_steps`, `dqa_time`, `dqa_gamma`: Trotter steps, anneal time and transverse field
      (Kim and Park §4.5: 200 steps, τ = 5).
    - `solver`, `adjoint`, `throw`: for `mean_field` / `tap` (the solver carries the
      tolerance and step budget; default `Anderson(tol=1e-4, max_steps=100)`).
    - `use_bias`: biases on the q/k/v/out projections.
    - `key`: PRNG key.

    Samplers need randomness: pass `key=` when calling (training); without a key a fixed
    key is used, so evaluation is deterministic.
    """

    to_q: eqx.nn.Linear
    to_k: eqx.nn.Linear
    to_v: eqx.nn.Linear
    to_out: eqx.nn.Linear
    J: Optional[Float[Array, "h L L"]]
    K: Optional[Float[Array, "h L L L"]]
    solver: solvers.AbstractSolver
    adjoint: solvers.AbstractAdjoint
    dim: int = eqx.field(static=True)
    num_heads: int = eqx.field(static=True)
    causal: bool = eqx.field(static=True)
    max_len: int = eqx.field(static=True)
    mode: str = eqx.field(static=True)
    inference: str = eqx.field(static=True)
    num_samples: int = eqx.field(static=True)
    burn_in: int = eqx.field(static=True)
    betas: tuple[float, ...] = eqx.field(static=True)
    dqa_steps: int = eqx.field(static=True)
    dqa_time: float = eqx.field(static=True)
    dqa_gamma: float = eqx.field(static=True)
    throw: bool = eqx.field(static=True)

    def __init__(
        self, dim: int, num_heads: int = 1, causal: bool = False, *,
        max_len: int,
        mode: str = _DEFAULTS.mode,
        inference: str = _DEFAULTS.inference,
        init_scale: float = _DEFAULTS.init_scale,
        num_samples: int = _DEFAULTS.num_samples,
        burn_in: int = _DEFAULTS.burn_in,
        betas: tuple[float, ...] = (1.0, 0.7, 0.5, 0.3),
        dqa_steps: int = _DEFAULTS.dqa_steps,
        dqa_time: float = _DEFAULTS.dqa_time,
        dqa_gamma: float = 1.0,
        solver: solvers.AbstractSolver = _DEFAULTS.solver.build(),
        adjoint: solvers.AbstractAdjoint = _DEFAULTS.adjoint.build(),
        throw: bool = True,
        use_bias: bool = False,
        key: PRNGKeyArray,
    ):
        name = "BoltzmannAttention"
        check_heads(name, dim, num_heads)
        if mode not in MODES:
            raise ValueError(f"{name}: mode={mode!r}; choose one of {MODES}.")
        if inference not in INFERENCES:
            raise ValueError(f"{name}: inference={inference!r}; choose one of {INFERENCES}.")
        if not isinstance(max_len, int) or max_len < 1:
            raise ValueError(f"{name}: max_len={max_len!r} must be a positive int (the "
                             "longest key sequence; J has shape (H, max_len, max_len)).")
        uses_h, uses_J, uses_K = _uses(mode)
        # modes softmax, h and J have closed forms: no inference, so no length limits
        if uses_K or (uses_h and uses_J):
            if inference == "exact" and max_len > ising.MAX_BOLTZMANN_T:
                raise ValueError(
                    f"{name}: exact inference enumerates 2^T configurations and is limited to "
                    f"max_len <= {ising.MAX_BOLTZMANN_T}, got {max_len}; use "
                    "inference='mean_field', 'tap', 'gibbs' or 'parallel_tempering'.")
            if inference == "dqa" and max_len > samplers.MAX_DQA:
                raise ValueError(
                    f"{name}: simulated DQA holds a 2^T state vector and is limited to "
                    f"max_len <= {samplers.MAX_DQA}, got {max_len}; use 'gibbs' or "
                    "'parallel_tempering' for longer sequences.")
            if inference == "tap" and uses_K:
                raise ValueError(
                    f"{name}: TAP equations are implemented for pairwise couplings only; "
                    f"mode={mode!r} has three-body K. Use inference='mean_field', 'exact' or a "
                    "sampler.")
        for what, v, lo in (("num_samples", num_samples, 1), ("burn_in", burn_in, 0),
                            ("dqa_steps", dqa_steps, 1)):
            if not isinstance(v, int) or v < lo:
                raise ValueError(f"{name}: {what}={v!r} must be an int >= {lo}.")
        betas = tuple(float(b) for b in betas)
        if inference == "parallel_tempering" and (len(betas) < 2 or betas[0] != 1.0):
            raise ValueError(f"{name}: betas={betas} must hold >= 2 inverse temperatures "
                             "starting with the target 1.0, e.g. (1.0, 0.7, 0.5, 0.3).")
        if init_scale < 0:
            raise ValueError(f"{name}: init_scale={init_scale} must be >= 0.")
        kq, kk, kv, ko, kj, kK = jax.random.split(key, 6)
        self.to_q, self.to_k, self.to_v, self.to_out = linear_maps(dim, use_bias, kq, kk, kv, ko)
        L, H = max_len, num_heads
        self.J = (ising.symmetrize(init_scale * jax.random.normal(kj, (H, L, L)))
                  if uses_J else None)
        self.K = init_scale * jax.random.normal(kK, (H, L, L, L)) if uses_K else None
        # the adjoint records its backward solves (see solvers.record_backward)
        self.solver, self.throw = solver, throw
        self.adjoint = solvers.record_backward(adjoint)
        self.dim, self.num_heads, self.causal, self.max_len = dim, num_heads, causal, max_len
        self.mode, self.inference = mode, inference
        self.num_samples, self.burn_in, self.betas = num_samples, burn_in, betas
        self.dqa_steps, self.dqa_time, self.dqa_gamma = dqa_steps, float(dqa_time), float(
            dqa_gamma)

    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads

    # -- the energy -------------------------------------------------------------------------

    def fields(self, x: Float[Array, "n d"], context: Optional[Float[Array, "s d"]] = None
               ) -> Float[Array, "h n s"]:
        """Local fields h_ij = q_i·k_j/√d_k per head, `(H, n, s)` (zero in modes without h)."""
        return self._fields_and_mask(x, context, None)[0]

    def _fields_and_mask(self, x, context, mask):
        h, allowed = qk_scores("BoltzmannAttention", self.to_q, self.to_k, x, context, mask,
                               num_heads=self.num_heads, causal=self.causal)
        return (h if _uses(self.mode)[0] else jnp.zeros_like(h)), allowed

    def couplings(self, s: int, dtype=jnp.float32):
        """The couplings used for `s` key positions: `J (H, s, s)` (symmetric, zero diagonal)
        and `K (H, s, s, s)` (only entries j < k < l matter), each None if the mode has none."""
        if s > self.max_len:
            raise ValueError(
                f"BoltzmannAttention: {s} key positions exceed max_len={self.max_len}; build "
                "the module with a larger max_len.")
        J = None if self.J is None else ising.symmetrize(self.J[:, :s, :s].astype(dtype))
        K = None if self.K is None else self.K[:, :s, :s, :s].astype(dtype)
        return J, K

    # -- forward ----------------------------------------------------------------------------

    def __call__(self, x: Float[Array, "n d"], *, context: Optional[Float[Array, "s d"]] = None,
                 mask: Optional[Bool[Array, "n s"]] = None, state: None = None,
                 key: Optional[PRNGKeyArray] = None, return_diagnostics: bool = False):
        """**Arguments:**

        - `x`: tokens `(n, d)`.
        - `context`: keys/values `(s, d)` for cross-attention (the spins sit on the context
          positions); defaults to `x`.
        - `mask`: boolean `(n, s)`, True where query i may attend to position j (combined
          with `causal`); the spins of hidden positions are removed from query i's model.
        - `state`: unused (interface compatibility).
        - `key`: PRNG key for the samplers (a fixed key if None).
        - `return_diagnostics`: also return `Diagnostics` with `weights` α̃ `(H, n, s)`,
          `magnetizations` ⟨s⟩ `(H, n, s)` (0 at hidden positions), `fields` h `(H, n, s)`
          and, for `mean_field`/`tap`, `solver` statistics `(H, n)`.

        **Returns:** `(n, d)`, or `((n, d), diagnostics)`.
        """
        del state
        h, allowed = self._fields_and_mask(x, context, mask)
        self_causal = self.causal and context is None
        stats = None
        if self.mode == "softmax":
            weights = masked_softmax(h, allowed)
            m = 2.0 * weights - 1.0
        else:
            if mask is None:  # the structured patterns exact inference exploits
                m, stats = self.magnetizations(h, None, causal=self_causal, key=key)
            else:
                m, stats = self.magnetizations(h, allowed, key=key)
            vis = 1.0 if allowed is None else allowed.astype(h.dtype)
            weights = normalized_weights(m, vis)
        v_HxSxK = project_heads(self.to_v, x if context is None else context, self.num_heads)
        out = jax.vmap(self.to_out)(mix_values(weights, v_HxSxK))
        if return_diagnostics:
            return out, Diagnostics(weights=weights, magnetizations=m, fields=h, solver=stats)
        return out

    # -- incremental decoding (see nn.decode_step) -----------------------------------------

    def decode_init(self, max_len: int, dtype=jnp.float32) -> dict:
        """An empty cache for `max_len` positions (at most the module's `max_len`): keys and
        values `(H, max_len, D_h)`."""
        if max_len > self.max_len:
            raise ValueError(f"BoltzmannAttention: a cache of {max_len} positions exceeds "
                             f"max_len={self.max_len}.")
        shape = (self.num_heads, max_len, self.head_dim)
        return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}

    def decode(self, x: Float[Array, " d"], cache: dict, pos
               ) -> tuple[Float[Array, " d"], dict]:
        """The output at position `pos` given the cached keys and values of positions
        `< pos`: `(y (d,), cache)`. Query `pos`'s Ising model is built over the cache's
        positions with the later ones hidden (free spins that do not interact), so exact
        inference equals row `pos` of `__call__` (it enumerates 2^max_len configurations per
        query instead of the prefix blocks of the whole-sequence call), mean-field / TAP
        agree to the solver tolerance, and the samplers draw from other keys (the same
        distribution, other samples)."""
        scores, visible, cache = decode_scores(self, x, cache, pos, self.causal)
        v = cache["v"].at[:, pos].set(self.to_v(x).reshape(self.num_heads, -1))
        if self.mode == "softmax":
            weights = masked_softmax(scores[:, None], visible[None])[:, 0]
        else:
            h = scores if _uses(self.mode)[0] else jnp.zeros_like(scores)
            m, _ = self.magnetizations(h[:, None], visible[None])
            weights = normalized_weights(m[:, 0], visible.astype(h.dtype))
        out = self.to_out(jnp.einsum("hs,hsk->hk", weights, v).reshape(-1))
        return out, {**cache, "v": v}

    def magnetizations(
        self,
        h: Float[Array, "h n s"],
        visible: Optional[Bool[Array, "n s"]] = None,
        *,
        causal: bool = False,
        key: Optional[PRNGKeyArray] = None,
    ) -> tuple[Float[Array, "h n s"], Optional[Stats]]:
        """⟨s_j⟩_i for every head and query, by the module's `inference`.

        **Arguments:**

        - `h`: fields `(H, n, s)`.
        - `visible`: optional boolean `(n, s)`, True where query i sees position j; the
          hidden spins are removed from query i's model. None means every position is
          visible, or with `causal=True` the causal pattern j ≤ i (n = s); `causal` is
          ignored when `visible` is given.
        - `key`: PRNG key for samplers (a fixed key if None).

        **Returns:** magnetizations `(H, n, s)` (0 at hidden positions) and the solver `Stats`
        `(H, n)` for `mean_field`/`tap` (None for the other inferences).
        """
        H, n, s = h.shape
        uses_h, uses_J, uses_K = _uses(self.mode)
        structured = visible is None  # all visible, or causal: one shared enumeration
        if visible is None and causal:
            if n != s:
                raise ValueError(f"BoltzmannAttention: causal magnetizations need as many "
                                 f"queries as positions, got fields of shape {h.shape}.")
            visible = jnp.tril(jnp.ones((n, s), bool))
        vis = None if visible is None else visible.astype(h.dtype)
        J, K = self.couplings(s, h.dtype)
        if not uses_J and not uses_K:  # sigmoid attention: independent spins
            m = jnp.tanh(h)
            return (m if vis is None else m * vis), self._no_stats(H, n, h.dtype)
        if not uses_h and not uses_K:
            # h = 0 and pairwise J only: E(s) = E(−s), so ⟨s_j⟩ = 0 exactly for every J
            return jnp.zeros_like(h), self._no_stats(H, n, h.dtype)
        Jz = jnp.zeros((H, s, s), h.dtype) if J is None else J
        if self.inference == "exact" and structured:
            # shared enumeration over all queries (prefix blocks when causal)
            def one_head(hh, jj, kk):
                return ising.boltzmann_marginals(hh, jj, causal=causal, K=kk)

            if K is None:
                m = jax.vmap(lambda hh, jj: one_head(hh, jj, None))(h, Jz)
            else:
                m = jax.vmap(one_head)(h, Jz, K)
            return m, self._no_stats(H, n, h.dtype)
        if vis is None:
            vis = jnp.ones((n, s), h.dtype)
        per_query = self._per_query(self.inference)
        # per-query systems: hidden positions get no field and no couplings (free spins
        # with magnetization 0 that do not affect the visible ones)
        hv = h * vis
        Jq = Jz[:, None] * (vis[:, :, None] * vis[:, None, :])[None]  # (H, n, s, s)
        Kq = None
        if K is not None:
            vvv = vis[:, :, None, None] * vis[:, None, :, None] * vis[:, None, None, :]
            Kq = K[:, None] * vvv[None]
        keys = self._keys(key, H, n)
        if Kq is None:
            m, stats = jax.vmap(jax.vmap(lambda a, b, k: per_query(a, b, None, k)))(hv, Jq, keys)
        else:
            m, stats = jax.vmap(jax.vmap(per_query))(hv, Jq, Kq, keys)
        return m * vis, stats

    def _no_stats(self, H, n, dtype):
        """Solver statistics of a call that ran no solver (the same structure as one that
        did)."""
        if self.inference in ("mean_field", "tap"):
            return Stats.none((H, n), dtype)
        return None

    def _keys(self, key, H, n):
        if key is None:
            key = jax.random.key(0)
        return jax.random.split(key, H * n).reshape(H, n)

    def _per_query(self, inf):
        """`f(h (s,), J (s, s), K (s, s, s) | None, key) -> (m (s,), stats)` for one query."""
        if inf == "exact":
            def f(h, J, K, key):
                return ising.exact_marginals(h, J, K=K), None
        elif inf in ("mean_field", "tap"):
            f = self._mean_field
        else:
            f = self._sampled
        return f

    def _mean_field(self, h, J, K, key):
        del key
        kw = dict(solver=self.solver, adjoint=self.adjoint, throw=self.throw)
        if self.inference == "tap":  # pairwise only (checked at construction)
            sol = ising.tap(h, J, **kw)
        else:
            sol = ising.mean_field(h, J, K=K, **kw)
        return sol.value, Stats.of(sol)

    def _sampled(self, h, J, K, key):
        inf = self.inference
        if inf == "gibbs":
            S = samplers.gibbs(h, J, key=key, num_samples=self.num_samples,
                               burn_in=self.burn_in, K=K)
        elif inf == "parallel_tempering":
            S = samplers.parallel_tempering(h, J, key=key, betas=jnp.asarray(self.betas),
                                            num_samples=self.num_samples,
                                            burn_in=self.burn_in, K=K)
        else:
            S = samplers.dqa(h, J, key=key, num_samples=self.num_samples,
                             steps=self.dqa_steps, total_time=self.dqa_time,
                             gamma=self.dqa_gamma, K=K)
        return samplers.straight_through_mean_field(jnp.mean(S, axis=0), h, J, K=K), None
