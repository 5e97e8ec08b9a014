"""Why the spin transformer learned worse than softmax, and what fixes it: ablations of spin
attention on the quickstart bracket task and on character-level Shakespeare, over seeds.

    python experiments/spin_lm.py run --suite quickstart             # every unfinished run
    python experiments/spin_lm.py run --suite quickstart --variants softmax,spin --seeds 0,1,2
    python experiments/spin_lm.py report --suite quickstart          # table + curves
    python experiments/spin_lm.py run --variants softmax,spin --seeds 0-4 --data-seeds 0-4
    python experiments/spin_lm.py seeds --variants softmax,spin      # spread over seeds
    python experiments/spin_lm.py run --suite shakespeare --data .data/shakespeare.txt

Each variant is a set of config overrides on the suite's base config (`configs/spin_lm/`);
`spin` is the base config as shipped (the library defaults), `softmax` the same model with
softmax attention, and every other variant changes one or two options of `spin` (or of the
older defaults, `old`: β = 1, fields normalised to norm R, no value map).

A run's seed sets both the model's initialisation (`train.seed`) and the data stream
(`data.seed`) unless `--data-seeds` is given: then every model seed is run with every data
seed. Runs go to `--runs/<suite>/<variant>_s<seed>` (data seed = model seed) or
`<variant>_s<seed>_d<data seed>`; a run with a `summary.json` is skipped and a run killed
midway resumes from its checkpoint, so the sweep can be stopped and restarted.
`report` writes `<suite>.md`, `<suite>.json` and `<suite>_curves.png` into `--results`
(default `experiments/results/spin_lm`): the final metric per variant (mean ± std over seeds,
parameters, wall time) and paired gaps to `softmax` and to `spin` on the seeds both have, with
95 % t-intervals (the runs with a data seed of their own are left out). `seeds` writes
`<suite>_seeds.{md,json,png}`: how the final metric of each variant spreads when only the
model seed varies, when only the data seed varies, and over the grid of both (mean, 95 %
t-interval, worst), the paired gaps to `softmax` and `spin`, the grid itself, and every
run's curve.
"""

from __future__ import annotations

import json
import pathlib
import re
import sys

import numpy as np

import spinformer as sf

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _cli import dispatch, make_parser, run_script  # noqa: E402
from spinformer.grid import mean_ci  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent
S2 = {"model.attention.mode": "steps", "model.attention.update": "mean_field", "model.attention.num_steps": 2}

# the previous quickstart (β = 1, learning rate 3e-3), and its learning rate alone
OLD = {"model.attention.beta": 1.0, "train.lr": 3e-3}
LR3 = {"train.lr": 3e-3}
S2 = {"model.attention.mode": "steps", "model.attention.update": "mean_field", "model.attention.num_steps": 2}

SUITES = {
    "quickstart": {
        "config": ROOT / "configs" / "quickstart.yaml",
        "metric": "accuracy", "higher": True, "steps": 1500,
        "variants": {
            # the defaults and one change from them
            "softmax": {"model.attention": "softmax"},
            "spin": {},
            "beta1": {"model.attention.beta": 1.0},
            "beta4": {"model.attention.beta": 4.0},
            "learn_beta": {"model.attention.learn_beta": True},
            "value": {"model.attention.value_proj": True},
            "mean_field": {"model.attention.update": "mean_field"},
            "response": {"model.attention.output": "response"},
            "steps2": S2,
            "b2_lr6": {"train.lr": 6e-3},
            # the previous learning rate (3e-3) and the probes that found the two levers
            "softmax_lr3": {"model.attention": "softmax", **LR3},
            "softmax_lr6": {"model.attention": "softmax", "train.lr": 6e-3},
            "old": OLD,
            "old_beta2": LR3,
            "b3": {**OLD, "model.attention.beta": 3.0},
            "old_beta4": {**OLD, "model.attention.beta": 4.0},
            "old_value": {**OLD, "model.attention.value_proj": True},
            "old_raw_fields": {**OLD, "model.attention.normalize_fields": False},
            "old_value_raw": {**OLD, "model.attention.value_proj": True,
                              "model.attention.normalize_fields": False},
            "old_learn_beta": {**OLD, "model.attention.learn_beta": True},
            "old_value_learn_beta": {**OLD, "model.attention.value_proj": True,
                                     "model.attention.learn_beta": True},
            "b2_value": {**LR3, "model.attention.value_proj": True},
            "b2_learn_beta": {**LR3, "model.attention.learn_beta": True},
            "b2_steps1": {**LR3, **S2, "model.attention.num_steps": 1},
            "b2_steps2": {**LR3, **S2},
            "b2_steps3": {**LR3, **S2, "model.attention.num_steps": 3},
            "b2_tap_steps2": {**LR3, "model.attention.mode": "steps", "model.attention.num_steps": 2},
            "b2_steps2_clr": {**LR3, **S2, "train.coupling_lr": 3e-3},
            "b4_steps2": {**LR3, **S2, "model.attention.beta": 4.0},
            "c2_steps2": {**OLD, **S2, "model.attention.coupling_scale": 2.0},
            "b2c2_steps2": {**LR3, **S2, "model.attention.coupling_scale": 2.0},
            "b2_steps2_lr6": {**S2, "train.lr": 6e-3},
            "b1_steps2_lr6": {**S2, "model.attention.beta": 1.0, "train.lr": 6e-3},
            # probes of the model seeds that plateau (quickstart_seeds.md): solves to tighter
            # tolerances, twice the steps, the couplings' maps at the main learning rate
            "tight": {"model.attention.solver.tol": 1e-5, "model.attention.solver.max_steps": 100,
                      "model.attention.adjoint.rtol": 1e-6},
            "steps3000": {"train.steps": 3000},
            "clr": {"train.coupling_lr": 1e-2},
        },
    },
    "shakespeare": {
        "config": ROOT / "configs" / "spin_lm" / "shakespeare_spin.yaml",
        "metric": "loss", "higher": False, "steps": 3000,
        "variants": {
            "softmax": {"model.attention": "softmax"},
            "spin": {},
            "no_value": {"model.attention.value_proj": False},
            "magnetization": {"model.attention.output": "magnetization",
                              "model.attention.value_proj": False},
        },
    },
}


