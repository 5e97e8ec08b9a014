"""Benchmarks of NeuroGame attention (NGT). Prints ratios measured side by side in one run and
writes every number as markdown.

1. Forward + backward (gradient of a scalar loss over the batch with respect to the module's
   parameters and the input) of `NeuroGameAttention` (K = 15 Monte Carlo draws, the unbiased
   shared-draw estimators, `estimator="mc"`) against `SoftmaxAttention`, in `mode="pooled"`
   (the paper's one game per sequence) and `mode="query"` (one game per query). Target: NGT
   at most 4x the softmax time (ratio softmax / NGT >= 0.25). Also the forward alone, the
   mean-field iterations and the fraction of mean fields not converged, the backward linear
   solves, and a rough breakdown of NGT's time into its estimators, its mean-field solve and
   the rest (the pieces timed alone, vmapped over the same games).
2. Error against K of the unbiased estimators (`shapley_mc`, `banzhaf_mc`, `interactions_mc`)
   and of the paper's Algorithm 1 (`ngt_estimates`) on random norm games, against the exact
   Shapley / Banzhaf / interaction values and against Algorithm 1's true K -> inf limits
   (`gibbs_banzhaf`, `gibbs_interactions`).
3. Cost of Algorithm 1 as printed (independent draws per player and per pair) against the
   shared-draw estimators at equal K, per game.

The machine is noisy, so each comparison alternates the contenders, repeats, and reports the
median of the per-round ratios, always baseline time / ours (> 1: ours is faster); here the
baselines are softmax attention (1) and Algorithm 1 as printed (3).

    python experiments/bench/neurogame.py            # batch 8, 64 tokens, width 64, 4 heads
    python experiments/bench/neurogame.py --quick    # small sizes, a smoke test (< 60 s)

`--quick` always runs the breakdown of `mode="query"` (the full run: only where a mode misses
the target), so that the smoke test goes through every part.

The full run writes `experiments/results/ngt/bench.md` and `estimator_error.png` beside it;
`--quick` writes nothing unless given `--out`.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import math
import os
import platform
import sys
import time
from pathlib import Path

if "--quick" in sys.argv and "XLA_FLAGS" not in os.environ:
    # A smoke test: compiling the NGT gradient dominates it, so compile cheaply (the
    # --quick timings are not representative).
    os.environ["XLA_FLAGS"] = ("--xla_backend_optimization_level=0 "
                               "--xla_llvm_disable_expensive_passes=true")

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from spinformer import nn, solvers
from spinformer.nn._heads import project_heads
from spinformer.spins import coalitions as co
from spinformer.spins import ising

from _compare import interleaved, malloc_line, ratio_header, time_call, xla_cost

RESULTS = Path(__file__).resolve().parents[1] / "results" / "ngt"
TARGET = 4.0  # NGT fwd+bwd time at most TARGET x softmax's
# Part 2 measures errors, not times: XLA's optimisation level 1 compiles its programs ~5x
# faster than the default on this machine and runs them about as fast.
_CHEAP_COMPILE = {"xla_backend_optimization_level": 1}


# ----------------------------------------------------------------------------- reporting


class Report:
    """Lines printed as they come and kept for the markdown file."""

    def __init__(self):
        self.md: list[str] = []

    def text(self, s: str = "", md: str | None = None):
        print(s, flush=True)
        self.md.append(s if md is None else md)

    def table(self, header: list[str], rows: list[list[str]]):
        widths = [max(len(str(r[i])) for r in [header] + rows) for i in range(len(header))]
        for r in [header] + rows:
            print("  " + "  ".join(str(c).rjust(w) for c, w in zip(r, widths)), flush=True)
        self.md.append("")
        self.md.append("| " + " | ".join(header) + " |")
        self.md.append("|" + "---|" * len(header))
        for r in rows:
            self.md.append("| " + " | ".join(str(c) for c in r) + " |")
        self.md.append("")


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return (f"{cpu}, {usable} usable cores (of {os.cpu_count()}), load average at start "
            f"{load}; jax {jax.__version__} on {jax.devices()[0].platform}; "
            f"Python {platform.python_version()}")


def ms(t: float) -> str:
    return f"{t * 1e3:.1f}" if t < 10 else f"{t * 1e3:.0f}"


# ----------------------------------------------------------------------------- 1. attention


def _batched(module, x, keys, **kw):
    return jax.vmap(lambda xi, ki: module(xi, key=ki, **kw))(x, keys)


def _loss(mx, keys):
    module, x = mx
    return jnp.mean(jnp.sin(_batched(module, x, keys)))


_grad = eqx.filter_jit(eqx.filter_grad(_loss))
_fwd = eqx.filter_jit(_batched)


@eqx.filter_jit
def _fwd_diag(module, x, keys):
    """The NGT forward with what the layer computed on the way: the mean-field statistics,
    the fields and couplings of every game and the heads' temperatures."""
    y, diag = _batched(module, x, keys, return_diagnostics=True)
    return y, diag.solver, diag.fields, diag.couplings, diag.gamma


