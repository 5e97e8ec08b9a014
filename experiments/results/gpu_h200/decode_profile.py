"""Where a decoded token's time goes on a GPU: kernels per compiled program and time per call.

    python experiments/results/gpu_h200/decode_profile.py OUT_DIR

For the spin language models of `experiments/bench/generate.py` (depth 4, width 128, T 128:
2 mean-field steps, and TAP steady state decoded with `solvers.Picard(max_steps=4,
unroll=True)`) and softmax, times one jitted `nn.decode_step` (one position, a full cache)
against one jitted whole-window forward (the re-solving path's work per token), 200 calls
each after a warm-up, and writes each compiled program's HLO with a count of its kernels
(fusions, library calls, while loops) to OUT_DIR.
"""

import pathlib
import re
import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "bench"))
import generate as g  # noqa: E402

from spinformer import nn, solvers  # noqa: E402

out = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/decode_profile")
out.mkdir(parents=True, exist_ok=True)
models = {label.split(",")[0]: m for label, m in g.models(4, 128)}
picked = {"mf2": models["spin 2 mean-field steps"],
          "tap_unrolled4": nn.with_solver(models["spin TAP steady state (fixed_point"],
                                          solvers.Picard(tol=1e-3, max_steps=4, unroll=True)),
          "softmax": models["softmax"]}
lines = [f"device: {jax.devices()[0].device_kind}"]


def kernels(text):
    ops = re.findall(r"= \S+ (fusion|custom-call|while|conditional|dot|convolution|copy|"
                     r"dynamic-update-slice|gather|scatter)\(", text)
    return {k: ops.count(k) for k in sorted(set(ops))}


def timed(f, *a, n=200):
    jax.block_until_ready(f(*a))
    t = time.perf_counter()
    for _ in range(n):
        r = f(*a)
    jax.block_until_ready(r)
    return 1e3 * (time.perf_counter() - t) / n


for name, model in picked.items():
    state = nn.decode_sequence(model, jnp.arange(100) % 65)[1]
    step = jax.jit(lambda s, t, m=model: nn.decode_step(m, s, t))
    whole = jax.jit(lambda toks, m=model: m(toks))
    toks = jnp.arange(128) % 65
    for what, f, a in (("decode_step", step, (state, jnp.int32(3))),
                       ("whole_window", whole, (toks,))):
        text = f.lower(*a).compile().as_text()
        (out / f"{name}_{what}.hlo.txt").write_text(text) if name != "softmax" else None
        lines.append(f"{name} {what}: {timed(f, *a):.3f} ms/call; kernels {kernels(text)}")
        print(lines[-1], flush=True)
(out / "decode_profile.txt").write_text("\n".join(lines) + "\n")
