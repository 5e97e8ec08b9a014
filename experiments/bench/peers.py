"""spinformer's solvers beside the other JAX fixed-point libraries, on identical inputs.

Three problems, float32, every library stopping at ‖f(x) − x‖₂ ≤ tol in its own loop; each
answer is then checked in float64 (success: the float64 residual of the returned point is
≤ 10·tol, since float32 evaluation alone leaves residuals of order 1e-7·√n):

1. binary TAP, N = 512, near the ferromagnetic transition (β = 1.11), tol 1e-6: forward solve;
2. a DEQ layer z = tanh(Wz + Ux + b), d = 256, batch 64 (vmap), ‖W‖₂ = 0.9, tol 1e-5:
   forward + backward (gradient of a fixed linear read-out with respect to W, U, b), the
   gradient checked against a float64 dense implicit-function solve;
3. a smooth 64-dimensional root, F(x) = tanh(Wx + b) − x with ‖W‖₂ = 1.5 (Picard need not
   converge), tol 1e-6: forward solve with quasi-Newton methods;
4. another smooth 64-dimensional root, F(y) = y + 0.5·tanh(Ay) − b with A ~ N(0, 1/n),
   tol 1e-5 (solved as the fixed point y = b − 0.5·tanh(Ay) by the fixed-point methods).

Peers run when they import: jaxopt (0.8.5), optimistix (0.1.0: no Anderson; its default
implicit adjoint builds the Jacobian), banax (0.1.5+, needs Python ≥ 3.12). A missing peer
is printed as such. Timing is interleaved (one call of every contender per round, medians
over rounds) so drift hits all alike. Printed per problem: each contender's steps (its own
count), float64 residual, success, median time and `spread` (its median call over its fastest:
what varies from call to call), then **fastest successful peer time / fastest successful
spinformer time** (> 1: spinformer is faster).

Usage: `python experiments/bench/peers.py [--quick] [--repeats N]`.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import sys

import jax
import jax.numpy as jnp
import numpy as np

from spinformer import solvers as S

from _compare import interleaved


def _try(name):
    try:
        return importlib.import_module(name)
    except Exception as e:  # noqa: BLE001 - any import failure means "not available"
        need = ("it needs Python >= 3.12" if name == "banax" and sys.version_info < (3, 12)
                else "the peers are the bench extra: pip install -e \".[bench]\"")
        print(f"{name}: not available here ({type(e).__name__}: {str(e).splitlines()[0]}); "
              f"{need}")
        return None


# ----------------------------------------------------------------------------- problems


def tap_problem(seed=1, n=512, beta=1.11):
    rng = np.random.default_rng(seed)
    J = rng.normal(beta / n, 0.1 * beta / np.sqrt(n), size=(n, n))
    J = np.triu(J, 1)
    J = J + J.T
    h = rng.uniform(-0.5 * beta, 0.5 * beta, size=n)
    return h, J


def tap_map(m, h, J):
    return jnp.tanh(h + J @ m - m * ((J**2) @ (1.0 - m**2)))


def deq_problem(seed=0, d=256, batch=64, rate=0.9):
    rng = np.random.default_rng(seed)
    W = rng.normal(size=(d, d))
    W *= rate / np.linalg.norm(W, 2)
    U = rng.normal(size=(d, d)) / np.sqrt(d)
    b = 0.1 * rng.normal(size=d)
    x = rng.normal(size=(batch, d))
    w_out = rng.normal(size=d) / np.sqrt(d)
    return W, U, b, x, w_out


def deq_map(z, W, U, b, x):
    return jnp.tanh(W @ z + U @ x + b)


def root_problem(seed=0, n=64, rate=1.5):
    rng = np.random.default_rng(seed)
    W = rng.normal(size=(n, n))
    W *= rate / np.linalg.norm(W, 2)
    b = rng.normal(size=n)
    return W, b


def root_map(x, W, b):
    return jnp.tanh(W @ x + b)


def root2_problem(seed=0, n=64):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, n)) / np.sqrt(n), rng.normal(size=n)


def root2_map(y, A, b):
    """Problem 4 as a fixed point: y = b − 0.5·tanh(Ay) (its residual is −F(y))."""
    return b - 0.5 * jnp.tanh(A @ y)


def f32(*a):
    return tuple(jnp.asarray(v, jnp.float32) for v in a)


# ----------------------------------------------------------------------------- float64 checks


def residual64(mapping, x, *args):
    x = np.asarray(x, np.float64)
    with jax.enable_x64(True):
        a64 = [jnp.asarray(np.asarray(v, np.float64)) for v in args]
        return float(np.linalg.norm(np.asarray(mapping(jnp.asarray(x), *a64)) - x))


def deq_reference_grads(W, U, b, x, w_out):
    """Float64 gradients of sum_batch w_out·z* with respect to (W, U, b), by a dense solve."""
    with jax.enable_x64(True):
        W, U, b, x, w = (jnp.asarray(v, jnp.float64) for v in (W, U, b, x, w_out))

        def one(xi):
            z = jnp.zeros(W.shape[0])
            for _ in range(400):
                z = deq_map(z, W, U, b, xi)
            J = jax.jacfwd(deq_map)(z, W, U, b, xi)
            lam = jnp.linalg.solve((jnp.eye(len(z)) - J).T, w)
            _, pull = jax.vjp(lambda W, U, b: deq_map(z, W, U, b, xi), W, U, b)
            return pull(lam)

        gs = jax.vmap(one)(x)
        return [np.asarray(jnp.sum(g, 0)) for g in gs]


# ----------------------------------------------------------------------------- contenders


def ours_fixed(solver, adjoint=None):
    """A forward solve with spinformer, returning (x, steps)."""

    def run(mapping, x0, *args):
        kw = {} if adjoint is None else dict(adjoint=adjoint)
        sol = S.fixed_point(lambda x, a: mapping(x, *a), x0, args, solver=solver,
                            throw=False, **kw)
        return sol.value, sol.num_steps

    return run


def ours_root(solver):
    def run(mapping, x0, *args):
        sol = S.root_find(lambda x, a: mapping(x, *a) - x, x0, args, solver=solver,
                          throw=False)
        return sol.value, sol.num_steps

    return run


def jaxopt_contenders(jaxopt, tol, maxiter, kinds):
    out = {}

    def make(cls, **kw):
        def run(mapping, x0, *args):
            p, st = cls(lambda x, *a: mapping(x, *a), tol=tol, maxiter=maxiter, **kw).run(
                x0, *args)
            return p, st.iter_num

        return run

    if "anderson" in kinds:
        out["jaxopt Anderson"] = make(jaxopt.AndersonAcceleration, history_size=5, ridge=1e-5)
    if "picard" in kinds:
        out["jaxopt FixedPointIteration"] = make(jaxopt.FixedPointIteration)
    if "broyden" in kinds:
        def run(mapping, x0, *args):
            p, st = jaxopt.Broyden(lambda x, *a: mapping(x, *a) - x, tol=tol,
                                   maxiter=maxiter).run(x0, *args)
            return p, st.iter_num

        out["jaxopt Broyden"] = run
    return out


def optimistix_contenders(optx, tol, maxiter, kinds):
    out = {}
    norm = optx.two_norm

    if "picard" in kinds:
        def run(mapping, x0, *args):
            sol = optx.fixed_point(lambda x, a: mapping(x, *a),
                                   optx.FixedPointIteration(rtol=0.0, atol=tol, norm=norm),
                                   x0, args, max_steps=maxiter, throw=False)
            return sol.value, sol.stats["num_steps"]

        out["optimistix FixedPointIteration"] = run
    if "newton" in kinds:
        for name, cls in (("Newton", optx.Newton), ("Chord", optx.Chord)):
            def run(mapping, x0, *args, cls=cls):
                sol = optx.root_find(lambda x, a: mapping(x, *a) - x,
                                     cls(rtol=0.0, atol=tol, norm=norm), x0, args,
                                     max_steps=maxiter, throw=False)
                return sol.value, sol.stats["num_steps"]

            out[f"optimistix {name}"] = run
    return out


def banax_contenders(banax, tol, maxiter, kinds):
    from banax import adjoint as BA
    from banax import solver as BS

    out = {}
    rule = dict(atol=tol, rtol=0.0, max_steps=maxiter)
    table = {"anderson": ("Anderson", BS.Anderson), "picard": ("Picard", BS.Picard),
             "broyden": ("Broyden", BS.Broyden)}
    for kind in kinds:
        if kind not in table:
            continue
        name, cls = table[kind]

        def run(mapping, x0, *args, cls=cls):
            sol = BA.Implicit(cls(**rule), BS.Anderson(**rule))((mapping, args), x0)
            return sol.value, sol.stats.steps

        out[f"banax {name}"] = run
    return out


# ----------------------------------------------------------------------------- running


def _report(title, rows, timings, ours_prefix="spinformer"):
    print(f"\n## {title}")
    print(f"{'contender':>34} {'steps':>6} {'residual (f64)':>15} {'ok':>3} {'time ms':>9} "
          f"{'spread':>7}")
    for k, (steps, res, ok) in rows.items():
        t = timings.median(k) * 1e3 if k in timings.rounds else float("nan")
        spread = timings.median(k) / min(timings.rounds[k]) if k in timings.rounds else 0.0
        print(f"{k:>34} {steps:>6} {res:>15.2e} {'yes' if ok else 'no':>3} {t:>9.3f} "
              f"{spread:>7.2f}")
    ours = [k for k, r in rows.items() if k.startswith(ours_prefix) and r[2]]
    peers = [k for k, r in rows.items() if not k.startswith(ours_prefix) and r[2]]
    if not ours or not peers:
        print("ratio: n/a (no successful contender on one side)")
        return float("nan")
    best_ours = min(ours, key=timings.median)
    best_peer = min(peers, key=timings.median)
    # ratio of the two fastest, paired by round
    r = timings.ratio(best_peer, best_ours)
    print(f"fastest peer {best_peer} / fastest ours {best_ours}: x{r:.2f}")
    return r


def forward_problem(title, contenders, mapping, x0, args, tol, repeats):
    fns = {k: jax.jit(lambda x0, *a, f=f: f(mapping, x0, *a)) for k, f in contenders.items()}
    rows = {}
    for k, f in fns.items():
        x, steps = f(x0, *args)
        res = residual64(mapping, x, *args)
        rows[k] = (int(steps), res, bool(np.isfinite(res) and res <= 10 * tol))
    t = interleaved({k: (lambda f=f: f(x0, *args)) for k, f in fns.items()}, repeats)
    return _report(title, rows, t)


def deq_problem_run(contenders, tol, repeats, seed=0):
    W, U, b, x, w_out = deq_problem(seed)
    ref = deq_reference_grads(W, U, b, x, w_out)
    Wf, Uf, bf, xf, wf = f32(W, U, b, x, w_out)
    d = W.shape[0]

    def make(solve):
        def loss(W, U, b):
            z = jax.vmap(lambda xi: solve(lambda z, W, U, b, xi: deq_map(z, W, U, b, xi),
                                          jnp.zeros(d), W, U, b, xi)[0])(xf)
            return jnp.sum(z @ wf)

        return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))

    fns = {k: make(f) for k, f in contenders.items()}
    rows = {}
    for k, g in fns.items():
        gs = g(Wf, Uf, bf)
        err = max(float(np.max(np.abs(np.asarray(a) - r)) / np.max(np.abs(r)))
                  for a, r in zip(gs, ref))
        rows[k] = (0, err, bool(np.isfinite(err) and err <= 1e-3))
    t = interleaved({k: (lambda g=g: g(Wf, Uf, bf)) for k, g in fns.items()}, repeats)
    print("\n(the 'residual' column of the DEQ problem is the largest relative gradient error "
          "against the float64 dense reference; ok: <= 1e-3; steps not counted)")
    return _report("2. DEQ layer d=256, batch 64, forward + backward", rows, t)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer timing rounds")
    p.add_argument("--repeats", type=int, default=None)
    a = p.parse_args()
    repeats = a.repeats or (5 if a.quick else 21)
    print(f"python {sys.version.split()[0]}, jax {jax.__version__}, device {jax.devices()[0]}")
    jaxopt, optx, banax = _try("jaxopt"), _try("optimistix"), _try("banax")
    for m in (jaxopt, optx, banax):
        if m is not None:
            print(f"{m.__name__} {importlib.metadata.version(m.__name__)}")
    ratios = {}

    # 1. TAP
    tol, maxiter = 1e-6, 500
    h, J = tap_problem()
    rule = dict(tol=tol, max_steps=maxiter, norm=S.l2_norm)
    cont = {"spinformer Anderson": ours_fixed(S.Anderson(**rule)),
            "spinformer Picard": ours_fixed(S.Picard(**rule))}
    kinds = ("anderson", "picard")
    if jaxopt:
        cont.update(jaxopt_contenders(jaxopt, tol, maxiter, kinds))
    if optx:
        cont.update(optimistix_contenders(optx, tol, maxiter, kinds))
    if banax:
        cont.update(banax_contenders(banax, tol, maxiter, kinds))
    ratios["tap"] = forward_problem("1. binary TAP N=512, beta=1.11, tol 1e-6 (forward)", cont,
                                    tap_map, jnp.zeros(512), f32(h, J), tol, repeats)

    # 2. DEQ
    tol, maxiter = 1e-5, 200
    rule = dict(tol=tol, max_steps=maxiter, norm=S.l2_norm)
    cont = {"spinformer Picard + Implicit": ours_fixed(S.Picard(**rule), S.Implicit()),
            "spinformer Anderson + Implicit": ours_fixed(S.Anderson(**rule), S.Implicit())}
    if jaxopt:
        cont.update(jaxopt_contenders(jaxopt, tol, maxiter, kinds))
    if optx:
        cont.update(optimistix_contenders(optx, tol, maxiter, ("picard",)))
    if banax:
        cont.update(banax_contenders(banax, tol, maxiter, kinds))
    ratios["deq"] = deq_problem_run(cont, tol, repeats)

    # 3. and 4.: smooth roots, quasi-Newton methods (4: the fixed-point methods too)
    for key, title, (A, b), mapping, tol, extra, peer_kinds in (
            ("root", "3. smooth root, n=64, tol 1e-6", root_problem(), root_map, 1e-6,
             ("Broyden(history=10) (fixed point)", dict(history=10)), ("broyden",)),
            ("root2", "4. smooth root y + 0.5 tanh(Ay) = b, n=64, tol 1e-5", root2_problem(),
             root2_map, 1e-5, ("Anderson (fixed point)", None), ("broyden", "anderson"))):
        rule = dict(tol=tol, max_steps=200, norm=S.l2_norm)
        name, kw = extra
        cont = {"spinformer Broyden (fixed point)": ours_fixed(S.Broyden(**rule)),
                f"spinformer {name}": ours_fixed(S.Broyden(**kw, **rule) if kw else
                                                 S.Anderson(**rule)),
                "spinformer Broyden (root)": ours_root(S.Broyden(**rule)),
                "spinformer Newton (root)": ours_root(S.Newton(**rule))}
        if jaxopt:
            cont.update(jaxopt_contenders(jaxopt, tol, 200, ("broyden",)))
        if optx:
            cont.update(optimistix_contenders(optx, tol, 200, ("newton",)))
        if banax:
            cont.update(banax_contenders(banax, tol, 200, peer_kinds))
        ratios[key] = forward_problem(title, cont, mapping, jnp.zeros(64), f32(A, b), tol,
                                      repeats)

    print("\n## Summary: fastest peer / fastest spinformer (> 1: spinformer faster)")
    for k, r in ratios.items():
        print(f"- {k}: no peer available" if r != r else
              f"- {k}: x{r:.2f} -> {'met' if r >= 1 else 'NOT met'}")


if __name__ == "__main__":
    main()
