r"""NeuroGame attention: cooperative-game values of the tokens as the fields and couplings of
an Ising model whose mean-field magnetizations are the attention weights (D. Bouchaffra,
F. Ykhlef, H. Azzag, M. Lebbah, B. Faye, "NeuroGame Transformer: Gibbs-Inspired Attention
Driven by Game Theory and Statistical Physics", Algorithm 1 and §3.11).

Per head h and per game (see `mode` below), with value vectors V_i = W_v x_i (the head's
slice) of the players i (padded or masked tokens are never players):

- the game: v(C) = f(‖Σ_{i∈C} u_i‖) with u_i = V_i (f: identity as in Algorithm 1, tanh or
  relu), a `spins.coalitions.NormGame`;
- Shapley values φ and Banzhaf indices β of the players, each divided by its L1 norm
  (Algorithm 1, lines 50–51), and the pairwise interactions J_ij (zero diagonal), estimated
  by `estimator`: `"exact"` (enumeration, ≤ 16 players), `"mc"` (the unbiased shared-draw
  Monte Carlo estimators of `spins.coalitions`) or `"paper"` (Algorithm 1 as printed,
  `coalitions.ngt_estimates`: Gibbs-weighted, which converges to a Gibbs-tilted average,
  not to the Shapley value or the Banzhaf index — see `spins.coalitions`);
- the gate λ_i = σ(w_hᵀ x_i + b_h) and the external field J_i = λ_i φ_i + (1 − λ_i) β_i;
- the mean field ⟨s_i⟩ = tanh((J_i + Σ_j J_ij ⟨s_j⟩)/γ_h), started at ⟨s⟩ = 0 as in
  Algorithm 1 and solved with `spins.ising.mean_field` (β = 1/γ_h);
- α_i = (1 + ⟨s_i⟩)/2 and the head's output Σ_i α_i V_i / N (see `normalize`).

The heads are concatenated and mixed by W_O (eq. 27).

**Damping.** §7.3 of the paper lists "damping factor 0.7" without the update; the authors'
code weights the new iterate by it, s ← 0.7·tanh((J + J_int s)/γ) + 0.3·s. Here the damped
update is the solver's: `Picard(damping=δ)` iterates
s ← δ·s + (1 − δ)·tanh((J + J_int s)/γ) with δ the fraction of the old iterate kept (this
library's convention everywhere), so the authors' update is `Picard(damping=0.3)`. All have
the same fixed points; `Picard()` (δ = 0, the default) is the undamped parallel update of
Algorithm 1, lines 57–65.

**Solver defaults.** With the L1-normalised fields (|J_i| ≲ 0.3) and unnormalised
interactions (|J_ij| up to ~1) at γ = 0.25 the mean field is strongly coupled: a damped
update converges slowly (δ = 0.7 contracts by at most 0.7 per step, so it alone needs ~26
steps to gain 1e-4), and Anderson and Broyden fail more often than plain Picard iteration.
The default is therefore `Picard(tol=1e-4, max_steps=100)`; non-converged solves are
reported (`solver_failures`), never hidden. The measurements behind this choice are in
the NeuroGame page of the documentation (`docs/families/neurogame.md`) and
`experiments/results/ngt/`.

**Adjoint (default: implicit).** Gradients flow by implicit differentiation at the fixed
point, the adjoint system solved by Anderson on the Richardson map (`solvers.Implicit`'s
default linear solver) with the forward's tolerance (`Implicit(rtol=1e-4)`); `Unrolled()`
backpropagates through the Picard iterations as the paper's code does. A game whose forward
mean field did not converge has no fixed point to differentiate: it passes no gradient
through ⟨s⟩ (its α is used as computed in the forward pass, and it is counted in
`solver_failures`) instead of making the whole batch's gradient NaN. The adjoint tolerance
is the forward's: a tighter one is below what float32 round-off lets some games' backward
solves reach. (GMRES on the same systems failed where Anderson succeeded; see
`docs/families/neurogame.md`.)

**Normalisation of α (this project's choice).** The paper's output Σ_i α_i V_i is not
normalised: Σ_i α_i is the expected number of active tokens (its eq. 14), so the output
grows with the number of players (with γ → ∞ every α_i = ½ and the output is half the sum of
the values). `normalize="players"` (the default) divides by the number of players N: the
output is a mean of the values weighted by α ∈ [0, 1], bounded by max‖V_i‖ whatever the
length, and α keeps its absolute meaning (all tokens active gives the plain mean, none gives
0). `"sum"` divides by Σα (a convex combination, like softmax; loses the total activity);
`"none"` is the paper's.

**Two ways to use it** (`mode`):

- `"pooled"` — the paper's layer: one game per sequence over all its players; the output
  z (D,) is what the paper's classifier head (eqs. 28–30) reads (`pool`). Called as an
  attention layer in a stack, every position receives the same z (a global, non-causal
  summary).
- `"query"` — this project's extension to a token-mixing layer: one game per query i over the
  tokens it may see (its row of the mask, causal or padded), with player vectors
  u_ij = σ(q_i·k_j/√D_h)·V_j, so each query plays its own game (query relevance scales each
  player's contribution) and receives Σ_j α_ij V_j / N_i. The cost is one game per query.

The switches `mode`, `value_fn`, `gate` and `normalize` are strings (the `Literal` aliases
`Mode`, `ValueFn`, `Gate`, `Normalize`, the words the config holds); the estimator is an
algorithm, a `GameEstimator` object that receives the game and its players
(`ExactValues().values(game, players, ...)`), and the constructor takes it or its name.

The game values are computed on every call, in training and in evaluation (Monte Carlo
estimators draw K = `train_samples` coalitions from the call's key in training and
K = `eval_samples` from a fixed key without one, so evaluation is deterministic).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal, Optional, Union

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, PRNGKeyArray

from .. import solvers
from .._schema import (Choice, ConfigError, check_solvers, check_values, choice, option,
                       register_attention, register_choice)
from ..spins import coalitions, ising
from ._attention_diagnostics import Diagnostics, Stats
from ._heads import check_heads, check_shapes, merge_heads, project_heads
from ._literal import check_literal
from ._masks import combine_masks

# Below this L1 norm the Shapley/Banzhaf vector is treated as zero (no division by ~0).
_L1_FLOOR = 1e-6


# -- options ---------------------------------------------------------------------------------
# The switches are `Literal` fields (the allowed values defined once, here); the estimator
# is an algorithm, an object registered under `neurogame.estimator` that receives the game.

#: which games the layer plays: one per query (`"query"`) or one per sequence (`"pooled"`)
Mode = Literal["query", "pooled"]
#: f of the game v(C) = f(‖Σ_{i∈C} u_i‖) (the nonlinearity's name in `spins.coalitions`)
ValueFn = Literal["identity", "tanh", "relu"]
#: the gate λ between Shapley and Banzhaf fields: σ(w_hᵀx_i + b_h), λ ≡ 1 or λ ≡ 0
Gate = Literal["learned", "shapley", "banzhaf"]
#: how a game's output Σ_i α_i V_i is divided: by N, by Σα, or not (the paper's)
Normalize = Literal["players", "sum", "none"]


class GameEstimator(Choice):
    """How the game values are estimated (`estimator`): `MonteCarloValues` (`"mc"`),
    `ExactValues` (`"exact"`) or `PaperValues` (`"paper"`)."""

    def values(self, game, players, *, key, num_samples: int, gamma, interactions: bool):
        """(φ, β, J_ij or None) of one game with players `players (s,)`; J is None without
        `interactions`."""
        raise NotImplementedError

    def check_players(self, s: int) -> None:
        """Raise `ValueError` if this estimator cannot serve `s` tokens."""


@register_choice("neurogame.estimator", "mc")
@dataclasses.dataclass(frozen=True)
class MonteCarloValues(GameEstimator):
    """The unbiased shared-draw Monte Carlo estimators of `spins.coalitions`."""

    def values(self, game, players, *, key, num_samples, gamma, interactions):
        n = players.shape[0]
        k1, k2, k3 = jax.random.split(key, 3)
        kw = dict(num_samples=num_samples, players=players)
        phi = coalitions.shapley_mc(game, n, key=k1, **kw).value
        beta = coalitions.banzhaf_mc(game, n, key=k2, **kw).value
        J = coalitions.interactions_mc(game, n, key=k3, **kw).value if interactions else None
        return phi, beta, J


@register_choice("neurogame.estimator", "exact")
@dataclasses.dataclass(frozen=True)
class ExactValues(GameEstimator):
    """Enumeration of the coalitions (at most `coalitions.MAX_EXACT` tokens)."""

    def values(self, game, players, *, key, num_samples, gamma, interactions):
        n = players.shape[0]
        phi = coalitions.shapley(game, n, players=players)
        beta = coalitions.banzhaf(game, n, players=players)
        J = coalitions.interactions(game, n, players=players) if interactions else None
        return phi, beta, J

    def check_players(self, s):
        if s > coalitions.MAX_EXACT:
            raise ValueError(
                f"NeuroGameAttention: estimator='exact' enumerates 2^{s} coalitions; it "
                f"accepts at most {coalitions.MAX_EXACT} tokens. Use estimator='mc'."
            )


@register_choice("neurogame.estimator", "paper")
@dataclasses.dataclass(frozen=True)
class PaperValues(GameEstimator):
    """Algorithm 1 as printed (`coalitions.ngt_estimates`: Gibbs-weighted)."""

    def values(self, game, players, *, key, num_samples, gamma, interactions):
        est = coalitions.ngt_estimates(game, players.shape[0], key=key,
                                       num_samples=num_samples, gamma=gamma, players=players)
        return est.shapley, est.banzhaf, (est.interactions if interactions else None)


def _normalize_by_players(out, alpha, players):
    return out / jnp.maximum(jnp.sum(players), 1)


def _normalize_by_sum(out, alpha, players):
    total = jnp.sum(alpha)
    return out / jnp.where(total > 0, total, 1.0)


# `normalize` -> the game's output from `out = Σ_i α_i V_i (D_h,)`, `alpha (s,)`, `players (s,)`
_NORMALIZE = {
    "players": _normalize_by_players,
    "sum": _normalize_by_sum,
    "none": lambda out, alpha, players: out,
}


@dataclasses.dataclass(frozen=True)
class NeuroGameConfig:
    """Settings of NeuroGame attention: a config's `model.attention: {name: neurogame, ...}`,
    and of the pooled head `model.pool: {name: neurogame, ...}`."""

    mode: Mode = option("query", "query: one game per query over its visible tokens (this "
                       "project's token-mixing extension); pooled: one game per sequence "
                       "(the paper's layer; every position gets the same output)")
    estimator: GameEstimator = option(MonteCarloValues(), "game values: mc (unbiased Monte Carlo), exact "
                            "(enumeration, <= 16 tokens), paper (Algorithm 1's "
                            "Gibbs-weighted estimators)", kind="neurogame.estimator")
    train_samples: int = option(15, "Monte Carlo samples K per call in training")
    eval_samples: int = option(25, "Monte Carlo samples K per call in evaluation")
    eval_seed: int = option(0, "seed of the fixed evaluation key (deterministic evaluation)")
    value_fn: ValueFn = option("identity", "f in v(C) = f(|sum of the coalition's values|)")
    gamma: float = option(0.25, "initial temperature gamma of every head")
    learn_gamma: bool = option(True, "learn each head's temperature (log-parameterised)")
    gate: Gate = option("learned", "lambda: learned sigma(w.x + b), shapley (lambda = 1) or "
                       "banzhaf (lambda = 0)")
    interactions: bool = option(True, "use the pairwise couplings J_ij (false: J_ij = 0)")
    solver: solvers.AbstractSolver = option(
        solvers.Picard(tol=1e-4, max_steps=100),
        "the mean-field solver (picard: Algorithm 1's iteration, the paper's 25 steps are "
        "max_steps=25; solver.damping keeps that fraction of the old iterate: the paper's "
        "'damping factor 0.7' weights the new iterate, so its code's update is damping=0.3)", kind="solver")
    adjoint: solvers.AbstractAdjoint = option(
        solvers.Implicit(rtol=1e-4),
        "gradients through the mean field: implicit (an Anderson backward solve) or "
        "unrolled (backpropagation through the iterations, as the paper's code)", kind="adjoint")
    normalize: Normalize = option("players", "output normalisation: players (divide by the number "
                            "of players), sum (by the sum of alpha), none (the paper's)")

    def __post_init__(self):
        if not (self.train_samples >= 2 and self.eval_samples >= 2):
            raise ConfigError("train_samples and eval_samples must be >= 2.")
        if not self.gamma > 0:
            raise ConfigError(f"gamma={self.gamma} must be > 0.")
        check_solvers(self)
        if not self.eval_seed >= 0:
            raise ConfigError(f"eval_seed={self.eval_seed} must be >= 0.")


class NeuroGameDiagnostics(Diagnostics):
    """`Diagnostics` of NeuroGame attention, per head and game (G = n games in `"query"`
    mode, one in `"pooled"` mode; s players):

    - `weights`: α `(H, G, s)` (0 for non-players); `magnetizations`: ⟨s⟩ `(H, G, s)`;
      `fields`: J_i `(H, G, s)`; `couplings`: J_ij `(H, G, s, s)`;
    - `shapley`, `banzhaf`: the L1-normalised φ and β `(H, G, s)`; `gate`: λ `(H, s)`;
      `gamma`: the heads' temperatures `(H,)`; `solver`: `Stats` `(H, G)`.
    """

    shapley: Optional[Array] = None
    banzhaf: Optional[Array] = None
    gate: Optional[Array] = None
    gamma: Optional[Array] = None


# the constructor's defaults are the settings' (one source of defaults)
_DEFAULTS = NeuroGameConfig()


def _l1_normalized(a, players):
    a = jnp.where(players, a, 0.0)
    norm = jnp.sum(jnp.abs(a), axis=-1, keepdims=True)
    return a / jnp.maximum(norm, _L1_FLOOR)


# The maps that build each query's game (who plays, and how much) form the "couplings" group.
@register_attention("neurogame", config=NeuroGameConfig,
                    help="cooperative-game values as Ising fields (NGT)",
                    coupling_fields=("to_q", "to_k"))
class NeuroGameAttention(eqx.Module):
    """Multi-head NeuroGame attention; one example per call (see the module docstring).

    **Arguments:**

    - `dim`: model width D; `num_heads`: H (D divisible by H, D_h = D/H).
    - `causal`: in `"query"` mode query i's game has the players j ≤ i (self-attention only);
      `"pooled"` mode has one game over the whole sequence and refuses `causal=True`.

    - `mode`: `"query"` (one game per query over the tokens it may see, with player vectors
      u_ij = σ(q_i·k_j/√D_h)·V_j; the module has the maps `to_q`, `to_k`) or `"pooled"`
      (one game per sequence over all its players, the paper's layer; every position
      receives the same output).
    - `estimator`: the game values' estimator, a `GameEstimator` or its name:
      `MonteCarloValues()` (`"mc"`), `ExactValues()` (`"exact"`) or `PaperValues()`
      (`"paper"`).
    - `train_samples`, `eval_samples`: K with and without a call `key`.
    - `eval_seed`: seed of the fixed evaluation key.
    - `value_fn`: f of the game v(C) = f(‖Σ_{i∈C} u_i‖): `"identity"` (Algorithm 1),
      `"tanh"` or `"relu"`.
    - `gamma`: initial temperature of every head; `learn_gamma`: train log γ_h.
    - `gate`: `"learned"` (λ_i = σ(w_hᵀx_i + b_h)), `"shapley"` (λ ≡ 1: the fields are the
      Shapley values) or `"banzhaf"` (λ ≡ 0: the Banzhaf indices).
    - `interactions`: use J_ij (False: J_ij = 0, independent spins).
    - `solver`, `adjoint`: the mean-field solver (carrying its `tol`, `max_steps` and
      `damping`, the fraction of the old iterate kept: `Picard(damping=0.3)` is the
      authors' code's update s ← 0.7·tanh(·) + 0.3·s) and how gradients flow
      (`solvers.Implicit(rtol=1e-4)` by default; `solvers.Unrolled()`
      reproduces the paper's backpropagation through the iterations). With an implicit
      adjoint a game whose mean field did not converge passes no gradient through ⟨s⟩.
    - `normalize`: how a game's output Σ_i α_i V_i is divided: `"players"` (by the number
      of players N), `"sum"` (by Σα, a convex combination like softmax) or `"none"` (the
      paper's).
    - `throw`: raise if a mean field does not converge (default False: reported in the
      diagnostics and the trainer's `solver_failures`).
    - `key`: PRNG key.
    """

    to_q: Optional[eqx.nn.Linear]
    to_k: Optional[eqx.nn.Linear]
    to_v: eqx.nn.Linear
    to_out: eqx.nn.Linear
    gate_proj: eqx.nn.Linear
    log_gamma: Float[Array, " h"]
    solver: solvers.AbstractSolver
    adjoint: solvers.AbstractAdjoint
    dim: int = eqx.field(static=True)
    num_heads: int = eqx.field(static=True)
    causal: bool = eqx.field(static=True)
    mode: Mode = eqx.field(static=True)
    estimator: GameEstimator = eqx.field(static=True)
    train_samples: int = eqx.field(static=True)
    eval_samples: int = eqx.field(static=True)
    eval_seed: int = eqx.field(static=True)
    value_fn: ValueFn = eqx.field(static=True)
    learn_gamma: bool = eqx.field(static=True)
    gate: Gate = eqx.field(static=True)
    interactions: bool = eqx.field(static=True)
    normalize: Normalize = eqx.field(static=True)
    throw: bool = eqx.field(static=True)

    def __init__(
        self, dim: int, num_heads: int = 1, causal: bool = False, *,
        mode: Mode = _DEFAULTS.mode,
        estimator: Union[str, GameEstimator] = _DEFAULTS.estimator,
        train_samples: int = _DEFAULTS.train_samples,
        eval_samples: int = _DEFAULTS.eval_samples,
        eval_seed: int = _DEFAULTS.eval_seed,
        value_fn: ValueFn = _DEFAULTS.value_fn,
        gamma: float = _DEFAULTS.gamma,
        learn_gamma: bool = _DEFAULTS.learn_gamma,
        gate: Gate = _DEFAULTS.gate,
        interactions: bool = _DEFAULTS.interactions,
        solver: solvers.AbstractSolver = _DEFAULTS.solver,
        adjoint: solvers.AbstractAdjoint = _DEFAULTS.adjoint,
        normalize: Normalize = _DEFAULTS.normalize,
        throw: bool = False,
        use_bias: bool = False,
        key: PRNGKeyArray,
    ):
        check_heads("NeuroGameAttention", dim, num_heads)
        where = "NeuroGameAttention"
        check_literal(where, "mode", mode, Mode)
        estimator = choice("neurogame.estimator", estimator, where=where + ": estimator")
        check_literal(where, "value_fn", value_fn, ValueFn)
        check_literal(where, "gate", gate, Gate)
        check_literal(where, "normalize", normalize, Normalize)
        if mode == "pooled" and causal:
            raise ValueError(
                "NeuroGameAttention: mode='pooled' plays one game over the whole sequence, so "
                "every position would see future tokens; use mode='query' for causal models."
            )
        check_values(NeuroGameConfig, "NeuroGameAttention", train_samples=train_samples,
                     eval_samples=eval_samples, gamma=gamma)
        kq, kk, kv, ko, kg = jax.random.split(key, 5)
        if mode == "query":
            self.to_q = eqx.nn.Linear(dim, dim, use_bias=use_bias, key=kq)
            self.to_k = eqx.nn.Linear(dim, dim, use_bias=use_bias, key=kk)
        else:
            self.to_q = self.to_k = None
        self.to_v = eqx.nn.Linear(dim, dim, use_bias=use_bias, key=kv)
        self.to_out = eqx.nn.Linear(dim, dim, use_bias=use_bias, key=ko)
        self.gate_proj = eqx.nn.Linear(dim, num_heads, key=kg)
        # a strongly typed float array: a weakly typed one turns strong after the first
        # optimizer update, and the training step compiles again
        self.log_gamma = jnp.full((num_heads,), math.log(gamma), dtype=jnp.result_type(float))
        self.solver = solver
        self.adjoint = adjoint
        self.dim, self.num_heads, self.causal = dim, num_heads, causal
        self.mode, self.estimator, self.value_fn = mode, estimator, value_fn
        self.train_samples, self.eval_samples, self.eval_seed = (train_samples, eval_samples,
                                                                 eval_seed)
        self.learn_gamma, self.gate, self.interactions = learn_gamma, gate, interactions
        self.normalize, self.throw = normalize, throw

    # -- pieces ------------------------------------------------------------------------------

    @property
    def gammas(self) -> Float[Array, " h"]:
        """The heads' temperatures γ_h `(H,)`."""
        lg = self.log_gamma if self.learn_gamma else jax.lax.stop_gradient(self.log_gamma)
        return jnp.exp(lg)

    def gates(self, x: Float[Array, "s d"]) -> Float[Array, "h s"]:
        """λ `(H, s)` of the players `x (s, D)`: σ(w_hᵀx + b_h), or 1 / 0 for the ablations."""
        if self.gate == "learned":
            return jax.nn.sigmoid(jax.vmap(self.gate_proj)(x)).T
        fill = jnp.ones if self.gate == "shapley" else jnp.zeros
        return fill((self.num_heads, x.shape[0]), x.dtype)

    def _values(self, game, players, key, num_samples, gamma):
        """(φ, β, J_ij) of one game with the configured estimator."""
        phi, beta, J = self.estimator.values(game, players, key=key, num_samples=num_samples,
                                             gamma=gamma, interactions=self.interactions)
        if J is None:
            n = players.shape[0]
            J = jnp.zeros((n, n), phi.dtype)
        return phi, beta, J

    def _play(self, u, v, players, lam, gamma, key, num_samples):
        """One game: player vectors `u (s, D_h)`, output values `v (s, D_h)`, `players (s,)`,
        gates `lam (s,)`. Returns the output `(D_h,)` and the per-game diagnostics."""
        game = coalitions.NormGame(u, self.value_fn)
        phi, beta, J = self._values(game, players, key, num_samples, gamma)
        phi, beta = _l1_normalized(phi, players), _l1_normalized(beta, players)
        field = jnp.where(players, lam * phi + (1.0 - lam) * beta, 0.0)
        J = jnp.where(players[:, None] & players[None, :], J, 0.0)
        J = J * (1.0 - jnp.eye(J.shape[0], dtype=J.dtype))
        sol = ising.mean_field(field, J, beta=1.0 / gamma,
                               solver=self.solver, adjoint=self.adjoint,
                               m0=jnp.zeros_like(field), throw=self.throw)
        m = sol.value
        if isinstance(self.adjoint, solvers.Implicit):
            # The implicit function theorem needs a fixed point: a game whose mean field did
            # not converge passes no gradient through ⟨s⟩ (instead of NaN for the whole
            # batch, which is what the adjoint's failed backward solve would give). Such
            # games are counted in the diagnostics' `solver.result` / the trainer's
            # `solver_failures`.
            m = jnp.where(sol.result == solvers.RESULTS.successful, m,
                          jax.lax.stop_gradient(m))
        m = jnp.where(players, m, 0.0)
        alpha = jnp.where(players, 0.5 * (1.0 + m), 0.0)
        out = _NORMALIZE[self.normalize](alpha @ v, alpha, players)
        return out, (alpha, m, field, J, phi, beta, Stats.of(sol))

    def _players(self, x, ctx, v, allowed):
        """The games of one call: `players (G, s)` and the player vectors
        `u (H, G, s, D_h)`, from the queries `x (n, D)`, the tokens `ctx (s, D)`, their
        values `v (H, s, D_h)` and the visibility mask `allowed (n, s)` (or None)."""
        s = ctx.shape[0]
        if self.mode == "pooled":
            players = jnp.ones((1, s), bool) if allowed is None else jnp.any(allowed, 0)[None]
            return players, v[:, None]  # (H, 1, s, D_h)
        n, H = x.shape[0], self.num_heads
        players = jnp.ones((n, s), bool) if allowed is None else allowed
        q = project_heads(self.to_q, x, H)
        k = project_heads(self.to_k, ctx, H)
        relevance = jax.nn.sigmoid(jnp.einsum("hnk,hsk->hns", q, k) / math.sqrt(q.shape[-1]))
        return players, relevance[..., None] * v[:, None]  # (H, n, s, D_h)

    def _games(self, x, ctx, allowed, key):
        """Every head's games: outputs `(H, G, D_h)` and stacked per-game diagnostics."""
        H = self.num_heads
        v = project_heads(self.to_v, ctx, H)  # (H, s, D_h)
        lam = self.gates(ctx)  # (H, s)
        gammas = self.gammas
        if key is None:
            key, num_samples = jax.random.key(self.eval_seed), self.eval_samples
        else:
            num_samples = self.train_samples
        players, u = self._players(x, ctx, v, allowed)  # (G, s), (H, G, s, D_h)
        G = players.shape[0]
        keys = jax.random.split(key, (H, G))

        def head(u_h, v_h, lam_h, gamma_h, keys_h):
            def one(u_g, players_g, key_g):
                return self._play(u_g, v_h, players_g, lam_h, gamma_h, key_g, num_samples)

            return jax.vmap(one)(u_h, players, keys_h)

        return jax.vmap(head)(u, v, lam, gammas, keys), lam

    def _check_players(self, s):
        self.estimator.check_players(s)

    def _diagnostics(self, per_game, lam):
        alpha, m, field, J, phi, beta, stats = per_game
        return NeuroGameDiagnostics(weights=alpha, couplings=J, magnetizations=m, fields=field,
                                    solver=stats, shapley=phi, banzhaf=beta, gate=lam,
                                    gamma=self.gammas)

    # -- calls -------------------------------------------------------------------------------

    def __call__(self, x: Float[Array, "n d"], *, context: Optional[Float[Array, "s d"]] = None,
                 mask: Optional[Bool[Array, "n s"]] = None, state: None = None,
                 key: Optional[PRNGKeyArray] = None, return_diagnostics: bool = False):
        """**Arguments:**

        - `x`: tokens `(n, D)`.
        - `context`: `(s, D)` tokens to play the games (cross-attention); defaults to `x`.
        - `mask`: boolean `(n, s)`, True where query i may see token j (combined with
          `causal`): query i's players in `"query"` mode; in `"pooled"` mode the players
          are the tokens any query may see (a padding mask).
        - `state`: accepted for interface compatibility; unused.
        - `key`: PRNG key of the Monte Carlo draws (training, K = `train_samples`); None
          uses the fixed evaluation key and K = `eval_samples`.
        - `return_diagnostics`: also return `NeuroGameDiagnostics`.

        **Returns:** `(n, D)`, or `((n, D), diagnostics)`. In `"pooled"` mode every row is
        the sequence's output z.
        """
        del state
        ctx = x if context is None else context
        check_shapes("NeuroGameAttention", x, ctx, self.dim)
        self._check_players(ctx.shape[0])
        allowed = combine_masks(x.shape[0], ctx.shape[0], self.causal and context is None,
                                mask)
        (out, per_game), lam = self._games(x, ctx, allowed, key)  # out (H, G, D_h)
        y = jax.vmap(self.to_out)(merge_heads(out))  # (G, D)
        if self.mode == "pooled":
            y = jnp.broadcast_to(y, (x.shape[0], self.dim))
        if return_diagnostics:
            return y, self._diagnostics(per_game, lam)
        return y

    def pool(self, x: Float[Array, "n d"], *, players: Optional[Bool[Array, " n"]] = None,
             key: Optional[PRNGKeyArray] = None, return_diagnostics: bool = False):
        """The paper's pooled output: one game over the sequence, z = W_O concat_h(z_h)
        `(D,)` (eqs. 26–27), for a classifier head.

        **Arguments:** `x (n, D)`; `players (n,)` boolean, False for padding (default: all);
        `key`, `return_diagnostics` as `__call__`. Any `mode` may pool.

        **Returns:** `(D,)`, or `((D,), diagnostics)`.
        """
        check_shapes("NeuroGameAttention.pool", x, x, self.dim)
        self._check_players(x.shape[0])
        H = self.num_heads
        v = project_heads(self.to_v, x, H)
        lam = self.gates(x)
        players = jnp.ones((x.shape[0],), bool) if players is None else players
        if key is None:
            key, num_samples = jax.random.key(self.eval_seed), self.eval_samples
        else:
            num_samples = self.train_samples
        keys = jax.random.split(key, H)

        def head(v_h, lam_h, gamma_h, key_h):
            out, diag = self._play(v_h, v_h, players, lam_h, gamma_h, key_h, num_samples)
            return out, jax.tree.map(lambda a: a[None], diag)  # a game axis of size 1

        out, per_game = jax.vmap(head)(v, lam, self.gammas, keys)
        z = self.to_out(out.reshape(-1))
        if return_diagnostics:
            return z, self._diagnostics(per_game, lam)
        return z


__all__ = [
    "ExactValues",
    "GameEstimator",
    "Gate",
    "Mode",
    "MonteCarloValues",
    "NeuroGameAttention",
    "NeuroGameConfig",
    "NeuroGameDiagnostics",
    "Normalize",
    "PaperValues",
    "ValueFn",
]