def base_changes(args, suite: dict, seed: int, data_seed: int) -> dict:
    steps = args.steps or suite["steps"]
    changes = {"train.steps": steps, "train.seed": seed, "data.seed": data_seed,
               "train.patience": 0, "train.checkpoint_every": max(steps // 3, 1),
               "train.progress": False}
    if args.data:
        changes["data.path"] = args.data
    return changes


def _seeds(text: str) -> list[int]:
    """`0,1,2` or `0-4` (or both: `0-2,7`)."""
    out = []
    for part in (t.strip() for t in text.split(",") if t.strip()):
        lo, _, hi = part.partition("-")
        out += list(range(int(lo), int(hi or lo) + 1))
    return out


def run_name(name: str, seed: int, data_seed: int) -> str:
    """`<variant>_s<seed>`, or `<variant>_s<seed>_d<data seed>` when the two seeds differ."""
    return f"{name}_s{seed}" + ("" if data_seed == seed else f"_d{data_seed}")


def _read_runs(runs: pathlib.Path) -> dict[str, dict[tuple[int, int], dict]]:
    """`{variant: {(seed, data seed): summary}}` of the finished runs under `runs`."""
    rows: dict[str, dict[tuple[int, int], dict]] = {}
    for p in sorted(runs.glob("*_s*/summary.json")):
        m = re.fullmatch(r"(.+)_s(\d+)(?:_d(\d+))?", p.parent.name)
        if m:
            seed = int(m[2])
            data_seed = seed if m[3] is None else int(m[3])
            rows.setdefault(m[1], {})[seed, data_seed] = json.loads(p.read_text())
    return rows


def cmd_run(args) -> None:
    suite = SUITES[args.suite]
    runs = pathlib.Path(args.runs) / args.suite
    cfg0 = sf.config.load_config(suite["config"])
    names = args.variants.split(",") if args.variants else list(suite["variants"])
    unknown = [n for n in names if n not in suite["variants"]]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; the suite {args.suite!r} has "
                         f"{list(suite['variants'])}.")
    pairs = [(s, d) for s in _seeds(args.seeds)
             for d in (_seeds(args.data_seeds) if args.data_seeds else [s])]
    for seed, data_seed in pairs:
        for name in names:
            out = runs / run_name(name, seed, data_seed)
            if (out / "summary.json").exists():
                continue
            cfg = cfg0.replace({**base_changes(args, suite, seed, data_seed),
                                **suite["variants"][name]})
            summary = sf.train.run(cfg, out, resume=out.exists())
            m = summary["metrics"]
            print(f"{args.suite}/{out.name}: {suite['metric']} {m[suite['metric']]:.4f}, "
                  f"{summary['wall_time_s']:.0f} s", flush=True)


def _gap(rows, name, ref, metric):
    common = sorted(set(rows[name]) & set(rows.get(ref, {})))
    gap = [rows[name][s]["metrics"][metric] - rows[ref][s]["metrics"][metric] for s in common]
    return mean_ci(gap), len(common)


