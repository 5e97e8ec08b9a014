"""Data-parallel training steps on 1, 2 and 4 devices: steps per second and the bytes the
compiled step communicates.

    python experiments/bench/scaling.py [--devices 4] [--config quickstart] [--batch 32]
                                        [--repeats 7] [--out experiments/results/scaling]

The script re-executes itself with `XLA_FLAGS=--xla_force_host_platform_device_count=N` on a
CPU-only machine (the device count is fixed when JAX starts), builds the config's model, and
times the jitted training step (`train.jit_step`) with the batch sharded over a `data` axis
of 1, 2, ... N devices and the parameters replicated, one call of each per round
(`_compare.interleaved`). On a machine with few cores the forced "devices" share the same
cores: the figure then measures the overhead of partitioning and of the collectives, not a
speed-up. On real accelerators (several GPUs) run it as is: the devices are the GPUs.

Bytes communicated: the collective operations (all-reduce, all-gather, reduce-scatter,
all-to-all, collective-permute) of the compiled step's HLO, with their result sizes summed
(for an all-reduce, the bytes each device contributes; a ring all-reduce moves about
2(n-1)/n times that per device). Counted once each: a collective inside a while loop (the
fixed-point solver's "all examples converged?" test, a one-byte all-reduce of a `pred`) runs
once per iteration, so the bytes are those of the gradient all-reduce plus a few bytes per
solver iteration.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
_COLLECTIVE = re.compile(
    r"=\s*(\(?[^=]*?\)?)\s*(all-reduce|all-gather|reduce-scatter|all-to-all|"
    r"collective-permute)(-start)?\(")
_SHAPE = re.compile(r"(pred|s8|u8|s16|u16|bf16|f16|s32|u32|f32|s64|u64|f64)\[([0-9,]*)\]")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2, "s32": 4,
          "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}


def collective_bytes(hlo: str) -> dict[str, int]:
    """Summed result bytes of each kind of collective in an HLO module's text."""
    out: dict[str, int] = {}
    for line in hlo.splitlines():
        line = re.sub(r"/\*.*?\*/", "", line)  # tuple index comments hold "="
        m = _COLLECTIVE.search(line)
        if not m or "-done" in line.split("=", 1)[-1][:40]:
            continue
        size = 0
        for dtype, dims in _SHAPE.findall(m.group(1)):
            n = 1
            for d in filter(None, dims.split(",")):
                n *= int(d)
            size += n * _BYTES[dtype]
        out[m.group(2)] = out.get(m.group(2), 0) + size
    return out


def child(args) -> None:
    import jax
    import jax.numpy as jnp  # noqa: F401

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
    from _compare import interleaved

    import spinformer as sf
    from spinformer import train
    from spinformer.train import _mesh

    from spinformer.cli import find_config

    cfg = sf.config.load_config(find_config(args.config),
                                overrides=[f"data.batch_size={args.batch}"])
    ds = train.build_dataset(cfg)
    model = train.build_model(cfg, ds, key=jax.random.key(0))
    opt = train.build_optimizer(cfg)
    state = train.RunState.init(model, opt)
    batch = ds.batch(0)
    counts = [n for n in (1, 2, 4, 8, 16) if n <= jax.device_count()]
    fns, comm = {}, {}
    for n in counts:
        mesh = _mesh.make_mesh({"data": n})
        s = _mesh.place_state(state, mesh)
        b = _mesh.shard_batch(batch, mesh)
        step = train.jit_step(opt, mesh=mesh)
        comm[n] = collective_bytes(step.lower(s, b).compile().compiled.as_text())
        fns[n] = (lambda step=step, s=s, b=b: step(s, b)[1]["loss"])
    t = interleaved({str(n): f for n, f in fns.items()}, repeats=args.repeats)
    rows = []
    for n in counts:
        sec = t.median(str(n))
        rows.append({"devices": n, "step_ms": 1e3 * sec, "steps_per_s": 1.0 / sec,
                     "vs_1": t.ratio("1", str(n)), "collectives": comm[n],
                     "bytes": sum(comm[n].values())})
    params = train.num_params(model)
    print(json.dumps({"config": args.config, "batch": args.batch, "params": params,
                      "platform": jax.devices()[0].platform, "cores": os.cpu_count(),
                      "rows": rows}))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--devices", type=int, default=4)
    p.add_argument("--config", default="quickstart")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--out", default=str(ROOT / "experiments/results/scaling"))
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return child(args)
    env = dict(os.environ)
    if env.get("JAX_PLATFORMS", "cpu") == "cpu":
        env["JAX_PLATFORMS"] = "cpu"
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") +
                            f" --xla_force_host_platform_device_count={args.devices}").strip()
    cmd = [sys.executable, __file__, "--child", "--config", args.config, "--batch",
           str(args.batch), "--repeats", str(args.repeats)]
    got = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if got.returncode:
        sys.exit(got.stderr[-3000:])
    res = json.loads(got.stdout.strip().splitlines()[-1])
    lines = [
        f"# Data-parallel training step: {res['config']} (batch {res['batch']}, "
        f"{res['params']:,} parameters), {res['platform']}, {res['cores']} cores",
        "",
        "Median of interleaved rounds; `vs 1 device` is the median ratio time(1)/time(n) "
        "(> 1: faster). Bytes: summed results of the compiled step's collectives.",
        "",
        "| devices | ms / step | steps / s | vs 1 device | collectives | bytes / step |",
        "|---:|---:|---:|---:|---|---:|",
    ]
    for r in res["rows"]:
        kinds = ", ".join(f"{k} {v:,}" for k, v in sorted(r["collectives"].items())) or "none"
        lines.append(f"| {r['devices']} | {r['step_ms']:.1f} | {r['steps_per_s']:.1f} | "
                     f"{r['vs_1']:.2f} | {kinds} | {r['bytes']:,} |")
    if res["platform"] == "cpu":
        lines += ["", "Forced host devices share this machine's cores: the table measures the "
                  "cost of partitioning and of the collectives, not a speed-up."]
    text = "\n".join(lines) + "\n"
    print(text)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = f"{res['platform']}_{res['config']}.md"
    (out / name).write_text(text)
    print(f"written to {out / name}")


if __name__ == "__main__":
    main()
