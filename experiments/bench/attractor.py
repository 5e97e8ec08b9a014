"""The attractor network's cost: one step of the dynamics and one training step, at the sizes of
the Fashion-MNIST experiment and beyond; steps per second, compiled peak memory, and the largest
sizes that fit a machine.

    python experiments/bench/attractor.py [--batch 32] [--repeats 5] [--memory-gib 24]
                                          [--out experiments/results/attractor]

With position-dependent couplings 𝕁_ij (an N × N × d × d tensor) a step costs O(N² d²) per
image. `spins.attractor` computes each receiving token's row (scores and messages 𝕁_ij x_j for
all j, one batched contraction) in a compiled `lax.map` over the tokens. The reference it is
timed against, side by side (`_compare.interleaved`), is the same update as one contraction
over all N² pairs at once (every message materialised, then the softmax and the weighted sum),
which was our first implementation: the row-wise form reads each row's couplings once and
keeps its messages in cache, and is faster on CPU. Both give the same numbers (checked).

Memory: the compiled training step's `memory_analysis()` (arguments + outputs + XLA's
temporaries) at each size; the couplings alone take 4N²d² bytes, and the step's temporaries
grow like B·N²·d. The largest N for each d at `--memory-gib` is extrapolated from the measured
bytes (fitted as a + b·N² at fixed d and B) and printed.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _compare import interleaved  # noqa: E402

import spinformer as sf  # noqa: E402
from spinformer.spins import attractor as A  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]


def all_pairs_step(x, J, lam=1.0, gamma=1.0):
    """Reference: every message y_ij = 𝕁_ij x_j at once `(N, N, d)`, then the update."""
    N = x.shape[0]
    y = jnp.einsum("ijab,jb->ija", J, x)
    s = lam * jnp.einsum("ia,ija->ij", x, y)
    s = jnp.where(jnp.eye(N, dtype=bool), -jnp.inf, s)
    z = lam * jnp.einsum("ij,ija->ia", jax.nn.softmax(s, axis=-1), y) + gamma * x
    return z / jnp.linalg.norm(z, axis=-1, keepdims=True)


def sizes():
    # (label, image side, patch, d)
    return [("2x2 patches, d=8 (experiment)", 28, 2, 8),
            ("2x2 patches, d=16", 28, 2, 16),
            ("4x4 patches, d=32 (experiment)", 28, 4, 32),
            ("4x4 patches, d=64", 28, 4, 64),
            ("2x2 patches of 20x20, d=8", 20, 2, 8),
            ("2x2 patches of 36x36, d=8", 36, 2, 8)]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--memory-gib", type=float, default=24.0)
    p.add_argument("--out", default=str(ROOT / "experiments" / "results" / "attractor"))
    p.add_argument("--quick", action="store_true", help="two small sizes (smoke test)")
    a = p.parse_args(argv)
    B = a.batch
    rows = []
    todo = sizes() if not a.quick else [("2x2 patches of 8x8, d=8", 8, 2, 8),
                                         ("4x4 patches of 8x8, d=32", 8, 4, 32)]
    print(f"batch {B}; times are medians of {a.repeats} interleaved rounds; ratio = "
          f"all-pairs time / row-wise time (> 1: the row-wise form is faster)")
    print(f"{'size':34s} {'N':>4s} {'d':>3s} {'step ms':>8s} {'pairs ms':>8s} {'ratio':>6s} "
          f"{'train ms':>8s} {'train/s':>7s} {'peak MiB':>9s} {'J MiB':>7s}")
    for label, side, P, d in todo:
        net = sf.nn.AttractorNetwork((side, side), P, d, key=jax.random.key(0))
        N = net.embedding.num_tokens
        imgs = np.asarray(jax.random.uniform(jax.random.key(1), (B, side, side)))
        x = jax.vmap(net.embedding.embed)(jnp.asarray(imgs))
        J = net.couplings
        ours = jax.jit(jax.vmap(lambda xx, J: A.step(xx, J), (0, None)))
        ref = jax.jit(jax.vmap(all_pairs_step, (0, None)))
        np.testing.assert_allclose(np.asarray(ours(x, J)), np.asarray(ref(x, J)), rtol=2e-4,
                                   atol=2e-5)
        train = eqx.filter_jit(lambda n, b: sf.nn.attractor_sgd_step(n, b, lr=1.0, clip=1.0))
        t = interleaved({"ours": lambda: ours(x, J), "pairs": lambda: ref(x, J),
                         "train": lambda: train(net, imgs)}, repeats=a.repeats)
        lowered = jax.jit(lambda n, b: sf.nn.attractor_sgd_step(n, b, lr=1.0, clip=1.0)
                          ).lower(net, imgs)
        mem = lowered.compile().memory_analysis()
        peak = (mem.argument_size_in_bytes + mem.output_size_in_bytes
                + mem.temp_size_in_bytes) if mem is not None else float("nan")
        r = {"label": label, "N": N, "d": d, "batch": B,
             "step_ms": 1e3 * t.median("ours"), "all_pairs_ms": 1e3 * t.median("pairs"),
             "ratio": t.ratio("pairs", "ours"), "train_ms": 1e3 * t.median("train"),
             "train_steps_per_s": 1.0 / t.median("train"), "peak_bytes": peak,
             "couplings_bytes": 4 * N * N * d * d}
        rows.append(r)
        print(f"{label:34s} {N:4d} {d:3d} {r['step_ms']:8.1f} {r['all_pairs_ms']:8.1f} "
              f"{r['ratio']:6.2f} {r['train_ms']:8.1f} {r['train_steps_per_s']:7.1f} "
              f"{peak / 2**20:9.1f} {r['couplings_bytes'] / 2**20:7.1f}", flush=True)

    # peak ≈ c · N² (couplings, gradient, messages: all ∝ N²) at fixed d and B
    budget = a.memory_gib * 2**30
    print(f"\nlargest N that fits {a.memory_gib:g} GiB for a training step at batch {B} "
          f"(peak bytes ∝ N² at fixed d, from the measured sizes):")
    fits = {}
    for d in sorted({r["d"] for r in rows}):
        rs = [r for r in rows if r["d"] == d]
        c = max(r["peak_bytes"] / r["N"] ** 2 for r in rs)
        nmax = int(np.sqrt(budget / c))
        fits[d] = nmax
        side2 = int(np.sqrt(nmax))
        print(f"  d = {d:3d}: {c:,.0f} bytes per N² → N ≤ {nmax:,} tokens "
              f"(≈ {side2}×{side2} patches, {c * 784 ** 2 / 2**30:.1f} GiB at N = 784)")
    out = pathlib.Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    name = "bench_quick.json" if a.quick else "bench.json"
    (out / name).write_text(json.dumps({"rows": rows, "largest_N": fits,
                                        "memory_gib": a.memory_gib,
                                        "device": str(jax.devices()[0])}, indent=1))
    print(f"written {out / name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