def _curves(runs: pathlib.Path, name: str, seeds, metric: str):
    """The validation curves `(steps, values)` of `name`'s runs at `seeds` (model seeds, or
    `(seed, data seed)` pairs)."""
    out = []
    for s in seeds:
        steps, vals = [], []
        d = run_name(name, *s) if isinstance(s, tuple) else f"{name}_s{s}"
        for line in (runs / d / "metrics.jsonl").read_text().splitlines():
            r = json.loads(line)
            if r.get("split") == "val" and metric in r:
                steps.append(r["step"])
                vals.append(r[metric])
        out.append((steps, vals))
    return out


def cmd_report(args) -> None:
    suite = SUITES[args.suite]
    metric, higher = suite["metric"], suite["higher"]
    runs = pathlib.Path(args.runs) / args.suite
    rows = {name: {s: x for (s, d), x in r.items() if s == d}
            for name, r in _read_runs(runs).items()}
    rows = {name: r for name, r in rows.items() if r}
    if not rows:
        raise SystemExit(f"no finished runs under {runs}; run `... run` first.")
    order = [v for v in suite["variants"] if v in rows]
    scale, unit = (100.0, " (%)") if metric == "accuracy" else (1.0, "")
    extra = "perplexity" if metric == "loss" else None
    lines = [f"# Spin-attention ablations: {args.suite}", "",
             f"Validation {metric}{unit} at the end of training, mean ± std over seeds"
             + (" (and validation perplexity)" if extra else "")
             + "; paired gaps (variant − reference) on the seeds both have, mean ± the "
             "half-width of the 95 % t-interval. Base config: "
             f"`{suite['config'].relative_to(ROOT)}`.", "",
             f"| variant | changes | seeds | {metric}{unit} | "
             + ("perplexity | " if extra else "")
             + "gap to softmax | gap to spin | "
             + ("perplexity / softmax's | " if extra else "") + "params | s/run |",
             "|---|---|---|---|" + ("---|---|" if extra else "") + "---|---|---|---|"]
    digits = 2 if metric == "accuracy" else 4
    result = {}
    for name in order:
        r = rows[name]
        v = np.array([x["metrics"][metric] for x in r.values()]) * scale
        wall = np.mean([x["wall_time_s"] for x in r.values()])
        params = next(iter(r.values())).get("num_params", 0)
        gaps = {}
        cells = []
        for ref in ("softmax", "spin"):
            (g, h), k = _gap(rows, name, ref, metric)
            gaps[ref] = [g * scale, h * scale, k]
            cells.append("—" if name == ref or k == 0 else
                         f"{g * scale:+.{digits}f} ± {h * scale:.{digits}f}" if k > 1 else
                         f"{g * scale:+.{digits}f} (1 seed)")
        changes = ", ".join(f"{k.split('.')[-1]}={val}" for k, val in
                            suite["variants"][name].items()) or "(base config)"
        ppl = ratio = ""
        if extra:
            p = np.array([x["metrics"][extra] for x in r.values()])
            ppl = f"{p.mean():.3f} ± {p.std():.3f} | "
            # the loss gap is the log of the perplexity ratio: exp of the gap and its interval
            g, h, k = gaps["softmax"]
            ratio = ("— | " if name == "softmax" or k == 0 else
                     f"{np.exp(g):.3f} [{np.exp(g - h):.3f}, {np.exp(g + h):.3f}] | " if k > 1
                     else f"{np.exp(g):.3f} (1 seed) | ")
        lines.append(f"| {name} | {changes} | {len(v)} | {v.mean():.{digits}f} ± "
                     f"{v.std():.{digits}f} | {ppl}{cells[0]} | {cells[1]} | {ratio}{params:,} | "
                     f"{wall:.0f} |")
        result[name] = {"changes": suite["variants"][name], "seeds": sorted(r),
                        metric: (v / scale).tolist(), "gap_to_softmax": gaps["softmax"],
                        "gap_to_spin": gaps["spin"], "num_params": params,
                        "wall_time_s": float(wall)}
        if extra:
            result[name][extra] = [x["metrics"][extra] for x in r.values()]
    better = "higher" if higher else "lower"
    lines += ["", f"A positive gap means the variant's {metric} is higher ({better} is better). "
              "`s/run` is the wall time of a run on a shared 2-core machine, often with "
              "several runs at once: not a speed measurement (see "
              "`experiments/bench/spin_attention.py`)."]
    out = pathlib.Path(args.results)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.suite}.md").write_text("\n".join(lines) + "\n")
    (out / f"{args.suite}.json").write_text(json.dumps(result, indent=2))
    print("\n".join(lines))
    _plot(runs, rows, order, metric, out / f"{args.suite}_curves.png", scale)


