r"""Cooperative games as pure functions: Shapley values, Banzhaf indices and pairwise
interaction indices, exact (by enumeration) and by Monte Carlo, and the Gibbs-weighted
estimators of the NeuroGame Transformer (D. Bouchaffra, F. Ykhlef, H. Azzag, M. Lebbah,
B. Faye, "NeuroGame Transformer: Gibbs-Inspired Attention Driven by Game Theory and
Statistical Physics"; NGT below).

A game on n players is a vectorised characteristic function `v(masks) -> values`: `masks` is
boolean `(..., n)` (player i is in the coalition where `masks[..., i]`), `values` is `(...)`
float. `NormGame` is the game of the NGT attention layer, v(C) = f(‖Σ_{i∈C} V_i‖₂) (NGT eq. 2).
Every function takes one game; batch with `vmap`. `n` and `num_samples` are static Python
ints; the optional `players: Bool[(n,)]` is dynamic: non-players never join a coalition (the
game is evaluated on `masks & players`, so they are null players) and get 0 in every output.
Padded tokens are passed this way.

With Δ_i(C) = v(C ∪ {i}) − v(C) and Δ_ij(C) = v(C∪{i,j}) − v(C∪{i}) − v(C∪{j}) + v(C)
(NGT eqs. 1, 8), over the m players:

    Shapley       φ_i  = Σ_{C ⊆ N∖{i}} |C|!(m−|C|−1)!/m! · Δ_i(C)        (NGT eq. 4)
    Banzhaf       β_i  = 2^-(m−1) Σ_{C ⊆ N∖{i}} Δ_i(C)                    (NGT eq. 5)
    interaction   J_ij = 2^-(m−2) Σ_{C ⊆ N∖{i,j}} Δ_ij(C)                 (NGT eqs. 8–9)

(J is the Banzhaf interaction index: symmetric, zero diagonal.)

- Exact, by enumerating all 2^n coalitions (n ≤ `MAX_EXACT`): `shapley`, `banzhaf`,
  `interactions`.
- Unbiased Monte Carlo with per-entry standard errors (`Estimate`): `shapley_mc` (random
  permutations), `banzhaf_mc` (uniform random coalitions), `interactions_mc` (one coalition
  serves every pair). A `NormGame` takes a fast path through Gram-matrix expansions of the
  squared norms; any other callable takes the generic path. Both are differentiable with
  respect to the game's parameters (the sampled coalitions are constants).
- NGT's Algorithm 1 as printed: `ngt_estimates`, and the exact limits it converges to,
  `gibbs_banzhaf` and `gibbs_interactions`.

**What NGT's Gibbs-weighted estimators converge to.** NGT (§4.2.1, §4.3) weights each
sampled coalition by e^{v(C)/γ}/p(C) with p the proposal probability, self-normalises the K
weights, and calls the result an unbiased, consistent estimate of the Shapley value and the
Banzhaf index. Self-normalised importance sampling with proposal q and unnormalised target g
converges (as K → ∞) to E_q[(g/q)Δ]/E_q[g/q] = Σ_C g(C)Δ(C)/Σ_C g(C), i.e. to the average of
Δ under the target, not under the proposal. Here:

- Banzhaf branch: q(C) = 2^-(m−1) is constant, so the limit is the Gibbs-tilted average
  β^γ_i = Σ_C e^{v(C)/γ} Δ_i(C) / Σ_C e^{v(C)/γ} over C ⊆ N∖{i} (`gibbs_banzhaf`).
- Shapley branch: the prefix P (r uniform in {0, …, m−1}, then a uniform r-subset) is drawn
  with q(P) = r!(m−1−r)!/(m·(m−1)!) = p(P)/m, so the weight e^{v/γ}/p ∝ e^{v/γ}/q and the
  limit is the *same* β^γ_i. The 1/p factor cancels the Shapley weighting of the proposal:
  as γ → ∞ the Shapley branch tends to the Banzhaf index, not the Shapley value.
- Pair branch: the limit is J^γ_ij = Σ_C e^{v(C)/γ} Δ_ij(C) / Σ_C e^{v(C)/γ} over
  C ⊆ N∖{i,j} (`gibbs_interactions`).

Numerically (`experiments/ngt_worked_example.py`, on random norm games with many draws) all
three branches sit at these limits, while the Shapley branch misses φ and, at small γ, the
Banzhaf and pair branches miss β and J by amounts comparable to the values themselves
(`experiments/results/ngt/estimators.md`).

Only as γ → ∞ do the Banzhaf and pair branches become consistent for β and J; the Shapley
branch is consistent for the Shapley value at no γ (for games where φ ≠ β). As γ → 0 the
limits concentrate on the highest-value context (for a monotone game, N∖{i}: the marginal
contribution to the grand coalition). On top of this, self-normalisation has an O(1/K) bias,
−E_q[w̃²(Δ − μ)]/K with w̃ the weights scaled to mean one and μ the limit; at K = 1 the
weight is 1, so the Shapley branch's expectation at K = 1 is exactly the Shapley value (plain
permutation sampling) and the Banzhaf branch's is exactly β: the expectation moves from the
true value at K = 1 to the Gibbs-tilted limit as K grows. Sampling the Shapley prefix from q
without the 1/p factor would give the Gibbs tilt of the Shapley distribution, which does tend
to φ as γ → ∞.

```python
from spinformer.spins import coalitions as co
game = co.NormGame(vectors)                      # (n, d)
phi = co.shapley(game, n)                        # exact, n <= 16
est = co.shapley_mc(game, n, key=key, num_samples=256)
est.value, est.stderr                            # (n,), (n,)
```
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple, Optional

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Bool, Float, Int, PRNGKeyArray

from ._common import HIGHEST, mm

__all__ = [
    "MAX_EXACT",
    "Game",
    "NormGame",
    "Estimate",
    "NGTEstimates",
    "shapley",
    "banzhaf",
    "interactions",
    "shapley_mc",
    "banzhaf_mc",
    "interactions_mc",
    "ngt_estimates",
    "gibbs_banzhaf",
    "gibbs_interactions",
]

# Exact values enumerate all 2^n coalitions (one evaluation of v on a (2^n, n) batch).
MAX_EXACT = 16

Game = Callable[[Bool[Array, "... n"]], Float[Array, "..."]]
Players = Optional[Bool[ArrayLike, " n"]]

_NONLINEARITIES = {"identity": lambda x: x, "tanh": jnp.tanh, "relu": jax.nn.relu}


def _safe_sqrt(sq):
    """sqrt with finite gradients at 0 (and round-off negatives clamped to 0)."""
    sq = jnp.maximum(sq, 0.0)
    pos = sq > 0
    return jnp.where(pos, jnp.sqrt(jnp.where(pos, sq, 1.0)), 0.0)


class NormGame(eqx.Module):
    """The NGT attention game v(C) = f(‖Σ_{i∈C} V_i‖₂) (NGT eq. 2, with V_i = W_v x_i the
    value vectors).

    **Fields:**

    - `vectors`: the players' vectors V, shape `(n, d)`.
    - `f`: the nonlinearity, one of `"identity"`, `"tanh"`, `"relu"` (static).

    Calling it on boolean masks `(..., n)` returns the values `(...)`. The norm has finite
    gradients at the empty coalition (and wherever the sum vanishes): they are 0 there.
    The Monte Carlo estimators recognise a `NormGame` and expand the squared norms through
    the Gram matrix V Vᵀ instead of forming every coalition's sum.
    """

    vectors: Float[Array, "n d"]
    f: str = eqx.field(static=True, default="identity")

    def __check_init__(self):
        if self.f not in _NONLINEARITIES:
            raise ValueError(
                f"NormGame: f={self.f!r} is not one of {sorted(_NONLINEARITIES)}; pass the "
                "nonlinearity by name."
            )
        if jnp.ndim(self.vectors) != 2:
            raise ValueError(
                "NormGame: vectors must have shape (n, d) (one row per player), got shape "
                f"{jnp.shape(self.vectors)}. Build one game per call and vmap over a batch."
            )

    def __call__(self, masks: Bool[ArrayLike, "... n"]) -> Float[Array, "..."]:
        masks = jnp.asarray(masks)
        sums = mm(masks.astype(self.vectors.dtype), self.vectors)
        return self._from_sq(jnp.sum(sums * sums, axis=-1))

    def _from_sq(self, sq):
        """v from the squared norm of the coalition's sum."""
        return _NONLINEARITIES[self.f](_safe_sqrt(sq))

    def _gram(self):
        return mm(self.vectors, self.vectors.T)