def _games_inputs(module, x):
    """The player vectors u of every game the module plays on the batch `x (B, n, D)`:
    `(B·H·G, s, D_h)` (G = 1 pooled, n per query), as `NeuroGameAttention._games` builds them
    (with `_players`: `module.mode` is the name of the mode, a string)."""
    H = module.num_heads

    def one(xi):
        v = project_heads(module.to_v, xi, H)  # (H, s, D_h)
        return module._players(xi, xi, v, None)[1]  # (H, G, s, D_h)

    u = jax.vmap(one)(x)
    return u.reshape(-1, *u.shape[-2:])


def _estimators(u, key, K):
    """The three shared-draw estimators of one norm game, as the layer calls them."""
    n = u.shape[0]
    game = co.NormGame(u)
    k1, k2, k3 = jax.random.split(key, 3)
    return (co.shapley_mc(game, n, key=k1, num_samples=K).value,
            co.banzhaf_mc(game, n, key=k2, num_samples=K).value,
            co.interactions_mc(game, n, key=k3, num_samples=K).value)


def bench_breakdown(rep, module, x, K, fields, couplings, gammas, total_fb, total_f, repeats):
    """Time NGT's pieces alone on the same games: each estimator (u -> φ, β or J) and the mean
    field (h, J -> ⟨s⟩, the module's solver and adjoint), forward and forward + backward
    (gradient with respect to u, resp. h and J)."""
    u = _games_inputs(module, x)
    G = u.shape[0]
    gkeys = jax.random.split(jax.random.key(7), G)
    h = fields.reshape(G, -1)
    J = couplings.reshape(G, *couplings.shape[-2:])
    beta = jnp.broadcast_to((1.0 / gammas)[..., None], fields.shape[:-1]).reshape(G)
    solver, adjoint = module.solver, module.adjoint  # the layer's own (default: implicit)

    def estimator(fn):
        def one(u, k):
            return fn(co.NormGame(u), u.shape[0], key=k, num_samples=K).value

        return (jax.jit(jax.vmap(one)),
                jax.jit(jax.grad(lambda u, k: jnp.sum(jnp.sin(jax.vmap(one)(u, k))))))

    def mf(h, J, b):
        return ising.mean_field(h, J, beta=b, solver=solver, adjoint=adjoint,
                                m0=jnp.zeros_like(h), throw=False).value

    mf_fb = jax.jit(jax.grad(lambda hJ, b: jnp.sum(jnp.sin(jax.vmap(mf)(*hJ, b)))))
    pieces = {name: estimator(fn) for name, fn in (
        ("shapley_mc", co.shapley_mc), ("banzhaf_mc", co.banzhaf_mc),
        ("interactions_mc", co.interactions_mc))}
    pieces[f"mean field ({type(solver).__name__}, {type(adjoint).__name__} adjoint)"] = (
        jax.jit(jax.vmap(mf)), mf_fb)
    calls = {}
    for name, (f, fb) in pieces.items():
        args = (h, J, beta) if name.startswith("mean") else (u, gkeys)
        fb_args = ((h, J), beta) if name.startswith("mean") else (u, gkeys)
        calls[(name, "f")] = lambda f=f, args=args: f(*args)
        calls[(name, "fb")] = lambda fb=fb, fb_args=fb_args: fb(*fb_args)
    t = interleaved(calls, repeats)
    rows, sum_f, sum_fb = [], 0.0, 0.0
    for name in pieces:
        tf, tfb = t.median((name, "f")), t.median((name, "fb"))
        sum_f, sum_fb = sum_f + tf, sum_fb + tfb
        rows.append([name, ms(tf), f"{100 * tf / total_f:.0f} %", ms(tfb),
                     f"{100 * tfb / total_fb:.0f} %"])
    rows.append(["sum of the pieces", ms(sum_f), f"{100 * sum_f / total_f:.0f} %", ms(sum_fb),
                 f"{100 * sum_fb / total_fb:.0f} %"])
    rows.append(["NGT layer (measured above)", ms(total_f), "100 %", ms(total_fb), "100 %"])
    rep.text(f"    breakdown over the same {G} games ({u.shape[1]} players, D_h "
             f"{u.shape[2]}, K = {K}), each piece timed alone, vmapped over the games "
             f"(median of {repeats} round{'s' if repeats > 1 else ''} after a warm-up); "
             "shares of the layer's time above. The pieces run as separate programs, not "
             "fused into the layer's, so the shares need not add up to 100 %; what the sum "
             "leaves over is the projections, gates, L1 normalisation and output.")
    rep.table(["piece", "forward ms", "share", "fwd+bwd ms", "share"], rows)
    return {r[0]: (r[1], r[3]) for r in rows}


