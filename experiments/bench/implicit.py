"""Deep Implicit Attention against a softmax block of the same width, on the shapes of the
Fashion-MNIST image model (batch 64, 17 sites: 16 conv sites + the classification site,
width 10), and the memory of the implicit backward pass.

    python experiments/bench/implicit.py [--quick]

1. Forward+backward time of one layer on a batch (a scalar loss of the outputs), timed side by
   side in one process (`_compare.interleaved`), with the forward and backward solver steps:
   `ImplicitAttention` (explicit couplings, MLP Onsager term, Anderson tol 1e-4 ≤ 40 steps,
   implicit backward tol 1e-4) at its initialisation and at a harder coupling scale, vs a
   pre-norm softmax `Block` (one head, FFN of width 2d) of the same width.
2. Peak temporary memory of the compiled forward+backward (XLA's buffer assignment) with the
   forward solve forced to exactly 10 and 40 Anderson steps (tol 0): the implicit adjoint's
   memory must not grow with the number of forward steps (an unrolled backward does, shown
   for contrast).
3. Amortised couplings (`couplings="softmax"`) on the attention zoo's bracket shapes: the
   factored product W (Σ_j A_ij m_j) against the dense coupling tensor, forward+backward.
Ratios are `softmax time / implicit time` (> 1: implicit is faster).
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import equinox as eqx
import jax
import jax.numpy as jnp

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _compare import interleaved  # noqa: E402

from spinformer import nn, solvers  # noqa: E402

B, N, D = 64, 17, 10


def layers(scale: float, key):
    imp = nn.ImplicitAttention(D, max_len=N, key=key)
    imp = eqx.tree_at(lambda a: a.J, imp, scale * imp.J)
    # a trained Onsager term is not zero: give the MLP's last layer a small random weight
    last = imp.onsager_mlp.layers[-1]
    w = 0.1 * jax.random.normal(jax.random.fold_in(key, 1), last.weight.shape)
    imp = eqx.tree_at(lambda a: a.onsager_mlp.layers[-1].weight, imp, w)
    return solvers.record_backward(imp)  # its backward solves observed


@eqx.filter_jit
def fwd_bwd(layer, x):
    """Loss, diagnostics, gradients and backward-solve records of one implicit layer."""

    def loss(layer):
        out, diag = jax.vmap(lambda xx: layer(xx, return_diagnostics=True))(x)
        return jnp.sum(jnp.sin(out)), diag

    (val, diag), grads = eqx.filter_value_and_grad(loss, has_aux=True)(layer)
    grads, records = solvers.backward_stats(grads)
    return val, diag, grads, records


def section_time(quick):
    print(f"## 1. forward+backward, batch {B} x {N} sites x width {D}")
    key = jax.random.key(0)
    x = jax.random.normal(jax.random.key(1), (B, N, D))
    soft = nn.Block(nn.SoftmaxAttention(D, 1, key=key), D, ffn_hidden=2 * D,
                    key=jax.random.key(2))
    contenders = {"softmax block": (soft, eqx.filter_jit(
        lambda m, x: eqx.filter_grad(lambda m: jnp.sum(jnp.sin(jax.vmap(m)(x))))(m)))}
    for scale in (1.0, 3.0):
        contenders[f"implicit (J x{scale:g})"] = (layers(scale, key), fwd_bwd)
    fns = {}
    for name, (layer, f) in contenders.items():
        fns[name] = (lambda f=f, layer=layer: f(layer, x))
    t = interleaved(fns, 3 if quick else 15)
    print(f"{'layer':>18} {'ms':>8} {'softmax/this':>13} {'fwd steps':>10} {'bwd products':>13}")
    for name, (layer, f) in contenders.items():
        steps = bwd = ""
        if name != "softmax block":
            _, diag, _, records = f(layer, x)
            steps = f"{float(jnp.mean(diag.solver.num_steps)):.1f}"
            tot = sum(r.reshape(-1, r.shape[-1]).sum(0) for r in records)
            bwd = f"{float(tot[1] / max(float(tot[0]), 1.0)):.1f}"
        ratio = "" if name == "softmax block" else f"{t.ratio('softmax block', name):.3f}"
        print(f"{name:>18} {1e3 * t.median(name):8.2f} {ratio:>13} {steps:>10} {bwd:>13}")


def section_memory():
    print(f"\n## 2. peak temporary memory of forward+backward (batch {B}), forced k steps")
    x = jax.random.normal(jax.random.key(1), (B, N, D))
    base = layers(1.0, jax.random.key(0))
    rows = {}
    for name, adj in (("implicit", solvers.Implicit(rtol=1e-4)), ("unrolled", solvers.Unrolled())):
        for k in (10, 40):
            # the layer's own map, solved with exactly k steps (tol 0; the module itself would
            # treat such a solve as failed and pass no gradient through it)
            def loss(layer, x, k=k, adj=adj):
                def one(xx):
                    X, J = layer.fields(xx), layer.coupling_blocks(xx)
                    return solvers.fixed_point(
                        layer.update, X, (X, J, None),
                        solver=solvers.Anderson(tol=0.0, max_steps=k), adjoint=adj,
                        throw=False).value

                return jnp.sum(jnp.sin(jax.vmap(one)(x)))

            params, static = eqx.partition(base, eqx.is_inexact_array)
            g = jax.jit(jax.grad(lambda p, x, loss=loss: loss(eqx.combine(p, static), x)))
            mem = g.lower(params, x).compile().memory_analysis()
            rows[(name, k)] = mem.temp_size_in_bytes
    print(f"{'adjoint':>9} {'k':>4} {'peak temp KiB':>14}")
    for (name, k), m in rows.items():
        print(f"{name:>9} {k:>4} {m / 2**10:14.1f}")
    imp = rows[("implicit", 40)] / rows[("implicit", 10)]
    unr = rows[("unrolled", 40)] / rows[("unrolled", 10)]
    print(f"implicit 40/10: x{imp:.2f} (flat = 1) ; unrolled 40/10: x{unr:.2f}")


def section_amortised(quick):
    Bz, T, Dz = 64, 12, 32
    print(f"\n## 3. amortised couplings J_ij = softmax(q_i.k_j) W, the zoo's bracket shapes "
          f"(batch {Bz}, T = {T}, width {Dz}, causal): forward+backward applying W (A m) "
          "against the dense (h, n, n, dh, dh) tensor")
    layer = nn.ImplicitAttention(Dz, 1, causal=True, couplings="softmax", max_len=T,
                                 key=jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (Bz, T, Dz))
    print(f"{'W scale':>8} {'fwd steps':>10} {'dense ms':>9} {'factored ms':>12} "
          f"{'dense/factored':>15}")
    for scale in (1.0, 6.0):  # the initial scale, and a solve as hard as a trained model's
        lay = eqx.tree_at(lambda a: a.W, layer, scale * layer.W)

        def grad_fn(dense):
            def loss(lay, x):
                def one(xx):
                    J = (lay.coupling_blocks(xx) if dense
                         else lay.coupling_operator(xx))
                    X = lay.fields(xx)
                    sol = solvers.fixed_point(lay.update, X, (X, J, None), solver=lay.solver,
                                              adjoint=lay.adjoint, throw=False)
                    return sol.value, sol.num_steps
                out, steps = jax.vmap(one)(x)
                return jnp.sum(jnp.sin(out)), jnp.mean(steps)
            return eqx.filter_jit(eqx.filter_grad(loss, has_aux=True))

        fns = {k: (lambda f=grad_fn(k == "dense"): f(lay, x)) for k in ("dense", "factored")}
        t = interleaved(fns, 3 if quick else 10)
        steps = float(fns["factored"]()[1])
        print(f"{scale:8.1f} {steps:10.1f} {1e3 * t.median('dense'):9.2f} "
              f"{1e3 * t.median('factored'):12.2f} {t.ratio('dense', 'factored'):15.2f}")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer timing rounds")
    a = p.parse_args()
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}")
    section_time(a.quick)
    section_memory()
    section_amortised(a.quick)


if __name__ == "__main__":
    main()