class Estimate(NamedTuple):
    """A Monte Carlo estimate: `value` and, per entry, `stderr`, the standard error of the
    mean over the samples (std with ddof = 1 over √K). Same shapes."""

    value: Float[Array, "..."]
    stderr: Float[Array, "..."]


class NGTEstimates(NamedTuple):
    """The three outputs of NGT's Algorithm 1 estimators (see `ngt_estimates`)."""

    shapley: Float[Array, " n"]
    banzhaf: Float[Array, " n"]
    interactions: Float[Array, "n n"]


# ----------------------------------------------------------------------------- checks


def _check_n(name: str, n) -> int:
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        raise ValueError(f"{name}: n={n!r} must be a positive Python int (the number of "
                         "players; static).")
    return int(n)


def _check_exact(name: str, n) -> int:
    n = _check_n(name, n)
    if n > MAX_EXACT:
        raise ValueError(
            f"{name}: exact values enumerate all 2^n coalitions and are limited to "
            f"n <= MAX_EXACT = {MAX_EXACT}, got n={n}. Use the Monte Carlo estimators "
            "shapley_mc, banzhaf_mc or interactions_mc instead."
        )
    return n


def _check_samples(name: str, num_samples, minimum: int = 2) -> int:
    if (isinstance(num_samples, bool) or not isinstance(num_samples, (int, np.integer))
            or num_samples < minimum):
        why = ("a standard error needs at least 2 samples" if minimum == 2
               else "at least one draw per estimate")
        raise ValueError(
            f"{name}: num_samples={num_samples!r} must be a Python int >= {minimum} "
            f"({why}; it is static)."
        )
    return int(num_samples)


def _players(name: str, n: int, players) -> Bool[Array, " n"]:
    if players is None:
        return jnp.ones((n,), bool)
    players = jnp.asarray(players)
    if players.shape != (n,):
        raise ValueError(
            f"{name}: players must be a boolean mask of shape (n,) = ({n},), got shape "
            f"{players.shape}. Pass one game per call and vmap over a batch."
        )
    return players.astype(bool)


def _check_gamma(name: str, gamma) -> None:
    if isinstance(gamma, (int, float)) and not gamma > 0:
        raise ValueError(f"{name}: gamma={gamma} must be > 0 (the Gibbs temperature; "
                         "gamma=inf gives uniform weights).")


