r"""Exact Boltzmann-attention marginals for many queries sharing one set of couplings.

G. Kim, D. K. Park, "Boltzmann Attention: Learnable Ising Couplings for Cooperative
Attention", arXiv:2606.12478 (2026), Eq. (8): for query q the attention pattern s ∈ {-1, +1}^T over
key positions follows

    P_q(s) ∝ exp( Σ_j h_qj s_j + Σ_{j<k} J_jk s_j s_k [+ Σ_{j<k<l} K_jkl s_j s_k s_l] ),

i.e. the Ising weight exp(−E) of `spinformer.spins.ising` at β = 1, with fields h_q (one row
per query) and couplings J (and K) shared by every query. With causal masking query q sees
positions 0..q only and the couplings act only among visible positions (Kim & Park 2026, §3.2).

How the enumeration is organised (2^T configurations, spin k is bit k of the configuration
index, s_k = 1 − 2·bit_k as in `ising`):

- The coupling energy ½ sᵀJs (+ three-body) of a configuration does not depend on the query:
  it is computed once per chunk of configurations and shared by all queries; the field term
  h @ Sᵀ and the marginals p @ S are matrix products.
- A causal query with n visible positions only needs the configurations whose hidden bits are
  0: the first 2^n indices, a *prefix* of the enumeration. Its hidden spins then sit at +1,
  which adds to the shared energy a term linear in the visible spins, (J u)·s with u the
  hidden indicator; subtracting it from the query's fields restores the visible-only model
  (with K, a pairwise and a field correction, see `_corrections`). So configurations in
  [2^(m−1), 2^m) are only touched by the queries with at least m visible positions: about
  2·2^T configuration-query pairs for Q = T instead of T·2^T (less than twice that once
  levels are grouped, see below).
- Configurations are processed in chunks of 2^12 with partial log-sum-exps combined at the
  end, so float32 keeps ~1e-6 accuracy at T = 20 and memory stays at O(Q·2^12) per chunk;
  chunk bodies are rematerialised in the backward pass (`jax.checkpoint`), so gradients by
  plain autodiff stay memory-bounded as well. Levels of chunks needing similar numbers of
  queries share one loop (masked), so only about log2(Q) loops are compiled.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Float

from ._common import HIGHEST, MAX_BOLTZMANN_T, bits, mm, sym3, sym_offdiag, upper3

__all__ = ["boltzmann_marginals"]

_CHUNK_BITS = 12
_MASKED = -1e30


def _check(name, h, J, K):
    hs, Js = jnp.shape(h), jnp.shape(J)
    if len(hs) != 2:
        raise ValueError(
            f"{name}: h must have shape (Q, T) (one row of fields per query, one column per "
            f"key position), got shape {hs}. vmap over batches and heads."
        )
    Q, T = hs
    if T < 1 or Q < 1:
        raise ValueError(f"{name}: h must have at least one query and one position, got {hs}.")
    if Js != (T, T):
        raise ValueError(
            f"{name}: J must have shape (T, T) = ({T}, {T}) to match h's {T} positions, got {Js}."
        )
    if K is not None and jnp.shape(K) != (T, T, T):
        raise ValueError(
            f"{name}: K must have shape (T, T, T) = ({T}, {T}, {T}), got {jnp.shape(K)}. "
            "Only the entries K[j, k, l] with j < k < l are used."
        )
    if T > MAX_BOLTZMANN_T:
        raise ValueError(
            f"{name}: exact enumeration over T={T} positions needs 2^{T} configurations per "
            f"query; it is limited to T <= {MAX_BOLTZMANN_T}. Use ising.mean_field / ising.tap, "
            "or a sampler from spinformer.spins.samplers (gibbs, parallel_tempering) instead."
        )
    return Q, T


def _corrections(h, J, K_sym, n_vis):
    """Per-query fields (and pair couplings with K) that undo hidden spins fixed at +1.

    For query q with visible indicator v and hidden indicator u = 1 − v, a configuration of
    the prefix block has s = v∘σ + u. The shared energy ½ sᵀJs then contains σ·(J u) on top
    of the visible-only energy; with the symmetric three-body tensor Ks (E₃ = ⅙ Σ Ks sss) it
    contains ½ σᵀ(Ks·u)σ + ½ σ·(Ks:uu). These are subtracted here.
    """
    Q, T = h.shape
    v = (np.arange(T)[None, :] < n_vis[:, None]).astype(np.float32)  # (Q, T)
    u = 1.0 - v
    vj, uj = jnp.asarray(v, h.dtype), jnp.asarray(u, h.dtype)
    h_eff = vj * (h - mm(uj, J))  # J symmetric
    M = None
    if K_sym is not None:
        Ku = jnp.einsum("jkl,ql->qjk", K_sym, uj, precision=HIGHEST)  # (Q, T, T)
        h_eff = h_eff - 0.5 * vj * jnp.einsum("qjk,qk->qj", Ku, uj, precision=HIGHEST)
        M = -0.5 * (vj[:, :, None] * vj[:, None, :] * Ku).reshape(Q, T * T)
    return h_eff, M, vj


def boltzmann_marginals(
    h: Float[ArrayLike, "Q T"],
    J: Float[ArrayLike, "T T"],
    *,
    causal: bool = True,
    K: Float[ArrayLike, "T T T"] | None = None,
) -> Float[Array, "Q T"]:
    r"""Exact magnetizations ⟨s_j⟩_q of Boltzmann attention for many queries sharing J.

    Kim & Park (2026), Eq. (8): P_q(s) ∝ exp(h_q·s + ½ sᵀJs [+ Σ_{j<k<l} K_jkl
    s_j s_k s_l]); the attention weights are α_qj = (⟨s_j⟩_q + 1)/2 (Eq. 9), normalised over
    visible positions by the caller. Same sign convention as `ising.exact_marginals` at
    β = 1 (E = −(h·s + ½ sᵀJs), weight exp(−E)).

    **Arguments:**

    - `h`: fields `(Q, T)`, h_qj = q_q·k_j/√d_k: one row per query, one column per position.
    - `J`: couplings `(T, T)`, shared by all queries. Only the symmetric, off-diagonal part is
      used ((J + Jᵀ)/2 with the diagonal dropped), so gradients come out symmetric.
    - `causal`: if true, query q sees positions 0..min(q, T−1) only: the couplings act only
      among visible positions and invisible positions get magnetization 0 in the output.
    - `K`: optional three-body couplings `(T, T, T)`; only K[j, k, l] with j < k < l is used
      (Kim & Park 2026, Appendix C), as in `ising.exact_marginals`.

    **Returns:** magnetizations `(Q, T)` (0 at invisible positions when causal).

    Cost: about 2^T·T·(Q + T) without masking; with causal masking each configuration is
    visited only by the queries that see all its non-zero bits (≈ 2·2^T query-configurations
    for Q = T). Memory O(Q·2^12) per chunk, also in the backward pass. T ≤ 24; for longer
    windows use `ising.mean_field`/`ising.tap` or the samplers.
    """
    name = "boltzmann_marginals"
    Q, T = _check(name, h, J, K)
    dt = jnp.result_type(h, J, jnp.float32) if K is None else jnp.result_type(h, J, K, jnp.float32)
    if not jnp.issubdtype(dt, jnp.floating):
        dt = jnp.float32
    h = jnp.asarray(h, dt)
    J = jnp.asarray(J, dt)
    J = sym_offdiag(J)
    K_upper = K_sym = None
    if K is not None:
        K_upper = upper3(jnp.asarray(K, dt))
        K_sym = sym3(K_upper)

    if causal:
        n_vis = np.minimum(np.arange(Q) + 1, T)
        h_eff, M, vis = _corrections(h, J, K_sym, n_vis)
    else:
        n_vis = np.full(Q, T)
        h_eff, M, vis = h, None, None

    lo = min(T, _CHUNK_BITS)
    hi = T - lo
    S_lo = jnp.asarray(bits(lo), dt)  # (C, lo)
    J_ll, J_lh, J_hh = J[:lo, :lo], J[:lo, lo:], J[lo:, lo:]
    base = 0.5 * jnp.sum(mm(S_lo, J_ll) * S_lo, axis=1)  # shared coupling energy, low block
    shifts = jnp.arange(hi, dtype=jnp.int32)
    if K is not None:
        K_pairs_l = K_upper.reshape(T * T, T).T  # (l, (j, k))
    C = 2**lo

    def make_chunk(h_sub, M_sub, lim_sub):
        """Partial log-sum-exp and normalised mean of one chunk, for a subset of queries."""

        def chunk(c):
            s_hi = (1 - 2 * ((c >> shifts) & 1)).astype(dt)  # (hi,)
            neg_e = base + mm(S_lo, mm(J_lh, s_hi)) + 0.5 * s_hi @ mm(J_hh, s_hi)  # (C,)
            S = jnp.concatenate([S_lo, jnp.broadcast_to(s_hi, (C, hi))], axis=1)  # (C, T)
            if K is not None:
                pairs = (S[:, :, None] * S[:, None, :]).reshape(C, T * T)
                neg_e = neg_e + jnp.sum(pairs * mm(S, K_pairs_l), axis=1)
            logw = mm(h_sub, S.T) + neg_e[None, :]  # (Qs, C)
            if M_sub is not None:
                logw = logw + mm(M_sub, pairs.T)
            if lim_sub is not None:
                idx = c * C + jnp.arange(C, dtype=jnp.int32)
                # finite, so a query with every configuration of the chunk masked gets a
                # harmless lse of about -1e30 (weight 0 when combined) instead of NaNs
                logw = jnp.where(idx[None, :] < lim_sub[:, None], logw, _MASKED)
            lse = jax.nn.logsumexp(logw, axis=1)  # (Qs,)
            p = jnp.exp(logw - lse[:, None])
            return lse, mm(p, S)

        return jax.checkpoint(chunk)

    # Levels: level 0 is chunk 0 (every query); level l >= 1 holds chunks [2^(l-1), 2^l),
    # i.e. configurations with highest set bit lo + l - 1, needed only by the queries that
    # see at least lo + l positions (a contiguous tail of queries, as n_vis is increasing).
    lses, means = [], []

    def run_level(first_chunk, num_chunks, q0, masked):
        h_sub = h_eff[q0:]
        M_sub = None if M is None else M[q0:]
        lim_sub = jnp.asarray(2 ** n_vis[q0:], jnp.int32) if masked else None
        fn = make_chunk(h_sub, M_sub, lim_sub)
        cs = jnp.arange(first_chunk, first_chunk + num_chunks, dtype=jnp.int32)
        if num_chunks <= 2:
            lse, mean = jax.vmap(fn)(cs)
        else:
            lse, mean = jax.lax.map(fn, cs)
        pad = q0
        lses.append(jnp.pad(lse, ((0, 0), (pad, 0)), constant_values=-jnp.inf))
        means.append(jnp.pad(mean, ((0, 0), (pad, 0), (0, 0))))

    if not causal:
        run_level(0, 2**hi, 0, False)
    else:
        run_level(0, 1, 0, bool(np.any(n_vis < lo)))
        # Level l >= 1 is needed by the queries q >= lo + l - 1. Consecutive levels are
        # grouped while their query count stays above half the group's first, and each group
        # runs as one loop over its chunks with that query window, masked by `idx < 2^n_q`
        # (at most 2x wasted work, log2(Q) loops to compile instead of T - 12).
        level = 1
        while level <= hi and lo + level - 1 < Q:
            q0 = lo + level - 1
            width = Q - q0
            last = level
            while last + 1 <= hi and Q - (lo + last) > width // 2:
                last += 1
            first_chunk = 2 ** (level - 1)
            run_level(first_chunk, 2**last - first_chunk, q0, last > level)
            level = last + 1

    lse = jnp.concatenate(lses, axis=0)  # (num_chunks, Q)
    mean = jnp.concatenate(means, axis=0)  # (num_chunks, Q, T)
    log_z = jax.nn.logsumexp(lse, axis=0)  # (Q,)
    w = jnp.exp(lse - log_z[None, :])
    m = jnp.einsum("cq,cqt->qt", w, mean, precision=HIGHEST)
    if causal:
        m = m * vis
    return m