def bench_attention(rep, batch, n, dim, heads, K, repeats, breakdown_repeats,
                    breakdown_always=False):
    """Part 1. The breakdown of a mode (`breakdown_repeats[mode]` rounds) runs where NGT misses
    the target, or always with `breakdown_always` (`--quick`: the smoke test runs it)."""
    kx, km, kk = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (batch, n, dim))
    keys = jax.random.split(kk, batch)
    soft = nn.SoftmaxAttention(dim, heads, key=km)
    c_soft = time_call(_grad, (soft, x), keys)
    time_call(_fwd, soft, x, keys)
    rep.text(f"## 1. Forward + backward: NeuroGameAttention (K = {K}, estimator='mc') vs "
             "SoftmaxAttention")
    rep.text()
    rep.text(f"batch {batch}, {n} tokens, width {dim}, {heads} heads; loss mean(sin(y)) over "
             "the batch, gradient with respect to the module's parameters and the input "
             "(`eqx.filter_grad`), jit, warm-up (compile) excluded; the NGT call gets a key "
             "per example (the training path, K Monte Carlo draws). The NGT forward also "
             "returns the mean-field statistics, fields and couplings it computed on the way "
             "(read below). "
             + ratio_header("softmax", "NGT") + f"; target: NGT ≤ {TARGET:g}× softmax, i.e. "
             f"ratio ≥ {1 / TARGET:g}.")
    results = {}
    for mode in ("pooled", "query"):
        ngt = solvers.record_backward(nn.NeuroGameAttention(
            dim, heads, mode=mode, estimator="mc", train_samples=K, key=km))
        reps = repeats[mode]
        t0 = time.perf_counter()
        grads = jax.block_until_ready(_grad((ngt, x), keys))
        c = time.perf_counter() - t0
        _, records = solvers.backward_stats(grads[0])
        bw = np.asarray(sum(jnp.asarray(r) for r in records)) if records else None
        tb = interleaved({"NGT": lambda: _grad((ngt, x), keys),
                          "softmax": lambda: _grad((soft, x), keys)}, reps, warmup=False)
        t0 = time.perf_counter()
        _, stats, fields, couplings, gammas = jax.block_until_ready(_fwd_diag(ngt, x, keys))
        cf = time.perf_counter() - t0
        steps = np.asarray(stats.num_steps)
        failed = np.asarray(stats.result) != 0
        tf = interleaved({"NGT": lambda: _fwd_diag(ngt, x, keys),
                          "softmax": lambda: _fwd(soft, x, keys)}, reps, warmup=False)
        r_fb, r_f = tb.ratio("softmax", "NGT"), tf.ratio("softmax", "NGT")
        met = 1 / r_fb <= TARGET
        results[mode] = dict(ratio=r_fb, slowdown=1 / r_fb, met=met, fwd_ratio=r_f,
                             ngt_fb=tb.median("NGT"), soft_fb=tb.median("softmax"),
                             ngt_f=tf.median("NGT"), soft_f=tf.median("softmax"),
                             steps=float(steps.mean()), steps_max=int(steps.max()),
                             failed=float(failed.mean()), games=steps.size, compile=c,
                             compile_fwd=cf)
        rep.text()
        rep.text(f"### mode = '{mode}' ({steps.size // batch} games per example: "
                 f"{'one per head' if mode == 'pooled' else 'one per head and query'})")
        rep.table(
            ["", "NGT ms", "softmax ms", "ratio softmax/NGT", "NGT/softmax", "rounds"],
            [["forward + backward", ms(tb.median("NGT")), ms(tb.median("softmax")),
              f"{r_fb:.4f}", f"{1 / r_fb:.1f}×", str(reps)],
             ["forward only", ms(tf.median("NGT")), ms(tf.median("softmax")), f"{r_f:.4f}",
              f"{1 / r_f:.1f}×", str(reps)]])
        verdict = "met" if met else "NOT met"
        rep.text(f"    target NGT fwd+bwd ≤ {TARGET:g}× softmax: **{verdict}** "
                 f"(NGT is {1 / r_fb:.1f}× softmax; ratio {r_fb:.4f} vs ≥ {1 / TARGET:g}).")
        cn, cs = (xla_cost(eqx.filter_grad(_loss), (m, x), keys) for m in (ngt, soft))
        rep.text(f"    arithmetic (XLA's cost model, fwd+bwd; the mean-field loop's body counted "
                 f"once): NGT/softmax FLOPs {cn.flops / cs.flops:.1f}×, bytes "
                 f"{cn.bytes / cs.bytes:.1f}×, transcendentals "
                 f"{cn.transcendentals / max(cs.transcendentals, 1.0):.0f}× (NGT "
                 f"{cn.flops:.3g} FLOPs, {cn.bytes:.3g} bytes; softmax {cs.flops:.3g}, "
                 f"{cs.bytes:.3g}).")
        results[mode].update(flops_ratio=cn.flops / cs.flops, bytes_ratio=cn.bytes / cs.bytes)
        rep.text(f"    mean field (forward, {steps.size} solves: batch × heads × games): "
                 f"{steps.mean():.1f} iterations on average (max {steps.max()}), "
                 f"{100 * failed.mean():.1f} % not converged (tol 1e-4, ≤ 100 steps).")
        if bw is not None:
            solves, prods = float(bw[..., 0].sum()), float(bw[..., 1].sum())
            rep.text(f"    backward: {solves:.0f} implicit linear solves "
                     f"({type(ngt.adjoint.linear_solver).__name__}), "
                     f"{prods / max(solves, 1):.1f} matrix–vector products per solve on "
                     "average.")
        rep.text(f"    first calls (compile + run): fwd+bwd {c:.1f} s, forward {cf:.1f} s "
                 f"(softmax fwd+bwd {c_soft:.1f} s).")
        if (breakdown_always or not met) and breakdown_repeats.get(mode):
            results[mode]["breakdown"] = bench_breakdown(
                rep, ngt, x, K, fields, couplings, gammas, tb.median("NGT"), tf.median("NGT"),
                breakdown_repeats[mode])
    return results