def _evaluate(name: str, v: Game, masks) -> Float[Array, "..."]:
    """v on `masks` (already restricted to the players), with a shape check."""
    out = jnp.asarray(v(masks))
    if out.shape != masks.shape[:-1]:
        raise ValueError(
            f"{name}: the game must map boolean masks of shape (..., n) to values of shape "
            f"(...); on masks of shape {masks.shape} it returned shape {out.shape}. Check "
            "that n matches the game and that v reduces over the last axis only."
        )
    if not jnp.issubdtype(out.dtype, jnp.floating):
        out = out.astype(jnp.float32)
    return out


# ----------------------------------------------------------------------------- exact values


def _enumeration(n: int):
    """Row index idx of all 2^n coalitions (bit i of idx = player i), bits 1 << i, and the
    membership mask, shapes (2^n, 1), (1, n), (2^n, n)."""
    idx = jnp.arange(2**n, dtype=jnp.int32)[:, None]
    bit = jnp.left_shift(1, jnp.arange(n, dtype=jnp.int32))[None, :]
    return idx, bit, (idx & bit) != 0


def _all_values(name, v, n, players):
    """v on all 2^n coalitions of the masked game, and the marginal contributions
    D[idx, i] = v(idx ∪ {i}) − v(idx ∖ {i}) (each coalition C ∌ i appears twice)."""
    idx, bit, member = _enumeration(n)
    values = _evaluate(name, v, member & players)
    D = values[idx | bit] - values[idx & ~bit]
    return values, D, idx, bit, member


def _shapley_weights(n: int) -> np.ndarray:
    """c!(n−c−1)!/n! for c = 0..n−1 (float64)."""
    return np.array([math.factorial(c) * math.factorial(n - c - 1) / math.factorial(n)
                     for c in range(n)])


def shapley(v: Game, n: int, *, players: Players = None) -> Float[Array, " n"]:
    """Exact Shapley values (NGT eq. 4) by enumerating all 2^n coalitions.

    **Arguments:**

    - `v`: the game, boolean masks `(..., n)` -> values `(...)`.
    - `n`: the number of players (static), at most `MAX_EXACT`.
    - `players`: optional boolean mask `(n,)`; the values are those of the game on the m
      players (non-players are null players: computing on the masked n-player game gives
      the same numbers).

    **Returns:** φ, shape `(n,)`; Σ_i φ_i = v(players) − v(∅); 0 for non-players.
    Cost: one evaluation of v on 2^n masks, then O(2^n n).
    """
    n = _check_exact("shapley", n)
    players = _players("shapley", n, players)
    _, D, _, _, member = _all_values("shapley", v, n, players)
    size = jnp.sum(member, axis=1, keepdims=True) - member  # |C| for C = idx ∖ {i}
    w = jnp.asarray(_shapley_weights(n), D.dtype)[size]
    phi = 0.5 * jnp.sum(w * D, axis=0)
    return jnp.where(players, phi, 0.0)


def banzhaf(v: Game, n: int, *, players: Players = None) -> Float[Array, " n"]:
    """Exact Banzhaf indices (NGT eq. 5): β_i = 2^-(m−1) Σ_{C ⊆ N∖{i}} Δ_i(C) over the m
    players, by enumerating all 2^n coalitions.

    **Arguments:** as `shapley`.

    **Returns:** β, shape `(n,)`; 0 for non-players.
    """
    n = _check_exact("banzhaf", n)
    players = _players("banzhaf", n, players)
    _, D, _, _, _ = _all_values("banzhaf", v, n, players)
    return jnp.where(players, jnp.mean(D, axis=0), 0.0)


def interactions(v: Game, n: int, *, players: Players = None) -> Float[Array, "n n"]:
    """Exact pairwise interactions (NGT eqs. 8–9, uniform weights; the Banzhaf interaction
    index): J_ij = 2^-(m−2) Σ_{C ⊆ N∖{i,j}} Δ_ij(C) over the m players.

    **Arguments:** as `shapley`.

    **Returns:** J, shape `(n, n)`, symmetric, zero diagonal, zero rows and columns for
    non-players. Computed as J_ij = 2^-(n−1) Σ_idx D_i(idx) σ_j(idx) with D the marginal
    contributions and σ_j = ±1 the membership of j (one matmul).
    """
    n = _check_exact("interactions", n)
    players = _players("interactions", n, players)
    _, D, _, _, member = _all_values("interactions", v, n, players)
    sigma = jnp.where(member, 1.0, -1.0).astype(D.dtype)
    J = mm(D.T, sigma) * (2.0 ** (1 - n))
    return _finish_pairs(0.5 * (J + J.T), players)


def _finish_pairs(J, players):
    """Zero diagonal, zero rows/columns of non-players."""
    n = J.shape[-1]
    keep = players[:, None] & players[None, :] & ~jnp.eye(n, dtype=bool)
    return jnp.where(keep, J, 0.0)


