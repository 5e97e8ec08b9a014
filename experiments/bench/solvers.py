"""Benchmark of spinformer.solvers against plain iteration and jaxopt's Anderson acceleration.

Prints, measured side by side in one run (absolute times drift on a shared machine; read the
ratios, always jaxopt / ours: > 1 means ours is faster or needs fewer evaluations):

1. function evaluations to tolerance and wall time for Picard, damped Picard, our Anderson
   and jaxopt's AndersonAcceleration on
   (a) binary TAP, N=512, J_ij ~ N(β/N, 0.01β²/N), fields x_i ~ U(−β/2, β/2), β near 1.11;
   (b) a batch of contractive tanh maps under vmap;
2. forward+backward time of our Anderson + implicit adjoint vs jaxopt (implicit diff with its
   default normal-CG solve, and with GMRES);
3. forward+backward time and peak memory (XLA's buffer assignment for the compiled program)
   of `Implicit` vs `Unrolled` at 10, 30 and 100 forward iterations;
4. what `Implicit`'s fallback costs: a batch of 64 contractive tanh maps (n=384, the
   quickstart's system size) differentiated with GMRES(5), without a fallback and with the
   default `Auto()` (dense at this size), when no backward solve fails (the fallback should
   cost nothing) and when one system of the batch fails (Picard(max 3 products) first).

Usage: `python experiments/bench/solvers.py [--quick]`.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from spinformer import solvers as S

from _compare import interleaved, ratio_header

try:
    import jaxopt
except ImportError:  # the peer this benchmark compares against: the bench extra
    raise SystemExit("experiments/bench/solvers.py compares against jaxopt, which is not "
                     "installed: pip install -e \".[bench]\"") from None


def tap_map(m, args):
    h, J = args
    onsager = m * ((J**2) @ (1.0 - m**2))
    return jnp.tanh(h + J @ m - onsager)


def tap_instance(seed, n, beta):
    rng = np.random.default_rng(seed)
    J = rng.normal(beta / n, 0.1 * beta / np.sqrt(n), size=(n, n))
    J = np.triu(J, 1)
    J = J + J.T
    h = rng.uniform(-0.5 * beta, 0.5 * beta, size=n)
    return jnp.asarray(h, jnp.float32), jnp.asarray(J, jnp.float32)


def tanh_map(x, args):
    W, b = args
    return jnp.tanh(W @ x + b)


def tanh_batch(seed, batch, n, rate):
    rng = np.random.default_rng(seed)
    W = rng.normal(size=(batch, n, n))
    W = W * (rate / np.linalg.norm(W, 2, axis=(1, 2)))[:, None, None]
    b = rng.normal(size=(batch, n))
    return jnp.asarray(W, jnp.float32), jnp.asarray(b, jnp.float32)


def jaxopt_solver(fn, tol, maxiter, solve=None):
    kw = dict(history_size=5, tol=tol, maxiter=maxiter, ridge=1e-5)
    if solve is not None:
        kw["implicit_diff_solve"] = solve
    return jaxopt.AndersonAcceleration(fn, **kw)


def forward_solvers(tol, maxiter):
    """name -> solve(fn, x0, args) returning (value, function evaluations, l2 residual)."""
    rule = dict(tol=tol, max_steps=maxiter, norm=S.l2_norm)

    def ours(solver):
        def solve(fn, x0, args):
            sol = S.fixed_point(fn, x0, args, solver=solver, throw=False)
            return sol.value, sol.num_steps + 1, sol.residual

        return solve

    def theirs(fn, x0, args):
        p, st = jaxopt_solver(fn, tol, maxiter).run(x0, args)
        return p, st.num_fun_eval, st.error

    return {
        "picard": ours(S.Picard(**rule)),
        "picard(damping=0.5)": ours(S.Picard(damping=0.5, **rule)),
        "anderson (ours)": ours(S.Anderson(**rule)),
        "anderson (jaxopt)": theirs,
    }


def section_forward(quick):
    tol, maxiter = 1e-4, 2000
    solvers = forward_solvers(tol, maxiter)
    print(f"\n## 1a. Binary TAP, N=512, evaluations to ||g(m)-m||_2 <= {tol} (max {maxiter})")
    betas = [1.0, 1.11, 1.2] if not quick else [1.11]
    seeds = range(3) if not quick else range(1, 2)  # seed 0 at β=1.11 stalls both Andersons
    print("evaluations (mean magnetization of the fixed point found); '-' = not converged")
    print(f"{'beta':>5} {'seed':>4} | " + " | ".join(f"{k:>20}" for k in solvers))
    evals = {k: [] for k in solvers}
    times = {k: [] for k in solvers}
    ratios, both = [], []
    for beta in betas:
        for seed in seeds:
            h, J = tap_instance(seed, 512, beta)
            x0 = jnp.zeros_like(h)
            fns = {k: jax.jit(lambda h, J, s=s: s(tap_map, x0, (h, J))) for k, s in solvers.items()}
            cells, row = [], {}
            for k, f in fns.items():
                m, ne, res = f(h, J)
                ok = float(res) <= tol
                row[k] = int(ne) if ok else None
                cells.append(f"{int(ne):>5} ({float(jnp.mean(m)):+.3f})" if ok else f"{'-':>5} ({float(jnp.mean(m)):+.3f})")
            t = interleaved({k: (lambda f=f: f(h, J)) for k, f in fns.items()},
                            3 if quick else 7)
            for k in solvers:
                evals[k].append(row[k])
                times[k].append(t.median(k))
            ratios.append(t.ratio("anderson (jaxopt)", "anderson (ours)"))
            both.append(row["anderson (ours)"] is not None and row["anderson (jaxopt)"] is not None)
            print(f"{beta:>5} {seed:>4} | " + " | ".join(f"{c:>20}" for c in cells))
    mean_t = {k: np.mean(v) for k, v in times.items()}
    print("mean wall time (ms): " + ", ".join(f"{k}: {1e3 * v:.2f}" for k, v in mean_t.items()))
    sel = [i for i, b in enumerate(both) if b]
    if not sel:
        print("no instance was solved by both Anderson variants; no ratio")
        return float("nan"), float("nan")
    e_ours = np.mean([evals["anderson (ours)"][i] for i in sel])
    e_theirs = np.mean([evals["anderson (jaxopt)"][i] for i in sel])
    ratio_e = e_theirs / e_ours
    ratio_t = np.mean([ratios[i] for i in sel])
    conv = {k: sum(e is not None for e in v) for k, v in evals.items()}
    print("instances converged: " + ", ".join(f"{k}: {v}/{len(both)}" for k, v in conv.items()))
    print(f"jaxopt/ours Anderson on the {len(sel)} instances both solved: mean evaluations "
          f"{e_ours:.1f} vs {e_theirs:.1f} (x{ratio_e:.2f}), forward time x{ratio_t:.2f}")

    print("\n## 1b. Batch of 64 contractive tanh maps (n=256, ||W||=0.95) under vmap")
    W, b = tanh_batch(0, 64, 256, 0.95)
    x0 = jnp.zeros((256,))
    fns = {k: jax.jit(jax.vmap(lambda W, b, s=s: s(tanh_map, x0, (W, b)))) for k, s in solvers.items()}
    ev = {}
    for k, f in fns.items():
        _, ne, res = f(W, b)
        ev[k] = (float(jnp.mean(ne)), int(jnp.max(ne)), bool(jnp.all(res <= tol)))
    t = interleaved({k: (lambda f=f: f(W, b)) for k, f in fns.items()}, 3 if quick else 7)
    for k in solvers:
        print(f"{k:>20}: mean evals {ev[k][0]:7.1f}, max {ev[k][1]:5d}, all converged "
              f"{ev[k][2]}, time {1e3 * t.median(k):8.2f} ms")
    e_ratio = ev["anderson (jaxopt)"][0] / ev["anderson (ours)"][0]
    print(f"jaxopt/ours Anderson: evaluations x{e_ratio:.2f}, "
          f"time x{t.ratio('anderson (jaxopt)', 'anderson (ours)'):.2f}")
    return ratio_e, ratio_t


def section_backward(quick):
    tol, maxiter = 1e-4, 2000
    print(f"\n## 2. Forward+backward, binary TAP N=512, beta=1.11 (seed 1), tol {tol} (l2)")
    h, J = tap_instance(1, 512, 1.11)  # an instance every solver converges on
    w = jnp.asarray(np.random.default_rng(1).normal(size=512), jnp.float32)
    x0 = jnp.zeros_like(h)

    solver = S.Anderson(tol=tol, max_steps=maxiter, norm=S.l2_norm)

    def ours(linear_solver):
        adjoint = S.Implicit(linear_solver=linear_solver)

        def loss(h, J):
            m = S.fixed_point(tap_map, x0, (h, J), solver=solver, adjoint=adjoint).value
            return jnp.sum(w * m)

        return loss

    def theirs(solve):
        def loss(h, J):
            return jnp.sum(w * jaxopt_solver(tap_map, tol, maxiter, solve).run(x0, (h, J)).params)

        return loss

    losses = {
        "ours (Implicit gmres)": ours(S.GMRES(restart=20)),
        "ours (Implicit anderson)": ours(S.Anderson(history=5, safeguard=False)),
        "jaxopt (default normal-CG)": theirs(None),
        "jaxopt (gmres)": theirs(jaxopt.linear_solve.solve_gmres),
    }
    grads = {k: jax.jit(jax.grad(f, argnums=(0, 1))) for k, f in losses.items()}
    g_ref = grads["jaxopt (gmres)"](h, J)
    for k, g in grads.items():
        gk = g(h, J)
        err = float(jnp.max(jnp.abs(gk[0] - g_ref[0])) / jnp.max(jnp.abs(g_ref[0])))
        print(f"{k:>28}: rel. difference of dL/dh from jaxopt-gmres {err:.1e}")
    t = interleaved({k: (lambda g=g: g(h, J)) for k, g in grads.items()}, 3 if quick else 9)
    for k in grads:
        print(f"{k:>28}: {1e3 * t.median(k):8.2f} ms")
    ours = ("ours (Implicit gmres)", "ours (Implicit anderson)")
    for k in ours:
        print(f"jaxopt/{k} forward+backward time: "
              f"x{t.ratio('jaxopt (default normal-CG)', k):.2f} (jaxopt default), "
              f"x{t.ratio('jaxopt (gmres)', k):.2f} (jaxopt gmres)")
    r_default = max(t.ratio("jaxopt (default normal-CG)", k) for k in ours)
    r_gmres = max(t.ratio("jaxopt (gmres)", k) for k in ours)
    return r_default, r_gmres


def section_memory(quick):
    print("\n## 3. Implicit vs Unrolled: batch 16 x binary TAP N=512 (Anderson), k forced iterations")
    batch, n = 16, 512
    hs, Js = zip(*[tap_instance(s, n, 0.8) for s in range(batch)])
    H, Jb = jnp.stack(hs), jnp.stack(Js)

    def make(adjoint, k):
        def loss(H, Jb):
            def one(h, J):
                # tol=0 forces exactly k iterations.
                return S.fixed_point(tap_map, jnp.zeros(n), (h, J),
                                     solver=S.Anderson(tol=0.0, max_steps=k), adjoint=adjoint,
                                     throw=False).value

            return jnp.sum(jax.vmap(one)(H, Jb) ** 2)

        return jax.jit(jax.grad(loss))

    rows = {}
    fns = {}
    for k in (10, 30, 100):
        for name, adj in (("Implicit", S.Implicit()), ("Unrolled", S.Unrolled())):
            f = make(adj, k)
            mem = f.lower(H, Jb).compile().memory_analysis()
            rows[(name, k)] = mem.temp_size_in_bytes
            fns[(name, k)] = f
    t = interleaved({key: (lambda f=f: f(H, Jb)) for key, f in fns.items()}, 2 if quick else 5)
    print(f"{'adjoint':>9} {'k':>4} {'peak temp MiB':>14} {'fwd+bwd ms':>11}")
    for (name, k), mem in rows.items():
        print(f"{name:>9} {k:>4} {mem / 2**20:14.2f} {1e3 * t.median((name, k)):11.1f}")
    imp = [rows[("Implicit", k)] for k in (10, 30, 100)]
    unr = [rows[("Unrolled", k)] for k in (10, 30, 100)]
    spread = (max(imp) - min(imp)) / min(imp)
    print(f"Implicit memory spread 10->100: {100 * spread:.1f}% ; Unrolled 100/10: x{unr[2] / unr[0]:.1f}")
    return spread, unr[2] / unr[0]


def section_fallback(quick):
    print("\n## 4. Implicit's fallback: batch 64 x tanh map n=384, forward+backward")
    batch, n = 64, 384
    W, b = tanh_batch(0, batch, n, 0.95)
    rate = jnp.where(jnp.arange(batch) == 0, 1.0, 0.02)  # system 0: slow for Picard

    def make(linear, fallback, rates):
        adj = S.Implicit(linear_solver=linear, fallback=fallback, max_steps=3 if
                         isinstance(linear, S.Picard) else 200)

        def loss(W, b):
            def one(Wi, bi, r):
                return S.fixed_point(lambda x, a: jnp.tanh(a[2] * (a[0] @ x) + a[1]),
                                     jnp.zeros(n), (Wi, bi, r), adjoint=adj,
                                     solver=S.Anderson(tol=1e-6, max_steps=200),
                                     throw=False).value

            return jnp.sum(jax.vmap(one)(W, b, rates) ** 2)

        return jax.jit(jax.grad(loss))

    unit = jnp.ones(batch)
    fns = {"gmres5, no fallback": make(S.GMRES(restart=5), None, unit),
           "gmres5 + Auto fallback": make(S.GMRES(restart=5), S.Auto(), unit),
           "picard(3) + Auto, 1 system fails": make(S.Picard(), S.Auto(), rate),
           "picard(3), no fallback, 1 fails": make(S.Picard(), None, rate)}
    t = interleaved({k: (lambda f=f: f(W, b)) for k, f in fns.items()}, 3 if quick else 9)
    for k in fns:
        print(f"{k:>34}: {1e3 * t.median(k):8.2f} ms")
    nan = int(jnp.sum(~jnp.isfinite(fns["picard(3), no fallback, 1 fails"](W, b))))
    ok = bool(jnp.all(jnp.isfinite(fns["picard(3) + Auto, 1 system fails"](W, b))))
    r = t.ratio("gmres5, no fallback", "gmres5 + Auto fallback")
    print(f"no fallback / with fallback, nothing fails: x{r:.2f} (1 = free); without a "
          f"fallback the failed system leaves {nan} NaN gradient entries, with it all finite: "
          f"{ok}")
    return r


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer instances and repeats")
    a = p.parse_args()
    print(f"jax {jax.__version__}, device {jax.devices()[0]}")
    print(ratio_header("jaxopt", "ours"))
    ratio_e, ratio_t = section_forward(a.quick)
    r_default, r_gmres = section_backward(a.quick)
    spread, growth = section_memory(a.quick)
    r_fallback = section_fallback(a.quick)
    print("\n## Targets")
    print(f"- Anderson evaluations <= jaxopt's (jaxopt/ours >= 1): x{ratio_e:.2f} -> "
          f"{'met' if ratio_e >= 1 else 'NOT met'}")
    print(f"- forward+backward <= 0.7x jaxopt's (jaxopt/ours >= {1 / 0.7:.2f}): x{r_default:.2f} "
          f"(jaxopt default) / x{r_gmres:.2f} (jaxopt gmres) "
          f"-> {'met' if r_default >= 1 / 0.7 else 'NOT met'}")
    print(f"- Implicit memory flat within 10%: {100 * spread:.1f}% -> "
          f"{'met' if spread <= 0.1 else 'NOT met'}; Unrolled grows x{growth:.1f}")
    print(f"- an unused fallback costs under 10% (no fallback / with >= 0.9): x{r_fallback:.2f} "
          f"-> {'met' if r_fallback >= 0.9 else 'NOT met'}")


if __name__ == "__main__":
    main()
