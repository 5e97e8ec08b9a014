"""Benchmark of the two energy-based attentions against softmax attention: forward +
backward (the gradient of a scalar loss over a batch with respect to the module's
parameters and the input), each contender jitted, compiled before timing and run
interleaved; the ratio printed is softmax time / contender time (> 1: the contender is
faster; below 1 it is that fraction of softmax's speed).

Contenders, at the sizes the other families' benchmarks use (batch 8, 64 tokens, width 64,
4 heads):

- `HopfieldAttention` in each mode: `one_step` (softmax attention written as a Hopfield
  read-out: the overhead of the formulation), `steps` (3 updates, unrolled) and
  `fixed_point` (the retrieval solved, with the default phantom adjoint and with the implicit
  adjoint), with the forward solver steps and backward products per solve;
- `EnergyTransformerAttention` with the paper's 12 descent steps (relu memories, M = 2·D),
  which replaces a block's attention *and* feed-forward network: it is also timed against
  softmax attention followed by a feed-forward network of hidden width 2·D.

    python experiments/bench/energy_attention.py            # the sizes above
    python experiments/bench/energy_attention.py --quick    # small sizes, a smoke test
"""

from __future__ import annotations

import argparse

import equinox as eqx
import jax
import jax.numpy as jnp

from spinformer import nn, solvers

from _compare import interleaved, ratio_header


def _grad_fn(module):
    """Forward + backward over a batch: gradients of sum(y²) w.r.t. parameters and input."""

    @eqx.filter_jit
    def run(m, x):
        def loss(m, x):
            return jnp.sum(jax.vmap(m)(x) ** 2)

        return eqx.filter_grad(loss)(m, x), jax.grad(
            lambda xx: loss(m, xx))(x)

    return lambda x: run(module, x)


class _SoftmaxFFN(eqx.Module):
    attn: nn.SoftmaxAttention
    ffn: nn.FeedForward

    def __call__(self, x):
        h = x + self.attn(x)
        return h + jax.vmap(self.ffn)(h)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, a smoke test")
    parser.add_argument("--repeats", type=int, default=None)
    args = parser.parse_args(argv)
    B, n, D, H = (2, 16, 16, 2) if args.quick else (8, 64, 64, 4)
    repeats = args.repeats or (3 if args.quick else 15)
    key = jax.random.key(0)
    x = jax.random.normal(jax.random.key(1), (B, n, D))

    contenders = {
        "softmax": nn.SoftmaxAttention(D, H, key=key),
        "hopfield one_step": nn.HopfieldAttention(D, H, mode="one_step", key=key),
        "hopfield steps=3": nn.HopfieldAttention(D, H, mode="steps", num_steps=3, key=key),
        "hopfield fixed_point (phantom)": nn.HopfieldAttention(D, H, key=key),
        "hopfield fixed_point (implicit)": solvers.record_backward(nn.HopfieldAttention(
            D, H, adjoint=solvers.Implicit(linear_solver=solvers.GMRES(restart=5), rtol=1e-3),
            key=key)),
        "energy transformer (12 steps)": nn.EnergyTransformerAttention(D, H, key=key),
        "softmax + FFN(2D)": _SoftmaxFFN(nn.SoftmaxAttention(D, H, key=key),
                                         nn.FeedForward(D, 2 * D, key=key)),
    }
    fns = {name: (lambda f: (lambda: f(x)))(_grad_fn(m)) for name, m in contenders.items()}
    t = interleaved(fns, repeats)
    print(f"batch {B}, {n} tokens, width {D}, {H} heads; {repeats} rounds")
    print(ratio_header("softmax", "contender"))
    for name in contenders:
        if name == "softmax":
            print(f"{name:34s} {1e3 * t.median(name):8.2f} ms")
            continue
        base = "softmax + FFN(2D)" if name.startswith("energy") else "softmax"
        print(f"{name:34s} {1e3 * t.median(name):8.2f} ms   {base} / it = "
              f"{t.ratio(base, name):.3f}")
    # the retrieval's solver statistics on this batch
    hop = contenders["hopfield fixed_point (implicit)"]
    _, diag = jax.vmap(lambda xx: hop(xx, return_diagnostics=True))(x)
    grads = eqx.filter_grad(lambda m: jnp.sum(jax.vmap(m)(x) ** 2))(hop)
    _, records = solvers.backward_stats(grads)
    solves, products = (float(v) for v in records[0][:2])
    print(f"retrieval: {float(jnp.mean(diag.solver.num_steps)):.1f} forward steps per solve "
          f"(one solve per head and example), "
          f"{float(jnp.mean(diag.solver.result != 0)):.1%} not converged; "
          f"{products / max(solves, 1):.1f} backward products per implicit solve")


if __name__ == "__main__":
    main()
