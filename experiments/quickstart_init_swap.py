"""Which part of a model's initialisation decides whether a quickstart run plateaus: train
the quickstart from model seed `--base` with one group of parameters initialised as model
seed `--donor` initialises them, everything else (data seed, optimiser, steps) unchanged.

    python experiments/quickstart_init_swap.py run --base 2 --donor 0
    python experiments/quickstart_init_swap.py run --base 0 --donor 2
    python experiments/quickstart_init_swap.py report

Runs go to `--runs/<base>_<part>_from<donor>` (resumable; `swap.json` says what was
swapped); `report` writes `quickstart_init_swap.{md,json}` into `--results`, next to the
unswapped runs of `spin_lm.py` (`--reference`, `spin_s<seed>_d<data seed>`).
"""

from __future__ import annotations

import json
import pathlib
import sys

import equinox as eqx
import jax

import spinformer as sf
from spinformer.train import _experiment

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _cli import ROOT, dispatch, make_parser, run_script  # noqa: E402
from spin_lm import run_name  # noqa: E402

# the parameter groups (norms start at ones and zeros whatever the seed)
PARTS = {
    "qk": lambda m: (m.transformer.blocks.attention.to_q, m.transformer.blocks.attention.to_k),
    "embed": lambda m: (m.transformer.embed, m.transformer.pos_embed),
    "out": lambda m: m.transformer.blocks.attention.out_proj,
    "ffn_readout": lambda m: (m.transformer.blocks.ffn, m.readout),
}


def cmd_run(args) -> None:
    build = _experiment.build_model
    for part in args.parts.split(","):
        out = pathlib.Path(args.runs) / f"{args.base}_{part}_from{args.donor}"
        if (out / "summary.json").exists():
            continue
        cfg = sf.config.load_config(ROOT / "configs" / "quickstart.yaml").replace({
            "train.seed": args.base, "data.seed": args.data_seed, "train.patience": 0,
            "train.progress": False})
        if args.steps:  # a shorter run (a smoke test)
            cfg = cfg.replace({"train.steps": args.steps,
                               "train.checkpoint_every": max(args.steps // 3, 1)})

        def hybrid(cfg, dataset, *, key, part=part):
            model = build(cfg, dataset, key=key)
            donor = build(cfg, dataset, key=jax.random.key(args.donor))
            return eqx.tree_at(PARTS[part], model, PARTS[part](donor))

        _experiment.build_model = hybrid
        try:
            summary = sf.train.run(cfg, out, resume=out.exists())
        finally:
            _experiment.build_model = build
        (out / "swap.json").write_text(json.dumps(
            {"base": args.base, "donor": args.donor, "part": part,
             "data_seed": args.data_seed}))
        print(f"{out.name}: accuracy {summary['metrics']['accuracy']:.4f}", flush=True)


def cmd_report(args) -> None:
    ref = pathlib.Path(args.reference)
    rows = []
    for p in sorted(pathlib.Path(args.runs).glob("*/swap.json")):
        s = json.loads(p.read_text())
        acc = json.loads((p.parent / "summary.json").read_text())["metrics"]["accuracy"]
        base, donor = (json.loads((ref / run_name("spin", seed, s["data_seed"]) /
                                   "summary.json").read_text())["metrics"]["accuracy"]
                       for seed in (s["base"], s["donor"]))
        rows.append({**s, "accuracy": acc, "base_accuracy": base, "donor_accuracy": donor})
    lines = ["# Quickstart: which initialisation decides the plateau", "",
             "Validation accuracy (%) of the quickstart trained from model seed `base` with "
             "one group of parameters initialised as model seed `donor` initialises it "
             "(`experiments/quickstart_init_swap.py`); the last two columns are the unswapped "
             "runs of the two seeds.", "",
             "| base | parts from donor | donor | data seed | accuracy | base alone | "
             "donor alone |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['base']} | {r['part']} | {r['donor']} | {r['data_seed']} | "
                     f"{100 * r['accuracy']:.2f} | {100 * r['base_accuracy']:.2f} | "
                     f"{100 * r['donor_accuracy']:.2f} |")
    out = pathlib.Path(args.results)
    out.mkdir(parents=True, exist_ok=True)
    (out / "quickstart_init_swap.md").write_text("\n".join(lines) + "\n")
    (out / "quickstart_init_swap.json").write_text(json.dumps(rows, indent=2))
    print("\n".join(lines))


def main(argv=None) -> None:
    p = make_parser(__doc__, runs="spin_lm/quickstart_swap", results="spin_lm")
    p.add_argument("--base", type=int, default=2, help="the model seed trained")
    p.add_argument("--donor", type=int, default=0, help="the seed the swapped part comes from")
    p.add_argument("--data-seed", type=int, default=0)
    p.add_argument("--parts", default=",".join(PARTS), help=f"of {', '.join(PARTS)}")
    p.add_argument("--steps", type=int, help="optimizer steps (default: the quickstart's)")
    p.add_argument("--reference", default=str(ROOT / "runs" / "spin_lm" / "quickstart"),
                   help="the unswapped runs (spin_lm.py's quickstart suite)")
    dispatch(p.parse_args(argv), run=cmd_run, report=cmd_report)


if __name__ == "__main__":
    run_script(main)
