r"""Exact Boltzmann-attention marginals for many queries sharing one set of couplings.

G. Kim, D. K. Park, "Boltzmann Attention: Learnable Ising Couplings for Cooperative
Attention", arXiv:2606.12478 (2026), Eq. (8): for query q the attention pattern s ∈ {-1, +1}^T over
key positions follows

    P_q(s) ∝ exp( Σ_j h_qj s_j + Σ_{j<k} J_jk s_j s_k [+ Σ_{j<k<l} K_jkl s_j s_k s_l] ),

i.e. the Ising weight exp(−E) of `spinformer.spins.ising` at β = 1, with fields h_q (one row
per query) and couplings J (and K) shared by every query. With causal masking query q sees
positions 0..q only and the couplings act only among visible positions (Kim & Park 2026, §3.2).

How the enumeration is organised (spin k is bit k of a configuration's index,
s_k = 1 − 2·bit_k as in `ising`):

- Split the positions into the first r (the rows of a table, all 2^r configurations a) and
  the rest (configuration b fixed per column). For query q and b the log-weights are
  a·g + ½ aᵀJ_RR a + c with g = h_q,R + J_RH s(b) and c = h_q,H·s(b) + ½ s(b)ᵀJ_HH s(b): one
  table column per (query, b), the whole table (field term, c and the shared coupling energy)
  filled by one matrix product [g | c | 1] @ [S_Rᵀ; 1; ½ aᵀJ_RR a], and every column's
  partition sum and marginals of a by one more (e @ [S_R | 1]). In memory a column is a
  contiguous row of 2^r entries, so both products contract the last axis (the orientation
  XLA:CPU runs fastest) and the table is passed over three times: product, exponential,
  product. A query's log-sum-exp and marginals combine its columns. With three-body
  couplings a column also carries a pair term aᵀW(b)a (r² more coefficients in the first
  product, over the 2^r × r² pair features).
- A causal query with n visible positions needs only the configurations whose hidden bits
  are 0: hidden spins sit at +1, which adds to the shared energy a term linear in the
  visible spins (with K, also a pairwise one); `_corrections` subtracts it from the query's
  fields. So query q gets 2^(n−r) columns, exactly its 2^n configurations; queries with
  few visible positions use smaller tables (r in steps of 4 bits below 12, the smallest
  masked to its first 2^n rows), Σ_q 2^(n_q) ≈ 2·2^T entries in all for Q = T instead of
  T·2^T.
- Columns are processed in blocks of about 2^20 table entries (4 MiB in float32), each with
  a hand-written VJP that recomputes its table, so the backward pass is memory-bounded too.
  Under vmap with shared couplings (a batch of sequences), the batch's columns share the
  tables, a few instances per block: a few large products instead of many small ones.

The tables replace an earlier design (chunks of 2^12 configurations with every query, the
coupling energy shared per chunk), and one row per column with the energy and the partition
sum folded into the two products replaces one column per table column with separate passes
for the shared energy, the maximum, the sum and a transposed product: both changes make
fewer, larger products, which run closer to the matmul's FLOP rate. A stabiliser bounded
from the fields instead of the table's maximum would save a pass but needs a fallback for
strong couplings, so the maximum is kept. Timings: `experiments/results/boltzmann/bench.md`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Float

from ._common import HIGHEST, MAX_BOLTZMANN_T, bits, mm, sym3, sym_offdiag

__all__ = ["boltzmann_marginals"]

# rows of the largest tables (2^12 configurations of the first 12 positions); smaller tables
# every 4 bits below, for causal queries with few visible positions
_ROW_BITS = 12
_TIER_STEP = 4
# entries of one block of a table (4 MiB in float32): its columns are processed in blocks
_BLOCK_ENTRIES = 2**20
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
    Q, T = h.shape[-2:]
    v = (np.arange(T)[None, :] < n_vis[:, None]).astype(np.float32)  # (Q, T)
    u = 1.0 - v
    vj, uj = jnp.asarray(v, h.dtype), jnp.asarray(u, h.dtype)
    h_eff = vj * (h - mm(uj, J))  # J symmetric
    M = None
    if K_sym is not None:
        Ku = jnp.einsum("jkl,ql->qjk", K_sym, uj, precision=HIGHEST)  # (Q, T, T)
        h_eff = h_eff - 0.5 * vj * jnp.einsum("qjk,qk->qj", Ku, uj, precision=HIGHEST)
        M = -0.5 * vj[:, :, None] * vj[:, None, :] * Ku  # (Q, T, T)
    return h_eff, M, vj


def _column_plan(n_vis: np.ndarray, T: int):
    """The static layout of the tables: per tier (row bits r), one column per query and
    configuration of its visible positions ≥ r.

    Query q with n visible positions goes to the largest tier r ≤ n (or the smallest tier,
    masked to its first 2^n rows, when n is below every tier) and gets 2^(n−r) columns, one
    per configuration b of positions r..n−1; positions ≥ n keep bit 0 (spin +1, undone by
    `_corrections`). Returns [(r, qidx, b, lim)], numpy arrays per column: the query, the
    high configuration's index and the number of rows the column may use.
    """
    top = min(_ROW_BITS, T)
    tiers = sorted({top - _TIER_STEP * k for k in range(top) if top - _TIER_STEP * k >= 1})
    cols: dict[int, list] = {}
    for q, n in enumerate(int(v) for v in n_vis):
        fits = [r for r in tiers if r <= n]
        r = max(fits) if fits else tiers[0]
        k = 2 ** (n - r) if n >= r else 1
        lim = 2**r if n >= r else 2**n
        cols.setdefault(r, []).extend((q, b, lim) for b in range(k))
    plan = []
    for r in sorted(cols, key=lambda r: cols[r][0][0]):  # tiers in query order
        a = np.asarray(cols[r], np.int64)
        plan.append((r, a[:, 0], a[:, 1], a[:, 2]))
    return plan


def _column_stats(S_R, pairs, masked):
    """(g, c, base, W, lim) ↦ (lse, ⟨a⟩) of a block of columns, with a hand-written VJP.

    Log-weights `(blk, 2^r)`, one row per column (query and high configuration), one entry
    per configuration a of the table's r spins: g_c·a + c_c + base(a) (+ W_c·(a⊗a) with
    three-body couplings), entries a ≥ lim_c masked. All of it is one product, [g | c | 1 | W]
    @ [S_Rᵀ; 1; base; pairsᵀ], and the column sums and first moments are one more,
    e @ [S_R | 1]: three passes over the table (product, exponential, product), every product
    contracting the table's last axis, the orientation XLA:CPU runs fastest. The VJP
    recomputes the table from the block's inputs (memory stays O(2^r·blk) in the backward
    pass) and uses ∂lse/∂logw = p, ∂⟨a_k⟩/∂logw = p (a_k − ⟨a_k⟩). Reverse mode only.

    Under vmap with `base` shared (a batch of sequences with the same couplings), the batch's
    columns go side by side into the same tables, in groups that keep a table near
    `_BLOCK_ENTRIES` entries (`_fold`): a few large products instead of a batch of small
    ones, and memory bounded by the table size rather than batch × table.
    """
    # numpy constants: a custom_vjp's rules must not close over traced values
    n_rows, r = S_R.shape
    rows = np.arange(n_rows, dtype=S_R.dtype)
    S_T = np.ascontiguousarray(S_R.T)
    S_1 = np.concatenate([S_R, np.ones((n_rows, 1), S_R.dtype)], axis=1)  # (2^r, r + 1)
    S_T1 = np.concatenate([S_T, np.ones((1, n_rows), S_R.dtype)], axis=0)  # (r + 1, 2^r)
    pairs_T = None if pairs is None else np.ascontiguousarray(pairs.T)

    def logits(g, c, base, W, lim):
        ones = jnp.ones_like(c)[:, None]
        coef = [g, c[:, None], ones]  # (blk, r + 2 [+ r·r])
        basis = [S_T1, base[None, :]]  # (r + 2 [+ r·r], 2^r)
        if pairs is not None:
            coef.append(W)
            basis.append(pairs_T)
        logw = mm(jnp.concatenate(coef, axis=1), jnp.concatenate(basis, axis=0))
        if masked:
            logw = jnp.where(rows[None, :] < lim[:, None], logw, _MASKED)
        return logw

    def forward(g, c, base, W, lim):
        logw = logits(g, c, base, W, lim)
        top = jnp.max(logw, axis=1)
        e = jnp.exp(logw - top[:, None])  # one exponential per configuration and column
        moments = mm(e, S_1)  # (blk, r + 1): Σ_a e·a, then Σ_a e
        z = moments[:, r]
        return top + jnp.log(z), moments[:, :r] / z[:, None]

    def backward(g, c, base, W, lim, lse, mean, d_lse, d_mean, n_inst=1):
        """Cotangents of the inputs; `dbase` `(n_inst, 2^r)`, one row per instance whose
        columns (consecutive, equally many) share the table."""
        p = jnp.exp(logits(g, c, base, W, lim) - lse[:, None])
        shift = d_lse - jnp.sum(mean * d_mean, axis=1)
        d = p * mm(jnp.concatenate([d_mean, shift[:, None]], axis=1), S_T1)
        dW = None if pairs is None else mm(d, pairs)
        d_base = jnp.sum(d.reshape(n_inst, -1, n_rows), axis=1)
        d_gc = mm(d, S_1)
        return d_gc[:, :r], d_gc[:, r], d_base, dW

    fwd_v = _fold(forward, n_rows, per_instance=False)
    bwd_v = _fold(backward, n_rows, per_instance=True)

    @jax.custom_vjp
    def stats(g, c, base, W, lim):
        return fwd_v(g, c, base, W, lim)

    def fwd(g, c, base, W, lim):
        lse, mean = fwd_v(g, c, base, W, lim)
        return (lse, mean), (g, c, base, W, lim, lse, mean)

    def bwd(res, ct):
        dg, dc, dbase, dW = bwd_v(*res, *ct)
        return dg, dc, dbase, dW, jnp.zeros_like(res[4])

    stats.defvjp(fwd, bwd)
    return stats


def _fold(fn, n_rows, per_instance):
    """`fn(g, c, base, W, lim, ...)` (every argument but `base` has one entry per column on
    its leading axis) with a batching rule: when `base` is shared by the batch, the batch's
    columns go into shared tables, `group` instances at a time so that a table has about
    `_BLOCK_ENTRIES` entries. `per_instance`: fn is the backward, whose third output
    (`dbase`) is one row per instance (`n_inst` argument)."""

    @jax.custom_batching.custom_vmap
    def f(*args):
        out = fn(*args)
        return (out[0], out[1], out[2][0], out[3]) if per_instance else out

    @f.def_vmap
    def _batched(axis_size, in_batched, *args):
        def bcast(x, bt):
            return x if bt else jnp.broadcast_to(x, (axis_size, *jnp.shape(x)))

        def all_batched(out):
            return jax.tree.map(lambda _: True, out)

        if in_batched[2]:
            # per-instance couplings (heads): one instance at a time, so that a batch vmapped
            # around this one (the sequences) still shares each instance's tables
            args = [None if a is None else bcast(a, bt) for a, bt in zip(args, in_batched)]
            out = jax.lax.map(lambda a: f(*a), args)
            return out, all_batched(out)
        base = args[2]
        cols = [None if a is None else bcast(a, bt)
                for i, (a, bt) in enumerate(zip(args, in_batched)) if i != 2]
        blk = cols[0].shape[1]
        group = max(1, min(axis_size, _BLOCK_ENTRIES // (n_rows * blk)))
        n_groups = -(-axis_size // group)
        pad = n_groups * group - axis_size

        def regroup(x):  # (B, blk, ...) -> (groups, group·blk, ...)
            x = jnp.pad(x, ((0, pad),) + ((0, 0),) * (x.ndim - 1))
            return x.reshape((n_groups, group * blk) + x.shape[2:])

        def one_group(cs):
            cs = list(cs)
            kw = {"n_inst": group} if per_instance else {}
            return fn(*cs[:2], base, *cs[2:], **kw)

        grouped = [None if a is None else regroup(a) for a in cols]
        out = jax.lax.map(one_group, grouped)

        def ungroup(y, per_col):  # (groups, group·blk, ...) or (groups, group, ...) -> (B, ...)
            lead = (n_groups * group, blk) if per_col else (n_groups * group,)
            return y.reshape(lead + y.shape[2:])[:axis_size]

        if per_instance:
            dg, dc, d_base, dW = out
            out = (ungroup(dg, True), ungroup(dc, True), ungroup(d_base, False),
                   None if dW is None else ungroup(dW, True))
        else:
            out = tuple(ungroup(y, True) for y in out)
        return out, all_batched(out)

    return f

def _tier(r, qidx, b, lim, h_eff, J, K_sym, M, dt):
    """Log-sum-exp and mean spins of every column of one tier.

    Column (q, b): spins a of positions < r (the 2^r rows) and s_H(b) of positions ≥ r fixed.
    Its log-weights are S_R a·g + base(a) + c (+ aᵀW a with three-body couplings), with
    g = h_R + J_RH s_H, c = h_H·s_H + ½ s_Hᵀ J_HH s_H and base(a) = ½ aᵀJ_RR a shared by every
    column. `h_eff` is `(N, Q, T)`: N instances sharing J and K, whose columns go side by
    side into the same tables (instance-major). Returns lse `(N·ncol,)` and the columns' mean
    spins `(N·ncol, T)` (⟨a⟩, then s_H).
    """
    T = J.shape[0]
    N = h_eff.shape[0]
    hi = T - r
    qidx, b, lim = np.tile(qidx, N), np.tile(b, N), np.tile(lim, N)
    ncol = len(qidx)
    S_R = bits(r).astype(dt)  # (2^r, r), a numpy constant
    S_H = jnp.asarray(1 - 2 * ((b[:, None] >> np.arange(hi)[None, :]) & 1), dt)  # (ncol, hi)
    hq = h_eff.reshape(N * h_eff.shape[1], T)[np.repeat(np.arange(N), ncol // N)
                                             * h_eff.shape[1] + qidx]
    g = hq[:, :r] + mm(S_H, J[r:, :r])
    c = jnp.sum(hq[:, r:] * S_H, axis=1) + 0.5 * jnp.sum(mm(S_H, J[r:, r:]) * S_H, axis=1)
    base = 0.5 * jnp.sum(mm(S_R, J[:r, :r]) * S_R, axis=1)
    pairs = None
    if K_sym is not None:
        # ⅙ Σ Ks sss = ⅙ RRR + ½ RRH + ½ RHH + ⅙ HHH (Ks symmetric, zero on repeated indices)
        K_RRR = K_sym[:r, :r, :r]  # the RRH part goes into the per-block pair term
        K_RHH, K_HHH = K_sym[:r, r:, r:], K_sym[r:, r:, r:]
        base = base + jnp.einsum("jkl,aj,ak,al->a", K_RRR, S_R, S_R, S_R,
                                 precision=HIGHEST) / 6.0
        g = g + 0.5 * jnp.einsum("jkl,ck,cl->cj", K_RHH, S_H, S_H, precision=HIGHEST)
        c = c + jnp.einsum("jkl,cj,ck,cl->c", K_HHH, S_H, S_H, S_H, precision=HIGHEST) / 6.0
        if M is not None:  # the causal correction's pair couplings Σ_jk M_jk s_j s_k
            Mq = M[qidx]
            g = g + 2.0 * jnp.einsum("cjk,ck->cj", Mq[:, :r, r:], S_H, precision=HIGHEST)
            c = c + jnp.einsum("cj,cjk,ck->c", S_H, Mq[:, r:, r:], S_H, precision=HIGHEST)
        pairs = (S_R[:, :, None] * S_R[:, None, :]).reshape(2**r, r * r)  # numpy

    def pair_couplings(S_H_b, q_b):
        """W (blk, r·r): the coefficients of a_j a_k in a block's columns (three-body)."""
        W = 0.5 * jnp.einsum("jkl,cl->cjk", K_sym[:r, :r, r:], S_H_b, precision=HIGHEST)
        if M is not None:
            W = W + M[q_b][:, :r, :r]
        return W.reshape(W.shape[0], r * r)

    masked = bool(np.any(lim < 2**r))
    blk = min(max(1, _BLOCK_ENTRIES // 2**r), ncol)
    nb = -(-ncol // blk)
    pad = nb * blk - ncol

    def split(x):
        x = jnp.pad(x, ((0, pad),) + ((0, 0),) * (x.ndim - 1))
        return x.reshape((nb, blk) + x.shape[1:])

    stats = _column_stats(S_R, pairs, masked)

    def block(args):
        g_b, c_b, lim_b, S_H_b, q_b = args
        W_b = None if pairs is None else pair_couplings(S_H_b, q_b)
        return stats(g_b, c_b, base, W_b, lim_b)

    args = (split(g), split(c), split(jnp.asarray(lim, dt)), split(S_H),
            split(jnp.asarray(qidx, jnp.int32)))
    if nb == 1:
        lse, mean_R = block(jax.tree.map(lambda x: x[0], args))
    else:
        lse, mean_R = jax.lax.map(block, args)
        lse, mean_R = lse.reshape(-1), mean_R.reshape(-1, r)
    return lse[:ncol], jnp.concatenate([mean_R[:ncol], S_H], axis=1)


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

    Cost: Q·2^T table entries without masking, each ~4·min(T, 12) multiply-adds and one
    exponential; with causal masking query q visits only its 2^(n_q) configurations (≈ 2·2^T
    entries for Q = T). Memory: blocks of about 2^20 entries, also in the backward pass.
    Reverse-mode differentiable (`jax.grad`, `jax.vjp`), not forward mode. T ≤ 24; for longer
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
    K_sym = None if K is None else sym3(jnp.asarray(K, dt))

    return _marginals(h[None], J, K_sym, causal, dt)[0]


def _marginals(h, J, K_sym, causal, dt):
    """`boltzmann_marginals` of N instances `h (N, Q, T)` sharing J (symmetric, zero
    diagonal) and K_sym, their columns side by side in the same tables."""
    N, Q, T = h.shape
    if causal:
        n_vis = np.minimum(np.arange(Q) + 1, T)
        h_eff, M, vis = _corrections(h, J, K_sym, n_vis)
    else:
        n_vis = np.full(Q, T)
        h_eff, M, vis = h, None, None

    seg_all, lse_all, m_all = [], [], []
    for r, qidx, b, lim in _column_plan(n_vis, T):
        lse, m_col = _tier(r, qidx, b, lim, h_eff, J, K_sym, M, dt)
        seg_all.append((np.arange(N)[:, None] * Q + qidx[None, :]).reshape(-1))
        lse_all.append(lse)
        m_all.append(m_col)
    seg = np.concatenate(seg_all)  # the (instance, query) of each column
    lse = jnp.concatenate(lse_all)
    m_col = jnp.concatenate(m_all, axis=0)
    # per query, the log-sum-exp over its columns and the weighted mean of their marginals
    top = jax.lax.stop_gradient(jax.ops.segment_max(lse, seg, num_segments=N * Q))
    w = jnp.exp(lse - top[seg])
    z = jax.ops.segment_sum(w, seg, num_segments=N * Q)
    m = (jax.ops.segment_sum(w[:, None] * m_col, seg, num_segments=N * Q)
         / z[:, None]).reshape(N, Q, T)
    if causal:
        m = m * vis
    return m
