"""Streaming, entropy production as a loss, and local losses on character-level Shakespeare:
what each changes, over several seeds.

    python experiments/streaming_ablation.py run      # train every run not yet finished
    python experiments/streaming_ablation.py report   # the table from finished runs
    python experiments/streaming_ablation.py all

Variants (all from `configs/shakespeare_stream.yaml`: width 128, depth 4, 4 heads, one
first-order mean-field time step per call; `--steps` optimizer steps each):

- `stream`: the config as shipped (state carried from the previous chunk of each stream);
- `reset`: the same model reading random windows with a fresh start φ(x) every call
  (`data.stream: false`, `init: reset`): what carrying the state buys;
- `sigma+` / `sigma-`: `stream` with `train.entropy_weight` = +w / −w (minimise / maximise
  the entropy production);
- `local`: `stream` with `train.local_losses: true` (no gradient through the stack).

Runs go to `--runs/<variant>_s<seed>`; a run with a `summary.json` is skipped, so the sweep
can be stopped and restarted. `report` writes `streaming.md` and `streaming.json` into
`--results` (default `experiments/results/nonequilibrium`): final validation loss and the
entropy production per layer (mean ± std over seeds), and paired gaps to `stream` with 95 %
t-intervals over seeds. `--data PATH` points at the text (default: the fetched Shakespeare).
"""

from __future__ import annotations

import json
import pathlib
import sys

import numpy as np

import spinformer as sf

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _cli import dispatch, make_parser, run_script  # noqa: E402
from spinformer.grid import mean_ci  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent
CONFIG = ROOT / "configs" / "shakespeare_stream.yaml"


def variants(weight: float) -> dict[str, dict]:
    return {
        "stream": {},
        "reset": {"data.stream": False, "model.attention.init": "reset"},
        "sigma+": {"train.entropy_weight": weight},
        "sigma-": {"train.entropy_weight": -weight},
        "local": {"train.local_losses": True},
    }


def base_changes(args, seed: int) -> dict:
    changes = {"train.steps": args.steps, "train.seed": seed, "data.seed": seed,
               "train.eval_every": max(args.steps // 4, 1), "train.patience": 0,
               "train.checkpoint_every": args.steps, "train.progress": False,
               "train.warmup_steps": min(200, args.steps // 10)}
    if args.data:
        changes["data.path"] = args.data
    return changes


def cmd_run(args) -> None:
    runs = pathlib.Path(args.runs)
    cfg0 = sf.config.load_config(CONFIG)
    for seed in range(args.seeds):
        for name, change in variants(args.weight).items():
            out = runs / f"{name}_s{seed}"
            if (out / "summary.json").exists():
                continue
            cfg = cfg0.replace({**base_changes(args, seed), **change})
            summary = sf.train.run(cfg, out, resume=out.exists())
            m = summary["metrics"]
            print(f"{out.name}: val loss {m['loss']:.4f}, entropy production "
                  f"{m.get('entropy_production', float('nan')):.3f}, "
                  f"{summary['wall_time_s']:.0f} s", flush=True)


def cmd_report(args) -> None:
    runs = pathlib.Path(args.runs)
    rows: dict[str, dict[int, dict]] = {}
    for p in sorted(runs.glob("*_s*/summary.json")):
        name, seed = p.parent.name.rsplit("_s", 1)
        rows.setdefault(name, {})[int(seed)] = json.loads(p.read_text())["metrics"]
    if not rows:
        raise SystemExit(f"no finished runs under {runs}; run `... run` first.")
    depth = max((int(k.split("/")[1]) for r in rows.values() for m in r.values() for k in m
                 if k.startswith("entropy_production/")), default=-1) + 1
    order = [v for v in variants(args.weight) if v in rows]
    lines = [f"# Streaming, entropy production and local losses ({args.steps} steps, "
             f"entropy weight ±{args.weight})", "",
             "Validation loss (nats per character) and entropy production per layer, mean ± "
             "std over seeds; paired gaps to `stream` with 95 % t-intervals over the seeds "
             "both have.", "",
             "| variant | seeds | val loss | gap to stream | σ total | "
             + " | ".join(f"σ layer {i}" for i in range(depth)) + " |",
             "|---|---|---|---|---|" + "---|" * depth]
    result = {}
    for name in order:
        r = rows[name]
        loss = np.array([m["loss"] for m in r.values()])
        sig = np.array([m.get("entropy_production", np.nan) for m in r.values()])
        layers = [np.array([m.get(f"entropy_production/{i}", np.nan) for m in r.values()])
                  for i in range(depth)]
        common = sorted(set(r) & set(rows.get("stream", {})))
        gap = np.array([r[s]["loss"] - rows["stream"][s]["loss"] for s in common])
        gmean, ghalf = mean_ci(gap) if len(gap) else (float("nan"), float("nan"))
        gap_txt = "—" if name == "stream" or not len(gap) else f"{gmean:+.4f} ± {ghalf:.4f}"
        lines.append(f"| {name} | {len(loss)} | {loss.mean():.4f} ± {loss.std():.4f} | "
                     f"{gap_txt} | {np.nanmean(sig):.3f} ± {np.nanstd(sig):.3f} | "
                     + " | ".join(f"{np.nanmean(x):.3f}" for x in layers) + " |")
        result[name] = {"seeds": sorted(r), "loss": loss.tolist(), "entropy_production":
                        sig.tolist(), "gap_to_stream": [gmean, ghalf],
                        "entropy_production_per_layer": [x.tolist() for x in layers]}
    out = pathlib.Path(args.results)
    out.mkdir(parents=True, exist_ok=True)
    (out / "streaming.md").write_text("\n".join(lines) + "\n")
    (out / "streaming.json").write_text(json.dumps(result, indent=2))
    print("\n".join(lines))


def main(argv=None) -> None:
    p = make_parser(__doc__, runs="streaming_ablation", results="nonequilibrium")
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--weight", type=float, default=0.01, help="|train.entropy_weight|")
    p.add_argument("--data", help="the text file (default: the config's, the fetched "
                   "Shakespeare)")
    dispatch(p.parse_args(argv), run=cmd_run, report=cmd_report)


if __name__ == "__main__":
    run_script(main)