def gibbs_banzhaf(
    v: Game, n: int, *, gamma: float | Float[ArrayLike, ""], players: Players = None
) -> Float[Array, " n"]:
    """The Gibbs-tilted average of marginal contributions, exactly by enumeration:

        β^γ_i = Σ_{C ⊆ N∖{i}} e^{v(C)/γ} Δ_i(C) / Σ_{C ⊆ N∖{i}} e^{v(C)/γ}

    over the players. This is the K → ∞ limit of *both* the Shapley and the Banzhaf branch
    of NGT's Algorithm 1 (see the module docstring and `ngt_estimates`). As γ → ∞ it tends
    to the Banzhaf index (`gamma=float("inf")` gives `banzhaf` exactly).

    **Arguments:** as `shapley`, and `gamma > 0`, the temperature.

    **Returns:** β^γ, shape `(n,)`; 0 for non-players.
    """
    n = _check_exact("gibbs_banzhaf", n)
    _check_gamma("gibbs_banzhaf", gamma)
    players = _players("gibbs_banzhaf", n, players)
    values, D, idx, bit, _ = _all_values("gibbs_banzhaf", v, n, players)
    w = jax.nn.softmax(values[idx & ~bit] / gamma, axis=0)  # weight of C = idx ∖ {i}
    return jnp.where(players, jnp.sum(w * D, axis=0), 0.0)


def gibbs_interactions(
    v: Game, n: int, *, gamma: float | Float[ArrayLike, ""], players: Players = None
) -> Float[Array, "n n"]:
    """The Gibbs-tilted average of pair interactions, exactly by enumeration:

        J^γ_ij = Σ_{C ⊆ N∖{i,j}} e^{v(C)/γ} Δ_ij(C) / Σ_{C ⊆ N∖{i,j}} e^{v(C)/γ}

    over the players: the K → ∞ limit of the pair branch of NGT's Algorithm 1. As γ → ∞ it
    tends to `interactions`.

    **Arguments:** as `gibbs_banzhaf`.

    **Returns:** J^γ, shape `(n, n)`, symmetric, zero diagonal, zero for non-players.
    Cost: O(2^n n²) (one row of pairs at a time).
    """
    n = _check_exact("gibbs_interactions", n)
    _check_gamma("gibbs_interactions", gamma)
    players = _players("gibbs_interactions", n, players)
    values, _, idx, bit, _ = _all_values("gibbs_interactions", v, n, players)
    bit = bit[0]

    def row(i):
        bi = jnp.left_shift(1, i)
        ctx = idx & ~bi & ~bit  # (2^n, n): C = idx ∖ {i, j}
        delta = (values[ctx | bi | bit] - values[ctx | bi] - values[ctx | bit]
                 + values[ctx])
        w = jax.nn.softmax(values[ctx] / gamma, axis=0)
        return jnp.sum(w * delta, axis=0)

    J = jax.lax.map(row, jnp.arange(n, dtype=jnp.int32))
    return _finish_pairs(0.5 * (J + J.T), players)


# ----------------------------------------------------------------------------- Monte Carlo


# Sums over the draws (the leading axis) in the interactions' reverse pass, as a chain of
# adds of slices up to this many draws: XLA on CPU fuses the reduction over the leading axis
# with the elementwise work that produces it into a much slower loop (under vmap). Not for
# arrays that are differentiated again (the reverse pass of the slices is costly).
_UNROLL_DRAWS = 64


def _draw_sum(x):
    """Σ_k x[k] over the leading axis."""
    if x.shape[0] > _UNROLL_DRAWS:
        return jnp.sum(x, axis=0)
    parts = jnp.split(x, x.shape[0], axis=0)  # its transpose is one concatenate
    out = parts[0]
    for part in parts[1:]:
        out = out + part
    return out[0]


def _estimate(samples) -> Estimate:
    K = samples.shape[0]
    mean = jnp.mean(samples, axis=0)
    var = jnp.sum((samples - mean) ** 2, axis=0) / (K - 1)
    return Estimate(mean, _safe_sqrt(var) / math.sqrt(K))


def _random_ranks(key, shape, players):
    """Uniform random orders of the players, non-players last: the rank (position) of every
    player, int `shape + (n,)`: the number of players that precede it. Computed by O(n²)
    comparisons of uniform keys rather than a sort (XLA's sort was the slowest piece of the
    estimators on CPU); ties of the keys (about n²/2^25 per order in float32) are broken by
    index, so the ranks are always a permutation."""
    u = jax.random.uniform(key, shape + players.shape)
    return _ranks(jnp.where(players, u, 2.0))


def _ranks(u):
    """The rank of every entry of `u (..., n)` along the last axis (ties broken by index)."""
    n = u.shape[-1]
    ui, uj = u[..., :, None], u[..., None, :]
    idx = jnp.arange(n)
    before = (uj < ui) | ((uj == ui) & (idx[None, :] < idx[:, None]))
    # counted by a product with a ones vector (exact in float32 for n < 2^24), which XLA:CPU
    # runs faster than an integer sum over the last axis
    ones = jnp.ones((n,), jnp.float32)
    count = jnp.einsum("...ij,j->...i", before.astype(jnp.float32), ones, precision=HIGHEST)
    return count.astype(jnp.result_type(int))  # the default integer, as jnp.sum's