def _plot(runs, rows, order, metric, path, scale) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    show = [n for n in order if n in ("softmax", "spin", "old")] + \
        [n for n in order if n not in ("softmax", "spin", "old")][:5]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name in show:
        curves = _curves(runs, name, sorted(rows[name]), metric)
        n = min(len(c[0]) for c in curves)
        if n == 0:
            continue
        steps = curves[0][0][:n]
        vals = np.array([c[1][:n] for c in curves]) * scale
        lw = 2.2 if name in ("softmax", "spin") else 1.0
        line, = ax.plot(steps, vals.mean(0), lw=lw, label=f"{name} ({len(curves)} seeds)")
        if len(curves) > 1:
            ax.fill_between(steps, vals.min(0), vals.max(0), color=line.get_color(), alpha=0.15)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(f"validation {metric}" + (" (%)" if scale != 1 else ""))
    ax.set_title("mean over seeds; band: min–max")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _spread(values, scale: float) -> dict:
    """n, mean, half-width of the 95 % t-interval, std, worst and best of `values` (scaled)."""
    v = np.asarray(values, float) * scale
    m, h = mean_ci(v)
    return {"n": len(v), "mean": m, "ci": h, "std": float(v.std(ddof=1)) if len(v) > 1 else 0.0,
            "min": float(v.min()), "max": float(v.max())}


def _span(seeds) -> str:
    """`0–4` for a run of consecutive seeds, else `0,2,4`."""
    seeds = sorted(seeds)
    if len(seeds) > 2 and seeds == list(range(seeds[0], seeds[-1] + 1)):
        return f"{seeds[0]}–{seeds[-1]}"
    return ",".join(map(str, seeds))


def _cell(st, f: str) -> str:
    """`mean [interval] (n)` of a `_spread`, or — for none."""
    if st is None:
        return "—"
    if st["n"] < 2:
        return f"{st['mean']:+{f}} (1 run)"
    return (f"{st['mean']:+{f}} [{st['mean'] - st['ci']:+{f}}, {st['mean'] + st['ci']:+{f}}] "
            f"({st['n']})")


def cmd_seeds(args) -> None:
    suite = SUITES[args.suite]
    metric, higher = suite["metric"], suite["higher"]
    runs = pathlib.Path(args.runs) / args.suite
    rows = _read_runs(runs)
    names = [n for n in (args.variants.split(",") if args.variants else ("softmax", "spin"))
             if n in rows]
    if not names:
        raise SystemExit(f"no finished runs of those variants under {runs}.")
    cfg0 = sf.config.load_config(suite["config"])
    s0, d0 = cfg0.train.seed, cfg0.data.seed
    scale, unit = (100.0, " (%)") if metric == "accuracy" else (1.0, "")
    f = f".{2 if metric == 'accuracy' else 4}f"
    refs = [r for r in ("softmax", "spin") if r in rows]
    lines = [f"# Seed spread: {args.suite}", "",
             f"Validation {metric}{unit} at the end of training (base config "
             f"`{suite['config'].relative_to(ROOT)}`): the model seed is `train.seed` "
             "(initialisation and dropout), the data seed `data.seed` (the training and "
             "validation batches). Mean, 95 % t-interval of the mean, std, extremes; gaps "
             "(variant − reference) are paired on the same (model, data) seeds: mean "
             "[95 % t-interval] (pairs).", "",
             "| variant | seeds | runs | mean | 95 % interval | std | min | max | "
             + " | ".join(f"gap to {r}" for r in refs) + " |",
             "|---|---|---|---|---|---|---|---|" + "---|" * len(refs)]
    result = {}
    for name in names:
        r = rows[name]
        # one seed varied with the other at the config's, and the grid: the data seeds run
        # with model seed s0 by the model seeds run with all of them
        ms = sorted(s for s, d in r if d == d0)
        ds = sorted(d for s, d in r if s == s0)
        full = [s for s in ms if all((s, d) in r for d in ds)]
        groups = {}
        for sel_s, sel_d in ((ms, [d0]), (full, [d0]), ([s0], ds), (full, ds)):
            pairs = sorted(p for p in r if p[0] in sel_s and p[1] in sel_d)
            if pairs and pairs not in groups.values():
                groups[f"model {_span(sel_s)} × data {_span(sel_d)}"] = pairs
        result[name] = {key: {f"{s},{d}": get(x) for (s, d), x in sorted(r.items())}
                        for key, get in (("runs", lambda x: x["metrics"][metric]),
                                         ("bad_steps", lambda x: x.get("bad_steps", 0)))}
        for label, pairs in groups.items():
            st = _spread([r[p]["metrics"][metric] for p in pairs], scale)
            cells = []
            for ref in refs:
                common = [p for p in pairs if p in rows[ref]]
                gap = None if name == ref or not common else _spread(
                    [r[p]["metrics"][metric] - rows[ref][p]["metrics"][metric]
                     for p in common], scale)
                st[f"gap_to_{ref}"] = gap
                cells.append(_cell(gap, f))
            result[name][label] = st
            ci = (f"[{st['mean'] - st['ci']:{f}}, {st['mean'] + st['ci']:{f}}]"
                  if st["n"] > 1 else "—")
            lines.append(f"| {name} | {label} | {st['n']} | {st['mean']:{f}} | {ci} | "
                         f"{st['std']:{f}} | {st['min']:{f}} | {st['max']:{f}} | "
                         + " | ".join(cells) + " |")
    for name in names:  # the grid, model seeds by data seeds
        r = rows[name]
        ss, ds = sorted({s for s, _ in r}), sorted({d for _, d in r})
        lines += ["", f"{name}, {metric}{unit} by model seed (rows) and data seed (columns):",
                  "", "| model \\ data | " + " | ".join(map(str, ds)) + " |",
                  "|---|" + "---|" * len(ds)]
        for s in ss:
            lines.append(f"| {s} | " + " | ".join(
                f"{r[s, d]['metrics'][metric] * scale:{f}}" if (s, d) in r else ""
                for d in ds) + " |")
    lines += ["", f"{'Higher' if higher else 'Lower'} is better: the worst run is the column "
              f"`{'min' if higher else 'max'}`."]
    out = pathlib.Path(args.results)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.suite}_seeds.md").write_text("\n".join(lines) + "\n")
    (out / f"{args.suite}_seeds.json").write_text(json.dumps(result, indent=2))
    print("\n".join(lines))
    drawn = [n for n in (args.plot.split(",") if args.plot else names) if n in rows]
    _plot_seeds(runs, rows, drawn, metric, scale, out / f"{args.suite}_seeds.png")


