"""Benchmark of exact Boltzmann-attention marginals (seed boltzmann-attention.txt, Eq. 8).

Forward + backward time of `boltzmann_marginals` (coupling energy shared by all queries,
causal queries restricted to their prefix block of configurations, chunked log-sum-exp)
against a straightforward per-query enumerator: `jax.vmap` over queries of a function that
enumerates all configurations of that query's visible positions (the 2^T table, masked to
the query's prefix block since shapes must be static under vmap) with its own energy
h·s + ½ sᵀJs. Both are jitted, compiled before timing, run alternately, and the median of
the per-round ratios per-query time / ours is reported. Target: ratio >= 5 at T = 16, causal.

Then the useful FLOP rate of the forward pass (causal and non-causal, T = 16 and 20, one
query per position; and T = 16 causal for a batch of 16 sequences sharing the couplings, as
in an attention layer) as a fraction of a float32 2048³ matmul's rate measured in the same run.
Useful FLOPs are those of plain enumeration's products: 4·n·2^n per query with n visible
positions (the field term h·s and the mean Σ p·s, 2n each per configuration); exponentials,
the shared coupling energy and masking are not counted. Target: causal >= 30%.

Then the T = 20 forward time and peak memory (XLA's temporary buffer size from the compiled
executable, and the process's peak resident memory).

    python experiments/bench/boltzmann.py             # T = 8, 12, 16 and the T = 20 forward
    python experiments/bench/boltzmann.py --quick     # T = 8 only, a smoke test
"""

from __future__ import annotations

import argparse
import resource
import statistics

import jax
import jax.numpy as jnp
import numpy as np

from spinformer.spins.ising import boltzmann_marginals

from _compare import interleaved, malloc_line, ratio_header, time_call


def _bits(n):
    idx = np.arange(2**n)[:, None]
    return (1 - 2 * ((idx >> np.arange(n)[None, :]) & 1)).astype(np.float32)


def per_query_marginals(h, J, *, causal=True):
    """The straightforward way: each query enumerates its own visible configurations."""
    Q, T = h.shape
    S = jnp.asarray(_bits(T))  # (2^T, T); spin k is bit k
    idx = jnp.arange(2**T)
    J = 0.5 * (J + J.T) * (1.0 - jnp.eye(T, dtype=J.dtype))

    def one(h_q, n):
        vis = (jnp.arange(T) < n).astype(h_q.dtype)
        Sv = S * vis  # hidden spins switched off
        logw = Sv @ h_q + 0.5 * jnp.sum((Sv @ J) * Sv, axis=1)
        logw = jnp.where(idx < 2**n, logw, -jnp.inf)  # each visible configuration once
        p = jax.nn.softmax(logw)
        return p @ Sv

    n = jnp.minimum(jnp.arange(Q) + 1, T) if causal else jnp.full((Q,), T)
    return jax.vmap(one)(h, n)


def reference64(h, J, causal):
    """Plain numpy, float64, query by query."""
    Q, T = h.shape
    h, J = h.astype(np.float64), J.astype(np.float64)
    out = np.zeros((Q, T))
    for q in range(Q):
        n = min(q + 1, T) if causal else T
        S = _bits(n).astype(np.float64)
        logw = S @ h[q, :n] + 0.5 * np.einsum("cj,jk,ck->c", S, J[:n, :n], S)
        p = np.exp(logw - logw.max())
        out[q, :n] = (p / p.sum()) @ S
    return out


def _loss(fn):
    def loss(h, J):
        m = fn(h, J)
        return jnp.sum(jnp.sin(m))  # a generic cotangent

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))


def problem(T, seed=0):
    rng = np.random.default_rng(seed)
    h = jnp.asarray(rng.normal(size=(T, T)), jnp.float32)
    J = rng.normal(size=(T, T)) * 0.3
    J = jnp.asarray((J + J.T) / 2 * (1 - np.eye(T)), jnp.float32)
    return h, J


def compare(T, causal, repeats):
    h, J = problem(T)
    fast = _loss(lambda h_, J_: boltzmann_marginals(h_, J_, causal=causal))
    slow = _loss(lambda h_, J_: per_query_marginals(h_, J_, causal=causal))
    (_, ga), (_, gb) = fast(h, J), slow(h, J)  # compile + check agreement
    ref = reference64(np.asarray(h), np.asarray(J), causal)
    m_fast = float(np.max(np.abs(np.asarray(boltzmann_marginals(h, J, causal=causal)) - ref)))
    m_slow = float(np.max(np.abs(np.asarray(jax.jit(
        per_query_marginals, static_argnames="causal")(h, J, causal=causal)) - ref)))
    g_err = max(float(jnp.max(jnp.abs(ga[0] - gb[0]))), float(jnp.max(jnp.abs(ga[1] - gb[1]))))
    t = interleaved({"ours": lambda: fast(h, J), "per-query": lambda: slow(h, J)}, repeats,
                    warmup=False)
    ta, tb, ratio = t.median("ours"), t.median("per-query"), t.ratio("per-query", "ours")
    print(f"T={T:2d} causal={causal!s:5}  fwd+bwd  boltzmann_marginals {ta * 1e3:8.2f} ms   "
          f"per-query {tb * 1e3:8.2f} ms   ratio x{ratio:5.1f}   "
          f"(error vs float64: {m_fast:.1e} and {m_slow:.1e}; max |dgrad| {g_err:.1e})")
    return ratio


