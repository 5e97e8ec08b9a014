"""Where a decoded token's time goes on a GPU: kernels per compiled program and time per call.

    python experiments/results/gpu_h200/decode_profile.py OUT_DIR [--trace]

For the spin language models of `experiments/bench/generate.py` (depth 4, width 128, T 128:
2 mean-field steps, and TAP steady state decoded with `solvers.Picard(max_steps=4,
unroll=True)`) and softmax, times one jitted `nn.decode_step` (one position, a full cache)
against one jitted whole-window forward (the re-solving path's work per token), 200 calls
each after a warm-up, and writes each compiled program's HLO with a count of its kernels
(fusions, library calls, while loops) to OUT_DIR. With `--trace` it also records 20 calls of
each under `jax.profiler` and writes, per program, the events of each device (on a GPU: its
kernels) summed by name, with counts per call and time, to `decode_trace.txt`.
"""

import collections
import gzip
import json
import pathlib
import re
import sys
import tempfile
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "bench"))
import generate as g  # noqa: E402

from spinformer import nn, solvers  # noqa: E402

args = [a for a in sys.argv[1:] if not a.startswith("--")]
TRACE = "--trace" in sys.argv
out = pathlib.Path(args[0] if args else "decode_profile")
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


def trace_summary(f, a, calls=20):
    """Per process of the profile (host threads, each GPU stream): events summed by name,
    `(count per call, µs per call)`, largest first."""
    jax.block_until_ready(f(*a))
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d, create_perfetto_trace=True):
            for _ in range(calls):
                r = f(*a)
            jax.block_until_ready(r)
        path = next(pathlib.Path(d).rglob("perfetto_trace.json.gz"))
        events = json.loads(gzip.decompress(path.read_bytes()))
    events = events["traceEvents"] if isinstance(events, dict) else events
    names = {e["pid"]: e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    sums = collections.defaultdict(lambda: collections.defaultdict(lambda: [0, 0.0]))
    for e in events:
        if e.get("ph") == "X":
            s = sums[names.get(e["pid"], str(e["pid"]))][e["name"]]
            s[0] += 1
            s[1] += float(e.get("dur", 0.0))
    lines = []
    for proc, by_name in sums.items():
        total = sum(v[1] for v in by_name.values()) / calls
        count = sum(v[0] for v in by_name.values()) / calls
        lines.append(f"  [{proc}] {count:.0f} events/call, {total:.1f} us/call")
        for k, (c, t) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:15]:
            lines.append(f"    {c / calls:6.1f} x {t / max(c, 1):8.2f} us  {k[:90]}")
    return lines


traces = []
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
        if TRACE:
            traces += [f"{name} {what}:"] + trace_summary(f, a)
            (out / "decode_trace.txt").write_text("\n".join(traces) + "\n")
(out / "decode_profile.txt").write_text("\n".join(lines) + "\n")