def _plot_seeds(runs, rows, names, metric, scale, path) -> None:
    """Left: every run's final metric by variant; right: every run's validation curve."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(10, 4), width_ratios=(1, 2))
    rng = np.random.default_rng(0)
    err = metric == "accuracy"  # accuracies are shown as errors, on a log scale
    for i, name in enumerate(names):
        pairs = sorted(rows[name])
        v = np.array([rows[name][p]["metrics"][metric] for p in pairs]) * scale
        v = 100.0 - v if err else v
        ax0.scatter(i + rng.uniform(-0.15, 0.15, len(v)), v, s=14, alpha=0.7)
        for (steps, vals), p in zip(_curves(runs, name, pairs, metric), pairs):
            y = np.asarray(vals) * scale
            ax1.plot(steps, 100.0 - y if err else y, lw=0.8, alpha=0.6, color=f"C{i}",
                     label=f"{name} ({len(pairs)} run{'s' * (len(pairs) > 1)})"
                     if p == pairs[0] else None)
    ax0.set_xticks(range(len(names)), names)
    label = f"validation {'error' if err else metric}" + (" (%)" if scale != 1 else "")
    for ax in (ax0, ax1):
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        if err:
            ax.set_yscale("log")
    ax0.set_title("end of training, every run")
    ax1.set_xlabel("optimizer step")
    ax1.set_title("every run's validation curve")
    ax1.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> None:
    p = make_parser(__doc__, runs="spin_lm", results="spin_lm",
                    commands=("run", "report", "seeds"))
    p.add_argument("--suite", choices=tuple(SUITES), default="quickstart")
    p.add_argument("--variants", help="comma-separated variant names (default: all; for "
                   "seeds: softmax,spin)")
    p.add_argument("--seeds", default="0,1,2", help="model seeds: 0,1,2 or 0-4")
    p.add_argument("--data-seeds", help="data seeds, each run with every model seed "
                   "(default: the data seed is the model seed)")
    p.add_argument("--plot", help="seeds: the variants drawn (default: those reported)")
    p.add_argument("--steps", type=int, help="optimizer steps (default: the suite's)")
    p.add_argument("--data", help="the text file for the shakespeare suite (default: the "
                   "fetched Shakespeare)")
    dispatch(p.parse_args(argv), run=cmd_run, report=cmd_report, seeds=cmd_seeds)


if __name__ == "__main__":
    run_script(main)