# ----------------------------------------------------------------------------- 2. error vs K


def _fit_slope(Ks, errs):
    """Least-squares slope of log err against log K."""
    return float(np.polyfit(np.log(Ks), np.log(errs), 1)[0])


def bench_error(rep, n, d, num_games, num_keys, Ks, gammas, figure):
    rep.text()
    rep.text("## 2. Estimator error against K")
    rep.text()
    rep.text(f"{num_games} random norm games v(C) = ‖Σ_{{i∈C}} V_i‖ with n = {n} players, "
             f"V_i ~ N(0, I/{d}) in R^{d} (so E‖V_i‖² = 1); {num_keys} independent keys per "
             "game and K. RMS error over players (pairs i < j for J), games and keys. "
             "Targets: the exact φ, β, J (enumeration), and for Algorithm 1 also its true "
             "K → ∞ limits β^γ (`gibbs_banzhaf`, the limit of both its Shapley and its "
             "Banzhaf branch) and J^γ (`gibbs_interactions`). `slope` is the least-squares "
             "slope of log RMS against log K (−0.5 for an unbiased Monte Carlo mean).")
    gk = jax.random.split(jax.random.key(1), num_games)
    V = jax.vmap(lambda k: jax.random.normal(k, (n, d)) / math.sqrt(d))(gk)
    iu = np.triu_indices(n, 1)
    g_arr = jnp.asarray(gammas, V.dtype)

    @functools.partial(jax.jit, compiler_options=_CHEAP_COMPILE)
    def exact(V):
        game = co.NormGame(V)
        lim = jax.vmap(lambda g: (co.gibbs_banzhaf(game, n, gamma=g),
                                  co.gibbs_interactions(game, n, gamma=g)[iu]))(g_arr)
        return (co.shapley(game, n), co.banzhaf(game, n), co.interactions(game, n)[iu]), lim

    ex, lim = jax.vmap(exact)(V)  # (G, ...) and (G, len(gammas), ...)
    phi, beta, J = ex

    def estimates(K):
        def one(V, key):
            game = co.NormGame(V)
            k1, k2, k3, k4 = jax.random.split(key, 4)
            mc = (co.shapley_mc(game, n, key=k1, num_samples=K).value,
                  co.banzhaf_mc(game, n, key=k2, num_samples=K).value,
                  co.interactions_mc(game, n, key=k3, num_samples=K).value[iu])
            ngt = jax.vmap(lambda g: co.ngt_estimates(game, n, key=k4, num_samples=K,
                                                      gamma=g))(g_arr)
            return mc, (ngt.shapley, ngt.banzhaf, ngt.interactions[:, iu[0], iu[1]])

        keys = jax.random.split(jax.random.key(100 + K), (num_games, num_keys))
        return jax.jit(jax.vmap(jax.vmap(one, in_axes=(None, 0))),
                       compiler_options=_CHEAP_COMPILE)(V, keys)

    def rms(est, target):  # est (G, R, ...), target (G, ...)
        return float(jnp.sqrt(jnp.mean((est - target[:, None]) ** 2)))

    names = ["φ (Shapley)", "β (Banzhaf)", "J (interactions)"]
    exact_t = [phi, beta, J]
    series: dict[tuple[str, str], list[float]] = {}
    t0 = time.perf_counter()
    for K in Ks:
        mc, ngt = estimates(K)
        for q in range(3):
            series.setdefault((names[q], "unbiased MC vs exact"), []).append(
                rms(mc[q], exact_t[q]))
            for gi, gamma in enumerate(gammas):
                limit = lim[0][:, gi] if q < 2 else lim[1][:, gi]
                series.setdefault((names[q], f"Algorithm 1, γ={gamma:g}, vs exact"),
                                  []).append(rms(ngt[q][:, :, gi], exact_t[q]))
                series.setdefault((names[q], f"Algorithm 1, γ={gamma:g}, vs limit"),
                                  []).append(rms(ngt[q][:, :, gi], limit))
    elapsed = time.perf_counter() - t0
    scale = {names[q]: float(jnp.sqrt(jnp.mean(exact_t[q] ** 2))) for q in range(3)}
    bias = {}
    for q in range(3):
        for gi, gamma in enumerate(gammas):
            limit = lim[0][:, gi] if q < 2 else lim[1][:, gi]
            bias[(names[q], gamma)] = float(jnp.sqrt(jnp.mean((limit - exact_t[q]) ** 2)))
    rows = []
    for (qname, est), errs in series.items():
        rows.append([qname, est] + [f"{e:.4f}" for e in errs] + [f"{_fit_slope(Ks, errs):+.2f}"])
    rep.table(["quantity", "estimator, compared with"] + [f"K={K}" for K in Ks] + ["slope"],
              rows)
    rep.text("RMS of the exact values (scale): " + ", ".join(
        f"{k} {v:.4f}" for k, v in scale.items()) + ". RMS distance between Algorithm 1's "
        "limit and the exact value (the bias it plateaus at): " + "; ".join(
        f"{q} γ={g:g}: {b:.4f}" for (q, g), b in bias.items()) + f". ({elapsed:.1f} s)")
    if figure is not None:
        _figure(figure, Ks, series, bias, names, gammas)
        rep.text(f"Figure: `{figure.name}` (log-log, one panel per quantity).")
    return series, bias, scale


