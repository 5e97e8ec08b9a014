"""Text generation: incremental decoding vs re-solving the whole context at every step.

    python experiments/bench/generate.py [--length 256] [--depth 4] [--seq-len 128]
                                         [--batch 1 ...] [--repeats 3] [--run RUN_DIR ...]
                                         [--quick] [--out experiments/results/generate]

For each model, `nn.generate` draws `--length` characters after a fixed prompt twice,
interleaved (`_compare.interleaved`, one warm-up call each that compiles): incrementally
(`incremental=True`: per-layer caches, each new position solved on its own) and re-solving the
context window with one whole-sequence call per character (`incremental=False`, padded to
the model's `max_len`, one compilation). Both use the same window policy (restart at the last
`max_len // 2` tokens when full) and the same sampling keys, so they generate the same text
whenever their logits agree to within the sampling's resolution; the script reports whether
they did. The ratio printed is re-solve time / incremental time (> 1: incremental is faster).
`--batch B ...`: also generate B sequences at once (B prompts, both paths batched the same
way); the time per character is then per step of the whole batch. `--unroll K ...` adds the
TAP model decoded with `solvers.Picard(tol=1e-3, max_steps=K, unroll=True)` (no while loop:
on a GPU each while-loop iteration waits for the host), once against re-solving with the
layers' own Anderson and once with the same solver in both paths; solves that miss the
tolerance are counted in both paths (incremental: per position; re-solving: per window
call, padding included).

Models: by default freshly initialised causal LMs of the Shakespeare config's shape (width
128, 4 heads, FFN 256, `--depth` blocks, `max_len = --seq-len`) with spin attention (TAP
steady state and 2 first-order time steps), softmax attention, and Boltzmann attention at the
length exact inference allows (12); `--run DIR` adds trained runs. Results go to
`generate.json` and `generate.md` in `--out`.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _compare import interleaved, ratio_header  # noqa: E402

from spinformer import nn, solvers  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
VOCAB = 65


def models(depth: int, seq_len: int):
    """`(label, model)` of the default contenders."""
    common = dict(dim=128, depth=depth, num_heads=4, ffn_hidden=256)
    yield (f"spin TAP steady state (fixed_point, tol 1e-3), depth {depth}, T {seq_len}",
           nn.CausalLM(VOCAB, max_len=seq_len, attention="spin",
                       attention_kwargs=dict(update="tap", output_proj=True),
                       key=jax.random.key(0), **common))
    yield (f"spin 2 mean-field steps, depth {depth}, T {seq_len}",
           nn.CausalLM(VOCAB, max_len=seq_len, attention="spin",
                       attention_kwargs=dict(update="mean_field", mode="steps", num_steps=2,
                                             output_proj=True),
                       key=jax.random.key(0), **common))
    yield (f"softmax, depth {depth}, T {seq_len}",
           nn.CausalLM(VOCAB, max_len=seq_len, attention="softmax", key=jax.random.key(0),
                       **common))
    yield ("boltzmann hJ exact, depth 1, T 12",
           nn.CausalLM(VOCAB, 64, 1, num_heads=1, max_len=12, attention="boltzmann",
                       attention_kwargs=dict(init_scale=0.1), ffn_hidden=128,
                       key=jax.random.key(0)))


def trained(run_dir):
    from spinformer._generate import load_language_model

    cfg, chars, model = load_language_model(run_dir)
    return f"trained run {pathlib.Path(run_dir).name} ({cfg.model.attention.name})", model


def measure(label, model, length, repeats, prompt, batch=1, solver=None, resolve_solver=None):
    """Time `generate` both ways; `solver` replaces the layers' solvers in the incremental
    path, `resolve_solver` in the re-solving one (None: the layers' own)."""
    key = jax.random.key(0)
    if batch > 1:
        prompt = (prompt[None] + jnp.arange(batch)[:, None]) % VOCAB
        label = f"{label}, batch {batch}"
    texts = {}

    def run(incremental):
        def f():
            out, info = nn.generate(model, prompt, length=length, temperature=0.8, key=key,
                                    incremental=incremental,
                                    solver=solver if incremental else resolve_solver)
            texts[incremental] = (out, info)
            return jnp.asarray(out)
        return f

    t = interleaved({"incremental": run(True), "re-solve": run(False)}, repeats)
    (inc, info), (ref, ref_info) = texts[True], texts[False]
    if batch > 1:  # the first difference in any row
        diffs = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), None)
                 for x, y in zip(inc, ref)]
        diffs = [d for d in diffs if d is not None]
        first_diff = min(diffs) if diffs else None
    else:
        first_diff = next((i for i, (a, b) in enumerate(zip(inc, ref)) if a != b), None)
    same = length if first_diff is None else first_diff
    row = {
        "model": label,
        "batch": batch,
        "incremental_s": t.median("incremental"),
        "resolve_s": t.median("re-solve"),
        "ratio": t.ratio("re-solve", "incremental"),
        "ms_per_char_incremental": 1e3 * t.median("incremental") / length,
        "ms_per_char_resolve": 1e3 * t.median("re-solve") / length,
        "same_text": same == length,
        "first_difference": first_diff,
        "restarts": info["restarts"],
        "solver_failures": info["solver_failures"],
        "resolve_solver_failures": ref_info["solver_failures"],
    }
    print(f"{label}: incremental {row['ms_per_char_incremental']:.3f} ms/char, re-solve "
          f"{row['ms_per_char_resolve']:.3f} ms/char, ratio {row['ratio']:.2f}x, solver "
          f"failures {row['solver_failures']} (re-solve {row['resolve_solver_failures']}), "
          f"same text: "
          f"{row['same_text']}" + ("" if first_diff is None else
                                   f" (first difference at character {first_diff})"),
          flush=True)
    return row


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--length", type=int, default=256)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--batch", type=int, nargs="+", default=[1],
                   help="batch sizes (sequences generated together)")
    p.add_argument("--run", action="append", default=[], help="also a trained run directory")
    p.add_argument("--only", help="only models whose label contains this text (several: "
                   "separated by |)")
    p.add_argument("--unroll", type=int, nargs="*", default=[],
                   help="also the TAP model with solvers.Picard(tol=1e-3, max_steps=K, "
                   "unroll=True) for each K: in the incremental path only (re-solving keeps "
                   "the layers' Anderson), and in both paths")
    p.add_argument("--out", default=str(ROOT / "experiments" / "results" / "generate"))
    p.add_argument("--tag", default="", help="added to the result files' names")
    p.add_argument("--quick", action="store_true", help="a smoke test: 32 characters, depth "
                   "2, T 32, one round, results under quick_*")
    args = p.parse_args(argv)
    if args.quick:
        args.length, args.depth, args.seq_len, args.repeats = 32, 2, 32, 1
    device = jax.devices()[0]
    header = ratio_header("re-solve", "incremental")
    print(f"device: {device.device_kind} ({device.platform}); {header}", flush=True)
    prompt = jnp.arange(8, dtype=jnp.int32) % VOCAB
    rows = []
    contenders = list(models(args.depth, args.seq_len)) + [trained(r) for r in args.run]
    runs = [(label, model, None, None) for label, model in contenders]
    tap = next((m for label, m in contenders if label.startswith("spin TAP")), None)
    for K in args.unroll:
        fixed = solvers.Picard(tol=1e-3, max_steps=K, unroll=True)
        runs.append((f"spin TAP, decode Picard x{K} unrolled (re-solve: Anderson)", tap, fixed,
                     None))
        runs.append((f"spin TAP, Picard x{K} unrolled in both paths", tap, fixed, fixed))
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = ("quick_" if args.quick else "") + device.platform + (f"_{args.tag}" if args.tag
                                                                 else "")
    for label, model, solver, resolve_solver in runs:
        if args.only and not any(part in label for part in args.only.split("|")):
            continue
        for batch in args.batch:
            rows.append(measure(label, model, args.length, args.repeats, prompt, batch,
                                solver, resolve_solver))
            write(out, tag, device, args.length, rows)  # after every row: a cut run keeps them
    print((out / f"generate_{tag}.md").read_text() if rows else "no model matched --only")


def write(out, tag, device, length, rows):
    """`generate_{tag}.json` and `.md` in `out` with the rows so far."""
    result = {"device": device.device_kind, "platform": device.platform,
              "machine": platform.machine(), "length": length, "rows": rows}
    (out / f"generate_{tag}.json").write_text(json.dumps(result, indent=2))
    lines = [f"# Generating {length} characters: incremental vs re-solving the context "
             f"({device.device_kind})", "",
             "Ratio = re-solve time / incremental time (medians over interleaved rounds); with a "
             "batch, ms/char is per step of the whole batch.", "",
             "| model | incremental (ms/char) | re-solve (ms/char) | ratio | same text | "
             "window restarts | solver failures (incremental / re-solve) |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        same = "yes" if r["same_text"] else f"no (from char {r['first_difference']})"
        lines.append(f"| {r['model']} | {r['ms_per_char_incremental']:.2f} | "
                     f"{r['ms_per_char_resolve']:.2f} | {r['ratio']:.1f}x | {same} | "
                     f"{r['restarts']} | {r['solver_failures']} / "
                     f"{r['resolve_solver_failures']} |")
    (out / f"generate_{tag}.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