def shapley_mc(
    v: Game, n: int, *, key: PRNGKeyArray, num_samples: int, players: Players = None
) -> Estimate:
    """Unbiased Monte Carlo Shapley values from `num_samples` = K random permutations of the
    players: one permutation gives every player's marginal contribution to the players
    before it, from the n + 1 prefixes of the permutation, so the cost is K·(n + 1)
    evaluations of v (one batched call on masks `(K, n + 1, n)`). For a `NormGame` the
    prefix sums are one triangular matmul of the permuted vectors, O(K n² d).

    **Arguments:**

    - `v`: the game, boolean masks `(..., n)` -> values `(...)`.
    - `n`: the number of players (static).
    - `key`: a PRNG key.
    - `num_samples`: K >= 2 permutations (static).
    - `players`: optional boolean mask `(n,)`; non-players are never in a coalition and get 0.

    **Returns:** an `Estimate` with `value` and `stderr` of shape `(n,)`. Differentiable in
    the game's parameters (the permutations are constants).
    """
    n = _check_n("shapley_mc", n)
    K = _check_samples("shapley_mc", num_samples)
    players = _players("shapley_mc", n, players)
    rank = _random_ranks(key, (K,), players)  # (K, n)
    if isinstance(v, NormGame):
        _check_game_size("shapley_mc", v, n)
        # the player at each position (inverse permutation by a scatter, not a sort)
        order = jnp.zeros_like(rank).at[jnp.arange(K)[:, None], rank].set(jnp.arange(n))
        vec = v.vectors[order] * players[order][..., None].astype(v.vectors.dtype)
        # prefix of length t + 1, (K, n, d): one (n, n) lower-triangular matmul shared by
        # every draw (and every game under vmap), whose gradient is cheaper than
        # `jnp.cumsum`'s
        tri = jnp.asarray(np.tril(np.ones((n, n))), vec.dtype)
        sums = jnp.einsum("ts,ksd->ktd", tri, vec, precision=HIGHEST)
        sq = jnp.concatenate([jnp.zeros((K, 1), sums.dtype), jnp.sum(sums * sums, -1)], 1)
        vals = v._from_sq(sq)  # (K, n + 1)
    else:
        prefixes = rank[:, None, :] < jnp.arange(n + 1)[None, :, None]  # (K, n + 1, n)
        vals = _evaluate("shapley_mc", v, prefixes & players)
    diffs = vals[:, 1:] - vals[:, :-1]  # marginal contribution of the player at position t
    contrib = jnp.take_along_axis(diffs, rank, axis=1)
    return _estimate(jnp.where(players, contrib, 0.0))


def _check_game_size(name, game: NormGame, n):
    if game.vectors.shape[0] != n:
        raise ValueError(
            f"{name}: the NormGame has {game.vectors.shape[0]} players (vectors of shape "
            f"{game.vectors.shape}) but n={n}. Pass n = vectors.shape[0]."
        )


class _Flips(NamedTuple):
    """Gram-expansion pieces of coalitions b `(K, n)`: ‖S‖² `(K,)`, s = U S `(K, n)`, the
    flip coefficients a = 1 − 2b (0 for non-players) and the sizes |b| `(K,)`."""

    sq: Array
    s: Array
    a: Array
    size: Array


def _flips(game: NormGame, b, players) -> _Flips:
    U = game.vectors
    bf = b.astype(U.dtype)
    S = mm(bf, U)
    return _Flips(jnp.sum(S * S, axis=-1), mm(S, U.T),
                  (1.0 - 2.0 * bf) * players.astype(U.dtype), jnp.sum(bf, axis=-1))


def _flip_values(game: NormGame, fl: _Flips):
    """v(b) `(K,)` and v(b with player i toggled) `(K, n)` through
    ‖S + a u_i‖² = ‖S‖² + a² G_ii + 2a (U S)_i, a = ±1 (0 for non-players)."""
    U = game.vectors
    sq_flip = fl.sq[..., None] + fl.a * fl.a * jnp.sum(U * U, axis=-1) + 2.0 * fl.a * fl.s
    # the empty coalition exactly (the expansion leaves round-off where the norm has a kink)
    empty = fl.size[..., None] + fl.a == 0
    return game._from_sq(fl.sq), game._from_sq(jnp.where(empty, 0.0, sq_flip))


def banzhaf_mc(
    v: Game, n: int, *, key: PRNGKeyArray, num_samples: int, players: Players = None
) -> Estimate:
    """Unbiased Monte Carlo Banzhaf indices from `num_samples` = K uniform random coalitions
    B of the players (each player in with probability 1/2). The same draws serve every
    player: its contribution is v(B ∪ {i}) − v(B ∖ {i}), one of which is v(B), so the cost
    is K·(n + 1) evaluations of v (O(K n d) for a `NormGame`).

    **Arguments:** as `shapley_mc`.

    **Returns:** an `Estimate` with `value` and `stderr` of shape `(n,)`.
    """
    n = _check_n("banzhaf_mc", n)
    K = _check_samples("banzhaf_mc", num_samples)
    players = _players("banzhaf_mc", n, players)
    b = jax.random.bernoulli(key, 0.5, (K, n)) & players
    if isinstance(v, NormGame):
        _check_game_size("banzhaf_mc", v, n)
        v_b, v_flip = _flip_values(v, _flips(v, b, players))
    else:
        flips = (b[:, None, :] ^ jnp.eye(n, dtype=bool)) & players  # (K, n, n)
        masks = jnp.concatenate([b[:, None, :], flips], axis=1)
        vals = _evaluate("banzhaf_mc", v, masks)
        v_b, v_flip = vals[:, 0], vals[:, 1:]
    contrib = jnp.where(b, v_b[:, None] - v_flip, v_flip - v_b[:, None])
    return _estimate(jnp.where(players, contrib, 0.0))


_NONLINEARITY_GRADS = {
    "identity": lambda r: jnp.ones_like(r),
    "tanh": lambda r: 1.0 - jnp.tanh(r) ** 2,
    "relu": lambda r: (r > 0).astype(r.dtype),
}