def _figure(path, Ks, series, bias, names, gammas):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib not available: no figure)")
        return
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5), sharey=False)
    colors = {gammas[0]: "tab:red", gammas[-1]: "tab:blue"}
    for ax, q in zip(axes, names):
        for (qname, est), errs in series.items():
            if qname != q:
                continue
            if est.startswith("unbiased"):
                ax.loglog(Ks, errs, "k-o", label=est)
            else:
                g = float(est.split("γ=")[1].split(",")[0])
                style = "--s" if "exact" in est else ":^"
                ax.loglog(Ks, errs, style, color=colors.get(g, "tab:green"), label=est)
        ref = series[(q, "unbiased MC vs exact")][0]
        ax.loglog(Ks, [ref * math.sqrt(Ks[0] / K) for K in Ks], color="0.7", lw=0.8,
                  label="∝ 1/√K")
        for g in gammas:
            ax.axhline(bias[(q, g)], color=colors.get(g, "tab:green"), lw=0.6, alpha=0.6)
        ax.set_title(q)
        ax.set_xlabel("K (draws)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("RMS error")
    axes[0].legend(fontsize=7)
    fig.suptitle("Estimator error against K (thin horizontal lines: RMS |limit − exact| of "
                 "Algorithm 1)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ----------------------------------------------------------------------------- 3. cost


def bench_cost(rep, sizes, d, num_games, K, repeats):
    rep.text()
    rep.text(f"## 3. Cost: Algorithm 1 as printed vs the shared-draw estimators (K = {K})")
    rep.text()
    rep.text(f"Per game, forward, jit, vmapped over {num_games} norm games (D_h = {d}). "
             "Algorithm 1 draws K coalitions per player for its Shapley branch, K per player "
             "for its Banzhaf branch and K per pair, and evaluates v twice per player draw "
             "and four times per pair draw: K·(2n + n(n−1)/2) coalitions, "
             "K·(4n + 4·n(n−1)/2) evaluations (each pair draw needs its own coalition sum, "
             "O(K n³ d)). The shared-draw estimators draw K permutations (K·(n+1) prefix "
             "values), K coalitions for all the Banzhaf indices (K·(n+1) values) and K "
             "coalitions for all pairs (Δ_ij = σ_iσ_j[v(B) − v(B⊕i) − v(B⊕j) + v(B⊕ij)]: "
             "the single flips are O(K n), the double flips a (K, n, n) array through Gram "
             "expansions, O(K n²)): 3K coalition sums in all. "
             + ratio_header("Algorithm 1", "shared") + ".")
    rows = []
    out = {}
    for n in sizes:
        kv, kk = jax.random.split(jax.random.key(n))
        U = jax.random.normal(kv, (num_games, n, d)) / math.sqrt(d)
        keys = jax.random.split(kk, num_games)
        alg1 = jax.jit(jax.vmap(lambda u, k: tuple(co.ngt_estimates(
            co.NormGame(u), n, key=k, num_samples=K, gamma=0.25))))
        shared = jax.jit(jax.vmap(lambda u, k: _estimators(u, k, K)))
        t = interleaved({"Algorithm 1": lambda: alg1(U, keys),
                         "shared": lambda: shared(U, keys)}, repeats)
        r = t.ratio("Algorithm 1", "shared")
        pairs = n * (n - 1) // 2
        draws_a, evals_a = K * (2 * n + pairs), K * (4 * n + 4 * pairs)
        evals_s = K * (n + 1) * 2 + K * 4 * pairs
        out[n] = r
        rows.append([str(n), f"{draws_a:,}", f"{evals_a:,}", f"{3 * K}", f"{evals_s:,}",
                     f"{t.median('Algorithm 1') / num_games * 1e6:.0f}",
                     f"{t.median('shared') / num_games * 1e6:.0f}", f"{r:.1f}"])
    rep.table(["n", "Alg. 1 coalitions", "Alg. 1 evaluations", "shared coalitions",
               "shared evaluations", "Alg. 1 µs/game", "shared µs/game",
               "ratio Alg.1/shared"], rows)
    return out


# ----------------------------------------------------------------------------- main


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small sizes (a smoke test)")
    p.add_argument("--out", type=Path, default=None,
                   help="markdown output (default: experiments/results/ngt/bench.md for the "
                        "full run, none for --quick); the figure goes beside it")
    p.add_argument("--only", choices=["attention", "error", "cost"])
    a = p.parse_args()
    out = a.out if a.out is not None else (None if a.quick else RESULTS / "bench.md")
    if a.quick:
        att = dict(batch=2, n=12, dim=32, heads=2, K=15, repeats={"pooled": 3, "query": 3},
                   breakdown_repeats={"query": 1}, breakdown_always=True)
        err = dict(n=8, d=16, num_games=2, num_keys=4, Ks=[4, 16])
        cost = dict(sizes=[8], d=16, num_games=8, K=15, repeats=3)
    else:
        att = dict(batch=8, n=64, dim=64, heads=4, K=15, repeats={"pooled": 7, "query": 3},
                   breakdown_repeats={"pooled": 3, "query": 1})
        err = dict(n=12, d=16, num_games=4, num_keys=16, Ks=[4, 16, 64, 256, 1024])
        cost = dict(sizes=[16, 32, 64], d=16, num_games=32, K=15, repeats=5)
    rep = Report()
    t_start = time.perf_counter()
    rep.text("# NeuroGame attention: benchmarks")
    rep.text()
    rep.text(f"Generated by `experiments/bench/neurogame.py{' --quick' if a.quick else ''}` "
             f"on {datetime.date.today().isoformat()}.")
    rep.text()
    rep.text(f"Machine: {machine()}; {malloc_line()}. The machine is shared with other jobs: "
             "absolute times drift; the ratios come from interleaved rounds.")
    if a.quick:
        rep.text()
        rep.text("--quick: a smoke test at small sizes, compiled with XLA's cheapest "
                 f"optimisation (XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}); its times "
                 "are not representative.")
    rep.text()
    res = {}
    if a.only in (None, "attention"):
        res["attention"] = bench_attention(rep, **att)
    if a.only in (None, "error"):
        fig = (out.parent / "estimator_error.png") if out is not None else None
        res["error"] = bench_error(rep, gammas=(0.25, 1.0), figure=fig, **err)
    if a.only in (None, "cost"):
        res["cost"] = bench_cost(rep, **cost)
    rep.text()
    rep.text(f"Total time of the run: {time.perf_counter() - t_start:.0f} s.")
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text("\n".join(rep.md).rstrip() + "\n")
        print(f"wrote {out.name} in {out.parent.name}/")
    return res


if __name__ == "__main__":
    main()
