"""The implicit adjoint's backward linear solve: which solver is fastest, on which platform.

`Implicit(linear_solver=...)` solves (I − ∂g/∂x)ᵀ w = ḡ at the fixed point. The solvers
differ in how many matrix–vector products they need and in how many loop iterations they
take to get them, and the platforms price those two differently: on a CPU a product is the
cost, on a GPU every iteration of a `lax.while_loop` costs a round trip of roughly 45 µs
whatever it computes (measured on an H200: `experiments/results/gpu_h200/`). So the fastest
solver can differ between the CPU and the GPU, and this script measures them side by side
on the platform it runs on:

1. the DEQ layer of `peers.py` (z = tanh(Wz + Ux + b), d = 256, batch 64, ‖W‖₂ = 0.9,
   forward Picard to tol 1e-5): forward + backward, the gradient checked against the
   float64 dense reference;
2. the spin attention layer of `spin_attention.py` [1] (TAP steady state, batch 8, 128
   tokens, width 256, 4 heads; `--quick`: 32 tokens, width 64), forward + backward at the
   layer's backward tolerance 1e-3, the gradient compared with a GMRES(50) solve to 1e-6.

Printed per contender: backward solves, products and fallbacks per solve (from
`record_backward`; −1: the solver does not count), the gradient's relative error, whether
every backward solve converged, and the median time of interleaved rounds, with the ratio
of the current default's time to each (> 1: faster than the default).

    python experiments/bench/adjoint.py [--quick] [--repeats N] [--only deq|spin]
                                        [--skip lineax GMRES ...]
"""

from __future__ import annotations

import argparse
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from spinformer import nn
from spinformer import solvers as S

from _compare import interleaved
from peers import deq_map, deq_problem, deq_reference_grads, f32


def contenders(tol, skip=()):
    """name -> linear solver of the backward solve (None: `Implicit()`'s default). The row
    `default, precision=None` is the default with the solve's products at the caller's
    precision (on a GPU: TF32) instead of the solvers' `"highest"`."""
    out = {
        "default": None,
        "default, precision=None": None,
        "Anderson(history=5) on Richardson": S.Anderson(history=5, safeguard=False),
        "Picard on Richardson (Neumann)": S.Picard(),
        "GMRES(restart=5)": S.GMRES(restart=5),
        "GMRES(restart=10)": S.GMRES(restart=10),
        "GMRES(restart=20)": S.GMRES(restart=20),
        "BiCGStab (jax.scipy)": S.BiCGStab(),
    }
    try:
        import lineax as lx

        out["lineax Normal(CG)"] = lx.Normal(lx.CG(rtol=tol, atol=0.0))
        out["lineax GMRES(restart=20)"] = lx.GMRES(rtol=tol, atol=0.0, restart=20)
    except ImportError:
        print("(lineax is not installed: its solvers are left out)")
    return {k: v for k, v in out.items() if not any(x in k for x in skip)}


def _precision(name):
    return None if "precision=None" in name else "highest"


def _adjoint(solver, tol):
    adj = S.Implicit(rtol=tol) if solver is None else S.Implicit(solver, rtol=tol)
    return S.record_backward(adj)


def _report(title, rows, t):
    print(f"\n## {title}")
    print(f"{'backward linear solver':>36} {'solves':>6} {'prod/solve':>10} {'fallb.':>6} "
          f"{'grad err':>9} {'ok':>3} {'time ms':>8} {'default/this':>12}")
    for k, (solves, prods, fb, err, ok) in rows.items():
        print(f"{k:>36} {solves:6.0f} {prods:10.1f} {fb:6.0f} {err:9.1e} "
              f"{'yes' if ok else 'NO':>3} {t.median(k) * 1e3:8.3f} "
              f"{t.ratio('default', k):12.2f}")
    ok = [k for k in rows if rows[k][4] and k != "default"]
    best = min(ok, key=t.median)
    print(f"fastest converged: {best} ({t.median(best) * 1e3:.3f} ms, x{t.ratio('default', best):.2f}"
          " against the default)")


def _stats(records):
    r = np.asarray(sum(jnp.sum(x.reshape(-1, 4), 0) for x in records))
    solves = max(r[0], 1.0)
    return r[0], r[1] / solves, r[3], r[2] / solves