def _slope(f: str, q):
    """d f(√q) / dq, 0 where q ≤ 0 (as the safe sqrt's gradient)."""
    pos = q > 0
    r = jnp.sqrt(jnp.where(pos, q, 1.0))
    return jnp.where(pos, _NONLINEARITY_GRADS[f](r) / (2.0 * r), 0.0)


def _double_flip_sq(sq, s, G, a, size):
    """‖S + a_i u_i + a_j u_j‖² `(K, n, n)` from ‖S‖² `(K,)`, s = U S `(K, n)`, G = U Uᵀ and
    the flip coefficients a = 1 − 2b `(K, n)` (0 for non-players); exactly 0 where the
    coalition B ⊕ {i, j} is empty (the expansion leaves round-off at the norm's kink)."""
    t = jnp.diagonal(G) + 2.0 * a * s  # a² = 1 for players
    out = (sq[:, None, None] + t[:, :, None] + t[:, None, :]
           + 2.0 * a[:, :, None] * a[:, None, :] * G)
    empty = size[:, None, None] + a[:, :, None] + a[:, None, :] == 0
    return jnp.where(empty, 0.0, out)


@jax.custom_vjp
def _double_flip_values(f, sq, s, G, a, size):
    """v(B ⊕ {i, j}) `(K, n, n)` of the game f(‖Σ_C u‖) for every draw and pair (see
    `_double_flip_sq`). A custom VJP: its reverse pass is one fused elementwise pass and
    three reductions over the (K, n, n) array, where autodiff's costs many times the
    forward."""
    return _NONLINEARITIES[f.value](_safe_sqrt(_double_flip_sq(sq, s, G, a, size)))


def _double_flip_fwd(f, sq, s, G, a, size):
    return _double_flip_values(f, sq, s, G, a, size), (f, sq, s, G, a, size)


def _double_flip_bwd(res, C):
    f, sq, s, G, a, size = res
    w = C * _slope(f.value, _double_flip_sq(sq, s, G, a, size))  # ∂L/∂q, (K, n, n)
    rows, cols = jnp.sum(w, axis=-1), jnp.sum(w, axis=-2)  # (K, n) each
    d_sq = jnp.sum(rows, axis=-1)
    d_s = 2.0 * a * (rows + cols)
    d_G = 2.0 * _draw_sum(w * a[:, :, None] * a[:, None, :])
    d_G = d_G + jnp.diag(jnp.sum(rows + cols, axis=0))  # the g_i + g_j terms
    return None, d_sq, d_s, d_G, jnp.zeros_like(a), jnp.zeros_like(size)


_double_flip_values.defvjp(_double_flip_fwd, _double_flip_bwd)


class _Static(eqx.Module):
    """A hashable, non-array argument of a custom-VJP function (no cotangent)."""

    value: str = eqx.field(static=True)


def interactions_mc(
    v: Game, n: int, *, key: PRNGKeyArray, num_samples: int, players: Players = None
) -> Estimate:
    """Unbiased Monte Carlo pairwise interactions J_ij (as `interactions`) from
    `num_samples` = K uniform random coalitions B of the players: one draw serves every pair
    through Δ_ij(B ∖ {i, j}).

    For a generic v the 4 masks of every pair are evaluated in one batched call (K·n²·4
    evaluations, masks `(K, n, n, 4, n)`). For a `NormGame`, with σ_i = +1 for i ∈ B and −1
    otherwise, Δ_ij(B ∖ {i, j}) = σ_i σ_j [v(B) − v(B ⊕ i) − v(B ⊕ j) + v(B ⊕ {i, j})]
    (⊕ toggles membership), so the K·n single flips are shared by all pairs and only the
    double flips form a (K, n, n) array, through Gram expansions: with S = Σ_{k∈B} u_k,
    s = U S, G = U Uᵀ, ‖S + σ'_i u_i + σ'_j u_j‖² = ‖S‖² + G_ii + G_jj + 2σ'_i s_i
    + 2σ'_j s_j + 2σ'_i σ'_j G_ij with σ' = −σ. Cost O(K n (n + d)).

    **Arguments:** as `shapley_mc`.

    **Returns:** an `Estimate` with `value` and `stderr` of shape `(n, n)`, symmetric with a
    zero diagonal and zero rows/columns for non-players.
    """
    n = _check_n("interactions_mc", n)
    K = _check_samples("interactions_mc", num_samples)
    players = _players("interactions_mc", n, players)
    b = jax.random.bernoulli(key, 0.5, (K, n)) & players
    if isinstance(v, NormGame):
        _check_game_size("interactions_mc", v, n)
        # Δ_ij(B ∖ {i, j}) = σ_i σ_j [v(B) − v(B ⊕ i) − v(B ⊕ j) + v(B ⊕ {i, j})] with
        # σ = +1 in B, −1 outside (check the four memberships of i, j): v(B) and v(B ⊕ i)
        # are O(K n), only v(B ⊕ {i, j}) needs a (K, n, n) array.
        fl = _flips(v, b, players)
        v_b, v_i = _flip_values(v, fl)
        v_ij = _double_flip_values(_Static(v.f), fl.sq, fl.s, v._gram(), fl.a, fl.size)
        a = fl.a
        delta = (a[:, :, None] * a[:, None, :]
                 * (v_b[:, None, None] - v_i[:, :, None] - v_i[:, None, :] + v_ij))
    else:
        eye = jnp.eye(n, dtype=bool)
        base = b[:, None, None, :] & ~eye[None, :, None, :] & ~eye[None, None, :, :]
        ei = eye[None, :, None, :]
        ej = eye[None, None, :, :]
        masks = jnp.stack([base, base | ej, base | ei, base | ei | ej], axis=3)
        vals = _evaluate("interactions_mc", v, masks & players)  # (K, n, n, 4)
        delta = vals[..., 3] - vals[..., 2] - vals[..., 1] + vals[..., 0]
    keep = players[:, None] & players[None, :] & ~jnp.eye(n, dtype=bool)
    return _estimate(jnp.where(keep, delta, 0.0))