def matmul_rate(repeats, n=2048):
    """FLOP/s of a float32 n³ matmul (median of `repeats`)."""
    a = jnp.asarray(np.random.default_rng(0).normal(size=(n, n)), jnp.float32)
    f = jax.jit(lambda x: x @ x)
    jax.block_until_ready(f(a))
    return 2 * n**3 / statistics.median(time_call(f, a) for _ in range(repeats))


def useful_flops(T, causal, Q=None):
    """4·n·2^n per query with n visible positions (field term and mean, 2n each)."""
    Q = T if Q is None else Q
    n = np.minimum(np.arange(Q) + 1, T) if causal else np.full(Q, T)
    return float(np.sum(4.0 * n * 2.0**n))


def flop_rates(repeats, batch=16):
    """One query per position, alone (T = 16, 20), and a batch of `batch` sequences sharing
    the couplings (T = 16 causal under vmap, an attention layer's case: the batch's columns
    share the tables)."""
    rows = []
    peak = matmul_rate(3)
    cases = [(T, causal, 1) for T in (16, 20) for causal in (True, False)] + [(16, True, batch)]
    for T, causal, B in cases:
        h, J = problem(T, seed=2)
        one = lambda h_, J_, c=causal: boltzmann_marginals(h_, J_, causal=c)
        if B > 1:
            h = jnp.broadcast_to(h, (B, T, T)) + 0.1 * jnp.arange(B, dtype=h.dtype)[:, None, None]
            one = jax.vmap(one, in_axes=(0, None))
        f = jax.jit(one)
        jax.block_until_ready(f(h, J))
        reps = repeats if T < 20 or causal else max(3, repeats // 2)
        t = statistics.median(time_call(f, h, J) for _ in range(reps))
        rows.append((T, causal, B, B * useful_flops(T, causal), t))
    peak = max(peak, matmul_rate(3))  # before and after, the better of the two
    print(f"float32 2048^3 matmul: {peak / 1e9:.1f} GFLOP/s (best of two medians)")
    for T, causal, B, flops, t in rows:
        what = f"batch {B:2d}" if B > 1 else "alone   "
        print(f"T={T:2d} causal={causal!s:5} {what} forward {t * 1e3:8.2f} ms   useful "
              f"{flops / 1e6:8.1f} MFLOP   {flops / t / 1e9:6.2f} GFLOP/s = "
              f"{100 * flops / t / peak:5.1f}% of the matmul's rate")


def big(T, repeats):
    h, J = problem(T, seed=1)
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # MiB on Linux
    fwd = jax.jit(lambda h_, J_: boltzmann_marginals(h_, J_, causal=True))
    compiled = fwd.lower(h, J).compile()
    mem = compiled.memory_analysis()
    temp = getattr(mem, "temp_size_in_bytes", float("nan")) if mem is not None else float("nan")
    jax.block_until_ready(compiled(h, J))
    times = [time_call(compiled, h, J) for _ in range(repeats)]
    grad = jax.jit(jax.grad(lambda h_, J_: jnp.sum(jnp.sin(
        boltzmann_marginals(h_, J_, causal=True))), argnums=(0, 1)))
    gmem = grad.lower(h, J).compile().memory_analysis()
    gtemp = getattr(gmem, "temp_size_in_bytes", float("nan")) if gmem is not None else float("nan")
    Q_bytes = T * 2**T * 4
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"T={T} causal forward: {statistics.median(times):.3f} s (median of {repeats}); "
          f"XLA temp memory forward {temp / 2**20:.1f} MiB, forward+backward "
          f"{gtemp / 2**20:.1f} MiB (a materialised Q x 2^T float32 table would be "
          f"{Q_bytes / 2**20:.0f} MiB); process peak RSS {rss:.0f} MiB "
          f"(+{rss - rss0:.0f} MiB during this step)")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}; {malloc_line()}")
    print(ratio_header("per-query enumeration", "boltzmann_marginals"))
    sizes = [8] if args.quick else [8, 12, 16]
    for T in sizes:
        compare(T, True, args.repeats)
    if not args.quick:
        compare(16, False, args.repeats)
        flop_rates(args.repeats)
        big(20, 3)


if __name__ == "__main__":
    main()