def bench_deq(repeats, skip):
    tol = 1e-5
    W, U, b, x, w_out = deq_problem(0)
    ref = deq_reference_grads(W, U, b, x, w_out)
    Wf, Uf, bf, xf, wf = f32(W, U, b, x, w_out)
    d = W.shape[0]
    def loss(diff, precision):
        (W, U, b), adjoint = diff
        fwd = S.Picard(tol=tol, max_steps=200, norm=S.l2_norm, precision=precision)

        def one(xi):
            return S.fixed_point(lambda z, a: deq_map(z, *a), jnp.zeros(d), (W, U, b, xi),
                                 solver=fwd, adjoint=adjoint, throw=False).value

        return jnp.sum(jax.vmap(one)(xf) @ wf)

    grad = eqx.filter_jit(eqx.filter_grad(loss))
    rows, fns = {}, {}
    for name, solver in contenders(tol, skip).items():
        adj, prec = _adjoint(solver, tol), _precision(name)
        gs, gadj = grad(((Wf, Uf, bf), adj), prec)
        _, rec = S.backward_stats(gadj)
        solves, prods, fb, _ = _stats(rec)
        err = max(float(np.max(np.abs(np.asarray(a) - r)) / np.max(np.abs(r)))
                  for a, r in zip(gs, ref))
        rows[name] = (solves, prods, fb, err, bool(np.isfinite(err) and err <= 1e-3))
        fns[name] = (lambda adj=adj, prec=prec: grad(((Wf, Uf, bf), adj), prec))
    t = interleaved(fns, repeats)
    _report("1. DEQ layer d=256, batch 64, forward + backward (grad err: largest relative "
            "error against the float64 dense reference; ok <= 1e-3)", rows, t)


def bench_spin(repeats, quick, skip):
    batch, n, dim, heads = (8, 32, 64, 4) if quick else (8, 128, 256, 4)
    tol = 1e-3
    kx, km = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, (batch, n, dim))

    def make(solver, precision="highest", tol=tol):
        return nn.SpinAttention(dim, heads, causal=True, update="tap", mode="fixed_point",
                                beta=1.0, output_proj=False,
                                solver=S.Anderson(tol=1e-3, max_steps=100,
                                                  precision=precision),
                                adjoint=_adjoint(solver, tol), key=km)

    def loss(module, x):
        return jnp.mean(jnp.sin(jax.vmap(module)(x)))

    grad = eqx.filter_jit(eqx.filter_grad(loss))
    # the reference: GMRES(50) to 1e-6 (a dense solve asked for 104 GB at the full size)
    g_ref, _ = S.backward_stats(grad(make(S.GMRES(restart=50), tol=1e-6), x))
    q_ref = g_ref.to_q.weight
    rows, fns = {}, {}
    for name, solver in contenders(tol, skip).items():
        m = make(solver, _precision(name))
        g, rec = S.backward_stats(grad(m, x))
        solves, prods, fb, _ = _stats(rec)
        err = float(jnp.linalg.norm(g.to_q.weight - q_ref) / jnp.linalg.norm(q_ref))
        finite = all(bool(jnp.all(jnp.isfinite(v))) for v in jax.tree.leaves(g))
        rows[name] = (solves, prods, fb, err, finite and err <= 1e-2)
        fns[name] = (lambda m=m: grad(m, x))
    t = interleaved(fns, repeats)
    _report(f"2. SpinAttention TAP steady state, batch {batch}, {n} tokens, width {dim}, "
            f"{heads} heads, forward + backward (grad err: W_q's gradient against a GMRES(50) "
            "backward solve to 1e-6; ok <= 1e-2)", rows, t)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer rounds, a smaller spin layer")
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--only", choices=("deq", "spin"), default=None)
    p.add_argument("--skip", nargs="*", default=[], help="leave out contenders whose name "
                   "contains one of these (e.g. lineax)")
    a = p.parse_args()
    repeats = a.repeats or (5 if a.quick else 15)
    print(f"python {sys.version.split()[0]}, jax {jax.__version__}, device {jax.devices()[0]}"
          f" (platform {jax.default_backend()})")
    if a.only in (None, "deq"):
        bench_deq(repeats, a.skip)
    if a.only in (None, "spin"):
        bench_spin(repeats, a.quick, a.skip)


if __name__ == "__main__":
    main()