# ----------------------------------------------------------------------------- NGT


class _NGTDraws(NamedTuple):
    """The random draws of NGT's Algorithm 1 (one set per player and per pair).

    - `prefixes` `(n, K, n)`: Shapley branch, the first r players of a random permutation of
      the other players (row i excludes i).
    - `sizes` `(n, K)`: r, uniform in {0, …, m − 1}.
    - `coalitions` `(n, K, n)`: Banzhaf branch, Bernoulli(1/2) coalitions of the others.
    - `pair_coalitions` `(P, K, n)`: pair branch, Bernoulli(1/2) coalitions of the players
      other than i and j, for the P = n(n−1)/2 pairs i < j in `np.triu_indices(n, 1)` order.
    """

    prefixes: Bool[Array, "n K n"]
    sizes: Int[Array, "n K"]
    coalitions: Bool[Array, "n K n"]
    pair_coalitions: Bool[Array, "P K n"]


def _ngt_draw(key, n: int, num_samples: int, players) -> _NGTDraws:
    K = num_samples
    iu, ju = np.triu_indices(n, 1)
    shapes = [(n, K, n), (n, K), (n, K, n), (len(iu), K, n)]
    # one call of the generator for every draw (each call costs a compile of its own)
    u = jax.random.uniform(key, (sum(math.prod(x) for x in shapes),))
    cuts = np.cumsum([math.prod(x) for x in shapes])[:-1]
    u_perm, u_size, u_ban, u_pair = (x.reshape(sh) for x, sh in zip(jnp.split(u, cuts), shapes))
    eye = jnp.eye(n, dtype=bool)
    others = players[None, :] & ~eye  # (n, n): the players other than i
    m = jnp.sum(players).astype(jnp.int32)
    u_perm = jnp.where(others[:, None, :], u_perm, 2.0)
    rank = _ranks(u_perm)  # a uniform order of the others
    sizes = jnp.clip(jnp.floor(u_size * m).astype(jnp.int32), 0, jnp.maximum(m - 1, 0))
    prefixes = (rank < sizes[..., None]) & others[:, None, :]
    coalitions = (u_ban < 0.5) & others[:, None, :]
    pair_others = players[None, :] & ~eye[iu] & ~eye[ju]  # (P, n)
    pair_coalitions = (u_pair < 0.5) & pair_others[:, None, :]
    return _NGTDraws(prefixes, sizes, coalitions, pair_coalitions)


def _ngt_values(v, draws: _NGTDraws, players):
    """v on the draws and on the draws with i (resp. i, j) added: (v(P), v(P ∪ i)),
    (v(C), v(C ∪ i)) each `(n, K)`, and (v(C), v(C ∪ i), v(C ∪ j), v(C ∪ ij)) each `(P, K)`."""
    n = players.shape[0]
    iu, ju = np.triu_indices(n, 1)
    if isinstance(v, NormGame):
        U = v.vectors
        G = v._gram()
        g = jnp.diagonal(G)
        pf = players.astype(U.dtype)

        def with_i(masks):  # (n, K, n): v(C) and v(C ∪ i) with C from row i
            S = mm(masks.astype(U.dtype), U)  # (n, K, d)
            sq = jnp.sum(S * S, axis=-1)
            s_i = jnp.einsum("ikd,id->ik", S, U, precision=jax.lax.Precision.HIGHEST)
            return v._from_sq(sq), v._from_sq(sq + pf[:, None] * (g[:, None] + 2 * s_i))

        shap = with_i(draws.prefixes)
        ban = with_i(draws.coalitions)
        S = mm(draws.pair_coalitions.astype(U.dtype), U)  # (P, K, d)
        sq = jnp.sum(S * S, axis=-1)
        s_i = jnp.einsum("pkd,pd->pk", S, U[iu], precision=jax.lax.Precision.HIGHEST)
        s_j = jnp.einsum("pkd,pd->pk", S, U[ju], precision=jax.lax.Precision.HIGHEST)
        a_i, a_j = pf[iu][:, None], pf[ju][:, None]
        sq_i = sq + a_i * (g[iu][:, None] + 2 * s_i)
        sq_j = sq + a_j * (g[ju][:, None] + 2 * s_j)
        sq_ij = sq_i + sq_j - sq + 2 * a_i * a_j * G[iu, ju][:, None]
        pair = tuple(v._from_sq(x) for x in (sq, sq_i, sq_j, sq_ij))
        return shap, ban, pair
    eye = jnp.eye(n, dtype=bool)
    ei = eye[:, None, :]
    pi, pj = eye[iu][:, None, :], eye[ju][:, None, :]
    pc = draws.pair_coalitions
    groups = [
        jnp.stack([draws.prefixes, draws.prefixes | ei], axis=2),  # (n, K, 2, n)
        jnp.stack([draws.coalitions, draws.coalitions | ei], axis=2),
        jnp.stack([pc, pc | pi, pc | pj, pc | pi | pj], axis=2),  # (P, K, 4, n)
    ]
    flat = jnp.concatenate([x.reshape(-1, n) for x in groups], axis=0) & players
    vals = _evaluate("ngt_estimates", v, flat)  # one batched evaluation
    out, start = [], 0
    for x in groups:
        size = math.prod(x.shape[:-1])
        y = vals[start:start + size].reshape(x.shape[:-1])
        out.append(tuple(y[..., c] for c in range(x.shape[2])))
        start += size
    return tuple(out)


