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

Modes (the paper's ablation), the words of `Mode`: `softmax` (plain softmax attention, no
spins), `h` (J = 0: sigmoid attention, α = σ(2h), computed in closed form), `hJ` (the
proposed model), `J` (h = 0), and the three-body variants `hK`, `hJK`, `JK`, `K`.

Note on `J` alone: with h = 0 and no K the energy is even under s → −s, so ⟨s_j⟩ = 0 for
every J and the attention is exactly uniform over the visible positions — J receives zero
gradient. Only K breaks that symmetry (modes `JK`, `K`).

Inference, `BoltzmannInference` objects or their names: `exact` (`ExactInference`,
enumeration, `spins.ising.boltzmann_marginals`; exact gradients), `mean_field` / `tap`
(`MeanFieldInference`, `TAPInference`: fixed points, differentiated by their `adjoint`), and
the samplers `gibbs`, `parallel_tempering`, `dqa` (`Gibbs`, `ParallelTempering`, `DQA`:
simulated diabatic quantum annealing, T ≤ 12) of `spins.samplers`, which carry their
settings (number of samples, burn-in, ...) and whose sample means carry straight-through
gradients (see `BoltzmannAttention`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Literal, Optional, Union

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, PRNGKeyArray

from .. import solvers
from .._schema import (Choice, ConfigError, check_solvers, check_values, choice, option,
                       register_attention, register_choice)
from ..spins import ising, samplers
from ._attention_diagnostics import Diagnostics, Stats
from ._heads import (check_heads, decode_scores, linear_maps, masked_softmax, mix_values,
                     project_heads, qk_scores)
from ._literal import check_literal


# ------------------------------------------------------------------------------ modes

# Which energy terms Boltzmann attention has (`mode=`, config `model.attention.mode`):
# `softmax` (plain softmax attention over the fields, no spins), `hJ` (fields and pair
# couplings J, the proposed model), `h` (fields only: sigmoid attention), `J` (pair couplings
# only: uniform attention), and the three-body variants `hK`, `hJK`, `JK`, `K`.
Mode = Literal["softmax", "hJ", "h", "J", "hK", "hJK", "JK", "K"]

# mode -> whether it has (fields h, pair couplings J, three-body couplings K)
_TERMS: dict[str, tuple[bool, bool, bool]] = {
    "softmax": (True, False, False), "hJ": (True, True, False), "h": (True, False, False),
    "J": (False, True, False), "hK": (True, False, True), "hJK": (True, True, True),
    "JK": (False, True, True), "K": (False, False, True)}

# The modes whose magnetizations have a closed form and need no inference: independent spins
# (`softmax`, `h`: ⟨s⟩ = tanh(h)) and `J` alone (E(s) = E(−s), so ⟨s⟩ = 0 for every J).
_CLOSED_FORM = ("softmax", "h", "J")


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


# -------------------------------------------------------------------------- inference


def _check_int(where: str, what: str, v: Any, lo: int) -> None:
    if not isinstance(v, int) or v < lo:
        raise ValueError(f"{where}: {what}={v!r} must be an int >= {lo}.")


class BoltzmannInference(Choice):
    """How Boltzmann attention computes the magnetizations ⟨s_j⟩_i (`inference=`, config
    `model.attention.inference`): `query` solves one query's Ising model from its arrays,
    `structured` (exact inference only) all queries at once when every position is visible
    or the pattern is causal. A sampler carries its settings as fields (`Gibbs(num_samples=64)`,
    config `inference: {name: gibbs, num_samples: 64}`) and checks them when it is made."""

    def check(self, where: str, mode: Mode, max_len: int) -> None:
        """Raise `ValueError` (naming `where`) if it cannot serve the energy terms of `mode`
        (a `Mode` word) up to `max_len` key positions."""

    def structured(self, h, J, K, *, causal: bool):
        """The magnetizations `(H, n, s)` of all queries at once (every position visible, or
        with `causal` the pattern j ≤ i), or None: this inference solves each query alone."""
        del h, J, K, causal
        return None

    def queries(self, h, J, K, vis, keys, *, solver: solvers.AbstractSolver,
                adjoint: solvers.AbstractAdjoint, throw: bool):
        """`(m (H, n, s), stats)` for every head and query: fields `h (H, n, s)` (0 at
        hidden positions), couplings `J (H, s, s)`, `K (H, s, s, s)` or None, `vis (n, s)`
        (1 where query i sees position j; the hidden spins are removed from query i's
        model), PRNG `keys (H, n)`; `solver`, `adjoint` and `throw` serve the fixed-point
        inferences. By default each query's model is built with its visible couplings and
        passed to `query`."""
        del solver, adjoint, throw
        per_query = self.query
        Jq = J[:, None] * (vis[:, :, None] * vis[:, None, :])[None]  # (H, n, s, s)
        if K is None:
            return jax.vmap(jax.vmap(lambda a, b, k: per_query(a, b, None, k)))(h, Jq, keys)
        vvv = vis[:, :, None, None] * vis[:, None, :, None] * vis[:, None, None, :]
        return jax.vmap(jax.vmap(per_query))(h, Jq, K[:, None] * vvv[None], keys)

    def query(self, h, J, K, key):
        """`(m (s,), stats)` for one query: fields `h (s,)`, couplings `J (s, s)`, `K (s, s,
        s)` or None, PRNG `key` (used by `queries`' default)."""
        raise NotImplementedError

    def no_stats(self, H: int, n: int, dtype):
        """The solver statistics of a call that ran no solver (the structure of one that
        did: None where this inference reports none)."""
        del H, n, dtype
        return None


@register_choice("boltzmann.inference", "exact")
@dataclasses.dataclass(frozen=True)
class ExactInference(BoltzmannInference):
    """`exact`: enumeration of all 2^T configurations (T ≤ 24; exact gradients)."""

    def check(self, where, mode, max_len):
        if mode not in _CLOSED_FORM and max_len > ising.MAX_BOLTZMANN_T:
            raise ValueError(
                f"{where}: exact inference enumerates 2^T configurations and is limited to "
                f"max_len <= {ising.MAX_BOLTZMANN_T}, got {max_len}; use "
                "inference='mean_field', 'tap', 'gibbs' or 'parallel_tempering'.")

    def structured(self, h, J, K, *, causal):
        # shared enumeration over all queries (prefix blocks when causal)
        def one_head(hh, jj, kk):
            return ising.boltzmann_marginals(hh, jj, causal=causal, K=kk)

        if K is None:
            return jax.vmap(lambda hh, jj: one_head(hh, jj, None))(h, J)
        return jax.vmap(one_head)(h, J, K)

    def query(self, h, J, K, key):
        del key
        return ising.exact_marginals(h, J, K=K), None


class _FixedPoint(BoltzmannInference):
    """A mean-field fixed point solved with `solver` (differentiated through `adjoint`),
    one solve per head for all its queries at once (`queries`), with solver statistics.

    Each query's system is independent, so one solve over the `(n, s)` array of a head has
    the same fixed point as n solves of `(s,)`; with the solver's default ∞-norm it stops
    when the slowest query has converged, which is where a vmapped per-query loop stops as
    well. Solved together, an iteration is one `(n, s) × (s, s)` product per head instead of
    n matrix-vector products with per-query couplings `(n, s, s)`, and the backward pass is
    one linear solve per head instead of n small ones (measured in
    docs/families/boltzmann.md). Anderson mixes the whole head's iterates with one set of
    coefficients."""

    def update(self, m, h, J, K, vis):
        """One update of every query's magnetizations `m (n, s)` from fields `h (n, s)`
        (0 at hidden positions), couplings `J (s, s)` (symmetric, zero diagonal), `K` or
        None and `vis (n, s)` (1 where query i sees position j): query i's model keeps only
        its visible spins, so hidden magnetizations stay 0."""
        raise NotImplementedError

    def queries(self, h, J, K, vis, keys, *, solver, adjoint, throw):
        del keys

        def one_head(hh, jj, kk):
            sol = solvers.fixed_point(lambda m, a: self.update(m, *a, vis), jnp.tanh(hh),
                                      (hh, jj, kk), solver=solver, adjoint=adjoint,
                                      throw=throw)
            return sol.value, Stats.of(sol)

        return jax.vmap(one_head)(h, J, K)

    def no_stats(self, H, n, dtype):
        return Stats.none((H,), dtype)


@register_choice("boltzmann.inference", "mean_field")
@dataclasses.dataclass(frozen=True)
class MeanFieldInference(_FixedPoint):
    """`mean_field`: naive mean field m = tanh(h + J m [+ ½ K:mm])
    (`ising.mean_field_update` on each query's visible spins)."""

    def update(self, m, h, J, K, vis):
        return jax.vmap(lambda mq, hq, vq: ising.mean_field_update(
            mq, hq, J, K=K, visible=vq))(m, h, vis)


@register_choice("boltzmann.inference", "tap")
@dataclasses.dataclass(frozen=True)
class TAPInference(_FixedPoint):
    """`tap`: TAP (Onsager-corrected) mean field, pairwise couplings only."""

    def check(self, where, mode, max_len):
        if _TERMS[mode][2]:
            raise ValueError(
                f"{where}: TAP equations are implemented for pairwise couplings only; "
                f"mode={mode!r} has three-body K. Use inference='mean_field', 'exact' or "
                "a sampler.")

    def update(self, m, h, J, K, vis):
        del K  # pairwise only (checked at construction)
        return jax.vmap(lambda mq, hq, vq: ising.tap_update(mq, hq, J, visible=vq))(
            m, h, vis)


class BoltzmannSampler(BoltzmannInference):
    """Sample means from `spins.samplers`, with straight-through gradients from the
    surrogate m̃ = tanh(h + J m̂ [+ ½ K:m̂m̂]) at the (gradient-stopped) sample mean m̂."""

    num_samples: int

    def __post_init__(self):
        _check_int(type(self).__name__, "num_samples", self.num_samples, 1)

    def sample(self, h, J, K, key):
        """Samples `(num_samples, s)` in ±1."""
        raise NotImplementedError

    def query(self, h, J, K, key):
        S = self.sample(h, J, K, key)
        return samplers.straight_through_mean_field(jnp.mean(S, axis=0), h, J, K=K), None


@register_choice("boltzmann.inference", "gibbs")
@dataclasses.dataclass(frozen=True)
class Gibbs(BoltzmannSampler):
    """`gibbs`: Gibbs sampling, `num_samples` sweeps after `burn_in` discarded ones.

    **Arguments:**

    - `num_samples`: sweeps sampled per query and head.
    - `burn_in`: sweeps discarded before sampling.
    """

    num_samples: int = 256
    burn_in: int = 32

    def __post_init__(self):
        super().__post_init__()
        _check_int("Gibbs", "burn_in", self.burn_in, 0)

    def sample(self, h, J, K, key):
        return samplers.gibbs(h, J, key=key, num_samples=self.num_samples,
                              burn_in=self.burn_in, K=K)


@register_choice("boltzmann.inference", "parallel_tempering")
@dataclasses.dataclass(frozen=True)
class ParallelTempering(BoltzmannSampler):
    """`parallel_tempering`: replicas at inverse temperatures `betas` (the target β = 1
    first), `num_samples` sweeps after `burn_in` discarded ones.

    **Arguments:**

    - `num_samples`: sweeps sampled per query and head (of the β = 1 replica).
    - `burn_in`: sweeps discarded before sampling.
    - `betas`: the replicas' inverse temperatures, the target 1.0 first.
    """

    num_samples: int = 256
    burn_in: int = 32
    betas: tuple[float, ...] = (1.0, 0.7, 0.5, 0.3)

    def __post_init__(self):
        super().__post_init__()
        _check_int("ParallelTempering", "burn_in", self.burn_in, 0)
        object.__setattr__(self, "betas", tuple(float(b) for b in self.betas))
        if len(self.betas) < 2 or self.betas[0] != 1.0:
            raise ValueError(f"ParallelTempering: betas={self.betas} must hold >= 2 inverse "
                             "temperatures starting with the target 1.0, e.g. (1.0, 0.7, 0.5, "
                             "0.3).")

    def sample(self, h, J, K, key):
        return samplers.parallel_tempering(h, J, key=key, betas=jnp.asarray(self.betas),
                                           num_samples=self.num_samples,
                                           burn_in=self.burn_in, K=K)


@register_choice("boltzmann.inference", "dqa")
@dataclasses.dataclass(frozen=True)
class DQA(BoltzmannSampler):
    """`dqa`: simulated diabatic quantum annealing (T ≤ 12), `num_samples` measurements of
    the state after a Trotterised transverse-field anneal (Kim and Park §4.5: 200 steps,
    τ = 5).

    **Arguments:**

    - `num_samples`: measurements per query and head.
    - `steps`: Trotter steps of the anneal.
    - `total_time`: the anneal time τ.
    - `gamma`: the initial transverse field Γ.
    """

    num_samples: int = 256
    steps: int = 200
    total_time: float = 5.0
    gamma: float = 1.0

    def __post_init__(self):
        super().__post_init__()
        _check_int("DQA", "steps", self.steps, 1)
        object.__setattr__(self, "total_time", float(self.total_time))
        object.__setattr__(self, "gamma", float(self.gamma))
        if not self.total_time > 0:
            raise ValueError(f"DQA: total_time={self.total_time} must be > 0.")

    def check(self, where, mode, max_len):
        if mode not in _CLOSED_FORM and max_len > samplers.MAX_DQA:
            raise ValueError(
                f"{where}: simulated DQA holds a 2^T state vector and is limited to "
                f"max_len <= {samplers.MAX_DQA}, got {max_len}; use 'gibbs' or "
                "'parallel_tempering' for longer sequences.")

    def sample(self, h, J, K, key):
        return samplers.dqa(h, J, key=key, num_samples=self.num_samples, steps=self.steps,
                            total_time=self.total_time, gamma=self.gamma, K=K)


@dataclasses.dataclass(frozen=True)
class BoltzmannConfig:
    """Settings of Boltzmann attention: a config's `model.attention: {name: boltzmann, ...}`."""

    mode: Mode = option("hJ", "energy terms: hJ (fields + learnable couplings J), h (J=0: "
                       "sigmoid attention), J (h=0), softmax (plain softmax, for ablations), "
                       "or the three-body variants hK, hJK, JK, K")
    inference: BoltzmannInference = option(
        ExactInference(), "how magnetizations are computed: exact (enumeration, T<=24), "
        "mean_field, tap, gibbs, parallel_tempering, dqa (T<=12); a sampler with its settings, "
        "e.g. {name: gibbs, num_samples: 64}", kind="boltzmann.inference")
    init_scale: float = option(0.0, "standard deviation of the initial couplings J (and K); "
                               "0 starts at sigmoid attention")
    # Picard with damping 0.2, not Anderson: near a marginally stable point Anderson's
    # extrapolations stall and the solve fails, where damped Picard reaches a stable fixed
    # point; a vmapped solve runs until its slowest system, so those failures also make
    # Anderson slower. Plain Picard fails more TAP solves than damped Picard. The
    # measurements are in docs/families/boltzmann.md.
    solver: solvers.AbstractSolver = option(
        solvers.Picard(tol=1e-4, max_steps=100, damping=0.2),
        "mean_field/tap: the fixed-point solver", kind="solver")
    # one-step (Jacobian-free) gradients: at equal training FLOPs a little better than the
    # exact implicit ones on characters (the adjoint study's medium size), level at equal
    # steps there and on brackets and NLI (docs/results/scaling.md, "Verdict: which adjoint
    # to pick"); the exact gradient, Implicit(rtol=1e-4) (the forward's tolerance), was the
    # default before
    adjoint: solvers.AbstractAdjoint = option(
        solvers.OneStep(), "mean_field/tap: how gradients flow through the fixed point "
        "(onestep: the map's gradient at the solution; implicit: the exact one)",
        kind="adjoint")

    def __post_init__(self):
        if not self.init_scale >= 0:
            raise ConfigError(f"init_scale={self.init_scale} must be >= 0.")
        check_solvers(self)


# the constructor's defaults are the settings' (one source of defaults)
_DEFAULTS = BoltzmannConfig()


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
    - `mode`: which energy terms are present, one of the words of `Mode`: `"softmax"`
      (plain softmax attention over the fields, no spins), `"hJ"` (fields h and pair
      couplings J, the proposed model), `"h"` (fields only: sigmoid attention, α = σ(2h), in
      closed form), `"J"` (couplings only: uniform attention, in closed form), and the
      three-body variants `"hK"`, `"hJK"`, `"JK"`, `"K"`.
    - `inference`: how the magnetizations ⟨s_j⟩_i are computed, a `BoltzmannInference` or
      its name (the module holds the object):
      `ExactInference` (`"exact"`) — enumeration of all 2^T configurations (T ≤ 24; exact
      gradients); `MeanFieldInference` (`"mean_field"`) — naive mean field
      m = tanh(h + J m [+ ½ K:mm]), solved with `solver`, differentiated by `adjoint`;
      `TAPInference` (`"tap"`) — TAP (Onsager-corrected) mean field, no K;
      `Gibbs`, `ParallelTempering`, `DQA` (`"gibbs"`, `"parallel_tempering"`, `"dqa"`) —
      sample means from `spins.samplers` (DQA: Trotterised transverse-field anneal, T ≤ 12),
      with straight-through gradients from the surrogate m̃ = tanh(h + J m̂ [+ ½ K:m̂m̂])
      evaluated at the (gradient-stopped) sample mean m̂ — one mean-field step, exact when
      the couplings vanish. A sampler carries its settings (`Gibbs(num_samples=64)`; by
      name, its defaults: 256 samples, burn-in 32, β = (1, 0.7, 0.5, 0.3), 200 steps, τ = 5,
      Γ = 1).
    - `init_scale`: standard deviation of the initial couplings (0: start at J = 0, i.e. at
      sigmoid attention).
    - `solver`, `adjoint`, `throw`: for `mean_field` / `tap` (the solver carries the
      tolerance and step budget; defaults: `BoltzmannConfig.solver` and
      `BoltzmannConfig.adjoint`, as for every argument with a default here).
      `throw=False` (the default, as in the spin, free-energy and Hopfield attentions)
      returns the solver's best iterate and reports a failed solve in the diagnostics'
      solver statistics, which the trainer counts; `throw=True` raises instead, and then a
      single failed solve ends a training run.
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
    mode: Mode = eqx.field(static=True)
    inference: BoltzmannInference = eqx.field(static=True)
    throw: bool = eqx.field(static=True)

    def __init__(
        self, dim: int, num_heads: int = 1, causal: bool = False, *,
        max_len: int,
        mode: Mode = _DEFAULTS.mode,
        inference: Union[str, BoltzmannInference] = _DEFAULTS.inference,
        init_scale: float = _DEFAULTS.init_scale,
        solver: solvers.AbstractSolver = _DEFAULTS.solver,
        adjoint: solvers.AbstractAdjoint = _DEFAULTS.adjoint,
        throw: bool = False,
        use_bias: bool = False,
        key: PRNGKeyArray,
    ):
        name = "BoltzmannAttention"
        check_heads(name, dim, num_heads)
        mode = check_literal(name, "mode", mode, Mode)
        inference = choice("boltzmann.inference", inference, where=f"{name}: inference")
        if not isinstance(max_len, int) or max_len < 1:
            raise ValueError(f"{name}: max_len={max_len!r} must be a positive int (the "
                             "longest key sequence; J has shape (H, max_len, max_len)).")
        # its length limits (none in modes softmax, h and J: closed forms)
        inference.check(name, mode, max_len)
        check_values(BoltzmannConfig, name, init_scale=init_scale)
        kq, kk, kv, ko, kj, kK = jax.random.split(key, 6)
        self.to_q, self.to_k, self.to_v, self.to_out = linear_maps(dim, use_bias, kq, kk, kv, ko)
        L, H = max_len, num_heads
        self.J = (ising.symmetrize(init_scale * jax.random.normal(kj, (H, L, L)))
                  if _TERMS[mode][1] else None)
        self.K = init_scale * jax.random.normal(kK, (H, L, L, L)) if _TERMS[mode][2] else None
        self.solver, self.throw = solver, throw
        self.adjoint = adjoint
        self.dim, self.num_heads, self.causal, self.max_len = dim, num_heads, causal, max_len
        self.mode, self.inference = mode, inference

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
        return self._energy_fields(h), allowed

    def _energy_fields(self, h):
        """The fields of the energy: `h`, or zeros in a mode without fields."""
        return h if _TERMS[self.mode][0] else jnp.zeros_like(h)

    def _attend(self, h, visible, magnetizations: Callable[[], tuple]):
        """`(weights, magnetizations, stats)` from fields `h (H, n, s)` and the visible
        positions (boolean `(n, s)`, or None: all); `magnetizations()` computes
        `(m, stats)`. Spin modes weight by α ∝ (⟨s⟩ + 1)/2 (`normalized_weights`); mode
        `softmax` is softmax attention, whose diagnostics report 2·weights − 1."""
        if self.mode == "softmax":
            weights = masked_softmax(h, visible)
            return weights, 2.0 * weights - 1.0, None
        m, stats = magnetizations()
        vis = 1.0 if visible is None else visible.astype(h.dtype)
        return normalized_weights(m, vis), m, stats

    def _closed_form(self, h, visible):
        """The magnetizations `(H, n, s)` of fields `h` over `visible` (`(n, s)` 1/0, or
        None: all) in the modes that have a closed form; None where inference is needed."""
        if self.mode == "J":
            return jnp.zeros_like(h)
        if self.mode in _CLOSED_FORM:  # independent spins
            m = jnp.tanh(h)
            return m if visible is None else m * visible
        return None

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
          and, for `mean_field`/`tap`, `solver` statistics `(H,)` (one solve per head for all
          its queries).

        **Returns:** `(n, d)`, or `((n, d), diagnostics)`.
        """
        del state
        h, allowed = self._fields_and_mask(x, context, mask)
        self_causal = self.causal and context is None

        def magnetizations():
            if mask is None:  # the structured patterns exact inference exploits
                return self.magnetizations(h, None, causal=self_causal, key=key)
            return self.magnetizations(h, allowed, key=key)

        weights, m, stats = self._attend(h, allowed, magnetizations)
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
        h = self._energy_fields(scores)[:, None]  # (H, 1, s)
        weights, _, _ = self._attend(h, visible[None],
                                     lambda: self.magnetizations(h, visible[None]))
        weights = weights[:, 0]
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
        `(H,)` for `mean_field`/`tap`, one solve per head for all its queries (None for the
        other inferences).
        """
        H, n, s = h.shape
        structured = visible is None  # all visible, or causal: one shared enumeration
        if visible is None and causal:
            if n != s:
                raise ValueError(f"BoltzmannAttention: causal magnetizations need as many "
                                 f"queries as positions, got fields of shape {h.shape}.")
            visible = jnp.tril(jnp.ones((n, s), bool))
        vis = None if visible is None else visible.astype(h.dtype)
        J, K = self.couplings(s, h.dtype)
        # sigmoid attention (independent spins) and mode J (⟨s⟩ = 0 by symmetry)
        m = self._closed_form(h, vis)
        if m is not None:
            return m, self.inference.no_stats(H, n, h.dtype)
        Jz = jnp.zeros((H, s, s), h.dtype) if J is None else J
        if structured:
            m = self.inference.structured(h, Jz, K, causal=causal)
            if m is not None:
                return m, self.inference.no_stats(H, n, h.dtype)
        if vis is None:
            vis = jnp.ones((n, s), h.dtype)

        # per-query systems: hidden positions get no field and no couplings (free spins
        # with magnetization 0 that do not affect the visible ones)
        m, stats = self.inference.queries(h * vis, Jz, K, vis, self._keys(key, H, n),
                                          solver=self.solver, adjoint=self.adjoint,
                                          throw=self.throw)
        return m * vis, stats

    def _keys(self, key, H, n):
        if key is None:
            key = jax.random.key(0)
        return jax.random.split(key, H * n).reshape(H, n)