def _ngt_from_draws(v, draws: _NGTDraws, gamma, players) -> NGTEstimates:
    """Algorithm 1's three estimators given its draws (log-space self-normalised weights)."""
    n = players.shape[0]
    (vp, vp_i), (vc, vc_i), (w0, wi, wj, wij) = _ngt_values(v, draws, players)
    m = jnp.sum(players).astype(vp.dtype)
    r = draws.sizes.astype(vp.dtype)
    log_p_shap = (jax.lax.lgamma(r + 1) + jax.lax.lgamma(jnp.maximum(m - r, 1.0))
                  - jax.lax.lgamma(jnp.maximum(m, 1.0)))
    log2 = math.log(2.0)

    def snis(v_ctx, log_p, delta):
        w = jax.nn.softmax(v_ctx / gamma - log_p, axis=-1)  # over the K draws
        return jnp.sum(w * delta, axis=-1)

    phi = snis(vp, log_p_shap, vp_i - vp)
    beta = snis(vc, -(m - 1) * log2, vc_i - vc)
    pair = snis(w0, -(m - 2) * log2, wij - wi - wj + w0)
    iu, ju = np.triu_indices(n, 1)
    J = jnp.zeros((n, n), pair.dtype).at[iu, ju].set(pair)
    return NGTEstimates(
        shapley=jnp.where(players, phi, 0.0),
        banzhaf=jnp.where(players, beta, 0.0),
        interactions=_finish_pairs(J + J.T, players),
    )


def ngt_estimates(
    v: Game,
    n: int,
    *,
    key: PRNGKeyArray,
    num_samples: int,
    gamma: float | Float[ArrayLike, ""],
    players: Players = None,
) -> NGTEstimates:
    """NGT's Gibbs-weighted, self-normalised importance-sampling estimators exactly as its
    Algorithm 1 prints them (NGT §4.2.1, eqs. 31–36), with m the number of players:

    - Shapley branch, for each player i, K independent draws: a random permutation π of the
      other players, r uniform in {0, …, m − 1}, the prefix P = first r of π,
      p = r!(m−1−r)!/(m−1)!, raw weight e^{v(P)/γ}/p, Δ = v(P ∪ {i}) − v(P);
      φ̂_i = Σ_k w̄_k Δ_k with the weights normalised over the K draws of player i.
    - Banzhaf branch: C ⊆ others by Bernoulli(1/2), p = 2^-(m−1), weight e^{v(C)/γ}/p,
      Δ = v(C ∪ {i}) − v(C).
    - Pair branch, for every pair i < j: K Bernoulli(1/2) coalitions C of the players other
      than i and j, p = 2^-(m−2), weight e^{v(C)/γ}/p, Δ_ij(C); symmetric, zero diagonal.

    Weights are computed in log space with a log-sum-exp (p = 2^-(n−1) alone overflows
    float32 beyond n ≈ 128, and e^{v/γ} at small γ much sooner). Algorithm 1 uses the raw
    norm for v; here v is whatever game is passed. No loops over players or pairs: every
    draw is an array, a `NormGame` goes through Gram expansions and batched matmuls, a
    generic v gets one batched evaluation.

    **What these converge to (K → ∞).** Not to the Shapley value and the Banzhaf index, as
    NGT states. Self-normalisation turns both the Shapley and the Banzhaf branch into the
    same Gibbs-tilted average over uniform subsets, `gibbs_banzhaf(v, n, gamma=gamma)`
    (the Shapley proposal has probability p/m, so the 1/p factor undoes it), and the pair
    branch into `gibbs_interactions(v, n, gamma=gamma)`. As γ → ∞ these become the Banzhaf
    index and the Banzhaf interaction index; the Shapley value is the limit of neither (on
    random norm games the Shapley branch converges to β^γ and misses φ at every γ:
    `experiments/results/ngt/estimators.md`). At finite K self-normalisation adds
    an O(1/K) bias (at K = 1 the estimators are plain, unbiased Monte Carlo for φ, β and J).

    **Arguments:**

    - `v`: the game, boolean masks `(..., n)` -> values `(...)`.
    - `n`: the number of players (static).
    - `key`: a PRNG key.
    - `num_samples`: K >= 1 draws per player and per pair (static).
    - `gamma`: the temperature γ > 0.
    - `players`: optional boolean mask `(n,)`; non-players never join and get 0.

    **Returns:** an `NGTEstimates` with `shapley (n,)`, `banzhaf (n,)`, `interactions (n, n)`.
    Memory: the pair draws hold n(n−1)/2 · K · n booleans.
    """
    n = _check_n("ngt_estimates", n)
    K = _check_samples("ngt_estimates", num_samples, minimum=1)
    _check_gamma("ngt_estimates", gamma)
    players = _players("ngt_estimates", n, players)
    if isinstance(v, NormGame):
        _check_game_size("ngt_estimates", v, n)
    draws = _ngt_draw(key, n, K, players)
    return _ngt_from_draws(v, draws, gamma, players)
