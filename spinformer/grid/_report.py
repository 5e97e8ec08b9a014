"""The report of a grid at equal steps (the zoo's): per task and family the metric with its
95 % t-interval over seeds, the gap to softmax paired by seed, and the costs measured in the
same runs; `zoo.md`, `zoo.json`, `gaps.png` and `cost.png`.

**Cells.** The task metric (mean ± the half-width of the 95 % t-interval over seeds), its gap
to softmax paired by seed (and for perplexity the paired ratio), and the costs measured in the
same runs: parameters, training throughput (steps per second after the first log, as a ratio to
softmax's on the same task; workers running side by side share the machine, so read it as
rough), the compiled training step's memory (arguments + outputs + XLA's temporaries, from
`memory_analysis()`), forward solver steps and backward products per layer (the diagnostics'
means over layers), failed solves and skipped steps. A family that cannot run a task gets a
cell that says why: the grid's `skip` reason, or the library's own error when it refuses to
build the model (for example, a non-causal attention in a language model). The first seed's
runs chose the learning rate on the validation split; the metric is read on the test split
where the task has one (a task without one reads validation: a small optimistic bias that
every family shares).
"""

from __future__ import annotations

import json
import math
import os
import pathlib
from typing import Optional

import numpy as np

from ._grid import (IMAGE_TASKS, NO_DATA, REFERENCE, Cell, Runs, _metric_of, base_config,
                    chosen_factor, plan_cells, seeds_of)
from ._stats import mean_ci


def collect(grid, runs: Runs, cells) -> dict:
    """Per cell: the finished results by seed (at the chosen learning rate), the failures,
    the chosen factor and the candidates' validation losses."""
    out = {}
    for (task, fam), cell in cells.items():
        entry = {"label": cell.label, "reason": cell.reason, "params": cell.params,
                 "match": cell.match_note, "results": {}, "failures": []}
        out[task, fam] = entry
        if cell.reason:
            continue
        for name in runs.names(task, fam):
            d = runs.root / task / fam / name
            f = runs.read(d, "failed.json")
            if f is not None and runs.read(d, "result.json") is None:
                entry["failures"].append({"run": name, "message": f.get("message"),
                                          "last_logged_step": f.get("last_logged_step")})
        factor, losses = chosen_factor(grid, runs, task, fam)
        entry["lr_factor"], entry["candidate_val_loss"] = factor, losses
        if factor is None or math.isnan(factor):
            continue
        for s in seeds_of(grid, task):
            r = runs.read(runs.dir(task, fam, factor, s), "result.json")
            if r is not None:
                entry["results"][s] = r
        mem = [r.get("step_memory_bytes") for n in runs.names(task, fam)
               for r in [runs.read(runs.root / task / fam / n, "result.json")]
               if r and r.get("step_memory_bytes")]
        entry["step_memory_bytes"] = mem[0] if mem else None
    return out


def summarise(grid, data: dict) -> dict:
    """Per cell: metric mean ± CI, the paired gap (and ratio) to softmax, and the costs."""
    out = {}
    for (task, fam), e in data.items():
        metric = grid["tasks"][task]["metric"]
        s = {"label": e["label"], "reason": e["reason"], "params": e["params"],
             "match": e["match"], "failures": e["failures"], "n": len(e["results"]),
             "lr_factor": e.get("lr_factor")}
        out[task, fam] = s
        if e["reason"] or not e["results"]:
            continue
        res = e["results"]
        vals = {sd: _metric_of(r, metric) for sd, r in res.items()}
        s["values"] = vals
        s["mean"], s["ci"] = mean_ci(list(vals.values()))
        ref = data.get((task, REFERENCE), {}).get("results", {})
        common = sorted(set(res) & set(ref))
        if fam != REFERENCE and common:
            gaps = [vals[k] - _metric_of(ref[k], metric) for k in common]
            s["gap"], s["gap_ci"] = mean_ci(gaps)
            s["gap_n"] = len(common)
            if metric != "accuracy":
                ratios = [vals[k] / _metric_of(ref[k], metric) for k in common]
                s["ratio"], s["ratio_ci"] = mean_ci(ratios)
            ref_tp = np.nanmean([r["steps_per_s"] for r in ref.values()])
            s["throughput_ratio"] = float(np.nanmean([r["steps_per_s"] for r in res.values()])
                                          / ref_tp) if ref_tp else math.nan
        elif fam == REFERENCE:
            s["throughput_ratio"] = 1.0
        s["steps_per_s"] = float(np.nanmean([r["steps_per_s"] for r in res.values()]))
        s["memory_mib"] = (e["step_memory_bytes"] / 2**20 if e.get("step_memory_bytes")
                           else None)
        s["forward_steps"] = _nanmean([r["val"].get("solver_steps") for r in res.values()])
        s["backward_products"] = _nanmean([r.get("backward_steps") for r in res.values()])
        s["failed_solves"] = _nanmean([r["val"].get("solver_failures") for r in res.values()])
        s["fallbacks"] = _nanmean([r.get("backward_fallbacks") for r in res.values()])
        s["skipped_steps"] = int(sum(r.get("bad_steps", 0) for r in res.values()))
        s["solver_effect"] = effect_summary(res.values())
        s["lr"] = next(iter(res.values()))["lr"]
        s["wall_s"] = float(np.mean([r["wall_time_s"] or 0 for r in res.values()]))
    for (task, fam), s in out.items():  # a variant against the family it names, by seed
        other = out.get((task, grid["families"][fam].get("against")), {})
        common = sorted(set(s.get("values", {})) & set(other.get("values", {})))
        if common:
            gap, ci = mean_ci([s["values"][k] - other["values"][k] for k in common])
            s["against"] = {"family": grid["families"][fam]["against"], "gap": gap,
                            "gap_ci": ci, "n": len(common)}
            pairs = [(_loss(data[task, fam]["results"][k]),
                      _loss(data[task, s["against"]["family"]]["results"][k])) for k in common]
            if all(a is not None and b is not None for a, b in pairs):
                s["against"]["loss_gap"], s["against"]["loss_gap_ci"] = mean_ci(
                    [a - b for a, b in pairs])
    return out


def _loss(result: dict) -> Optional[float]:
    """The loss on the split the task's metric is read on; None where not recorded (runs
    recovered from an old report)."""
    return (result.get("test") if result.get("split") == "test" else result["val"]).get("loss")


def effect_summary(results) -> Optional[dict]:
    """The mean `solver_effect` of runs (`result.json`s): the losses with the solves cut to
    their start, to one iteration, and converged, `no_effect` where every run's solves did
    nothing, and `n` the runs that measured it; None where none did (no solves, or runs
    recorded before it was measured)."""
    effects = [r["solver_effect"] for r in results if r.get("solver_effect")]
    if not effects:
        return None
    out = {k: float(np.mean([e[k] for e in effects]))
           for k in ("start", "one_step", "converged")}
    return {**out, "no_effect": all(e["no_effect"] for e in effects), "n": len(effects)}


def effect_text(effect: Optional[dict]) -> str:
    """`start / one step / converged` losses, with "**no effect**" where the solves do
    nothing; "—" without a measurement."""
    if not effect:
        return "—"
    text = f"{effect['start']:.3f} / {effect['one_step']:.3f} / {effect['converged']:.3f}"
    return text + (" **no effect**" if effect["no_effect"] else "")


def _nanmean(vals):
    v = [x for x in vals if x is not None]
    return float(np.mean(v)) if v else None


def better_gap(grid, task, s) -> Optional[tuple[float, float]]:
    """The paired gap to softmax in "positive is better" units: accuracy points, or for
    perplexity, loss and MSE percent lower than softmax's (from the paired ratio)."""
    metric = grid["tasks"][task]["metric"]
    if "gap" not in s:
        return None
    if metric == "accuracy":
        return 100 * s["gap"], 100 * s["gap_ci"]
    return 100 * (1 - s["ratio"]), 100 * s["ratio_ci"]


def _cell_text(grid, task, s, *, short=False) -> str:
    metric = grid["tasks"][task]["metric"]
    if s["reason"]:
        return "—" if short else f"— ({s['reason']})"
    if s["n"] == 0:
        fails = len(s["failures"])
        return f"failed ({fails} runs)" if fails and s.get("lr_factor") is not None \
            and math.isnan(s["lr_factor"]) else "pending"
    scale = 100 if metric == "accuracy" else 1
    d = 1 if metric == "accuracy" else 4 if metric == "mse" else 3
    text = f"{scale * s['mean']:.{d}f}"
    if s["n"] > 1:
        text += f" ± {scale * s['ci']:.{d}f}"
    g = better_gap(grid, task, s)
    if g is not None and short:
        star = "*" if s["gap_n"] > 1 and abs(g[0]) > g[1] else ""
        text += f" ({g[0]:+.1f}{star})"
    if s["n"] < len(seeds_of(grid, task)):  # a cell still filling up
        text += f" [{s['n']} of {len(seeds_of(grid, task))} seeds]"
    return text


def zoo_report(grid, runs: Runs, results) -> dict:
    """Write the report of the ledger's runs into `results`; returns the numbers per cell
    (`summarise`)."""
    results = pathlib.Path(results)
    cells = _from_ledger(grid, runs, plan_cells(grid, grid["_tasks"], grid["_families"]))
    stats = summarise(grid, collect(grid, runs, cells))
    results.mkdir(parents=True, exist_ok=True)
    tasks, fams = grid["_tasks"], grid["_families"]
    unit = {"accuracy": "accuracy %", "perplexity": "perplexity", "loss": "loss",
            "mse": "MSE per pixel"}
    # the description's first sentence is the title (the shipped grids' is a title)
    title, _, rest = grid.get("description", "").partition(". ")
    lines = [f"# {title or 'The attention zoo'}", "", rest, "",
             f"Grid `{_rel(grid['_path'])}`; seeds {grid['seeds']}; learning rate: the task's "
             f"times the best of {grid['lr_factors']} on seed {grid['seeds'][0]}'s validation "
             "loss; parameters matched to softmax's where the family's knob allows (see each "
             "task's table). Each cell: the metric, mean ± the half-width of its 95 % "
             "t-interval over seeds, and in brackets the paired gap to softmax in "
             "better-is-positive units (accuracy points; for perplexity and MSE, percent "
             "below softmax's), `*` where the interval excludes zero. `—`: the family does not "
             "run this task (the reason is in the task's table).", "",
             "| family | " + " | ".join(
                 f"{grid['tasks'][t].get('label', t)} ({unit[grid['tasks'][t]['metric']]}, "
                 f"{grid['tasks'][t].get('split', 'val')})" for t in tasks) + " |",
             "|---|" + "---|" * len(tasks)]
    for f in fams:
        lines.append(f"| {grid['families'][f].get('label', f)} | " + " | ".join(
            _cell_text(grid, t, stats[t, f], short=True) for t in tasks) + " |")
    for t in tasks:
        lines += _task_table(grid, t, fams, stats)
    lines += _against_table(grid, tasks, fams, stats)
    fails = [(t, f, x) for t in tasks for f in fams for x in stats[t, f]["failures"]]
    if fails:
        lines += ["", "## Failed runs", "", "| task | family | run | last step | error |",
                  "|---|---|---|---|---|"]
        lines += [f"| {t} | {f} | {x['run']} | {x['last_logged_step']} | "
                  f"{(x['message'] or '').replace('|', '/')} |" for t, f, x in fails]
    (results / "zoo.md").write_text("\n".join(lines) + "\n")
    payload = {f"{t}/{f}": stats[t, f] for t in tasks for f in fams}
    (results / "zoo.json").write_text(json.dumps(payload, indent=2, default=_jsonable))
    _figures(grid, stats, tasks, fams, results)
    print(f"grid: wrote {results / 'zoo.md'}, zoo.json, gaps.png, cost.png")
    return stats


def _from_ledger(grid, runs: Runs, cells) -> dict:
    """`cells`, with those of a task whose data is not on this machine (which cannot be
    built) taken from the ledger where it has their runs: the parameter count their runs
    recorded, and a note saying so; a family the grid skips there keeps its reason."""
    out = dict(cells)
    for (task, fam), c in cells.items():
        if not (c.reason and c.reason.startswith(NO_DATA)):
            continue
        skip = (grid["families"][fam].get("skip") or {}).get(task)
        counts = [r["num_params"] for n in runs.names(task, fam)
                  for r in [runs.read(runs.root / task / fam / n, "result.json")]
                  if r and r.get("num_params")]
        if skip or counts:
            out[task, fam] = Cell(task, fam, c.label, params=counts[0] if counts else None,
                                  match_note="" if skip else "(counted by its runs: the "
                                  "task's data is not on this machine)",
                                  reason=str(skip) if skip else None)
    return out


def _jsonable(x):
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return str(x)


def _rel(p) -> str:
    """`p` relative to the working directory where it is inside it (what a committed report
    names), else its file name."""
    p, here = pathlib.Path(p).resolve(), pathlib.Path.cwd().resolve()
    return str(p.relative_to(here)) if p.is_relative_to(here) else p.name


def _task_table(grid, task, fams, stats) -> list[str]:
    t = grid["tasks"][task]
    metric = t["metric"]
    ref = stats[task, REFERENCE]
    head = (f"| family | {metric} ({t.get('split', 'val')}) | gap to softmax | "
            + ("ratio to softmax | " if metric != "accuracy" else "")
            + "params | matched by | lr | steps/s (× softmax) | step memory MiB | "
              "fwd steps/layer | bwd products/layer | failed solves | fallbacks | "
              "skipped steps | loss, solves cut to start / 1 iteration / converged | seeds |")
    cfg = base_config(grid, task, REFERENCE)
    lines = ["", f"## {t.get('label', task)}", "",
             f"Base `{t['config']}` with {t.get('set') or {}}: "
             + (f"{t['flops']:.3g} training FLOPs per run (each family's steps priced to "
                "spend them)" if t.get("flops") else f"{cfg.train.steps} steps")
             + f" of batch {cfg.data.batch_size}, "
             + (f"{cfg.model.embed} image tokens" if cfg.data.task in IMAGE_TASKS
                else f"T = {cfg.data.seq_len}") + f", width {cfg.model.dim}, "
             f"depth {cfg.model.depth}, {cfg.model.num_heads} heads. Softmax: "
             f"{ref['params'] or 0:,} parameters.", "", head,
             "|---" * (head.count("|") - 1) + "|"]
    scale, d = (100, 2) if metric == "accuracy" else (1, 4)
    for f in fams:
        s = stats[task, f]
        if s["reason"] or s["n"] == 0:
            text = "— (not run; why: below)" if s["reason"] else _cell_text(grid, task, s)
            lines.append(f"| {s['label']} | {text} |" + " |" * (head.count("|") - 3))
            continue

        def num(x, fmt):
            return "—" if x is None or (isinstance(x, float) and not math.isfinite(x)) \
                else format(x, fmt)
        gap = ("—" if f == REFERENCE or "gap" not in s else
               f"{scale * s['gap']:+.{d}f} ± {scale * s['gap_ci']:.{d}f}"
               if s["gap_n"] > 1 else f"{scale * s['gap']:+.{d}f} (1 seed)")
        ratio = ""
        if metric != "accuracy":
            ratio = ("—" if "ratio" not in s else
                     f"{s['ratio']:.3f} (1 seed)" if s["gap_n"] < 2 else
                     f"{s['ratio']:.3f} [{s['ratio'] - s['ratio_ci']:.3f}, "
                     f"{s['ratio'] + s['ratio_ci']:.3f}]") + " | "
        lines.append(
            f"| {s['label']} | {_cell_text(grid, task, s)} | {gap} | {ratio}"
            f"{s['params']:,} | {s['match'] or '—'} | {s['lr']:.2g} | "
            f"{num(s['steps_per_s'], '.2f')} ({num(s.get('throughput_ratio'), '.2f')}×) | "
            f"{num(s['memory_mib'], '.1f')} | {num(s['forward_steps'], '.1f')} | "
            f"{num(s['backward_products'], '.1f')} | {num(s['failed_solves'], '.3f')} | "
            f"{num(s['fallbacks'], '.3f')} | {s['skipped_steps']} | "
            f"{effect_text(s['solver_effect'])} | {s['n']} |")
    reasons = [(stats[task, f]["label"], stats[task, f]["reason"]) for f in fams
               if stats[task, f]["reason"]]
    if reasons:
        lines += [""] + [f"- {lab}: {why}" for lab, why in reasons]
    return lines


def _against_table(grid, tasks, fams, stats) -> list[str]:
    """The section pairing each family whose grid entry names another (`against`) with it,
    by seed: the differences of the task's metric and of the loss on its split; no section
    where no family names another."""
    rows = [(t, f, stats[t, f]["against"]) for t in tasks for f in fams
            if "against" in stats[t, f]]
    if not rows:
        return []
    lines = ["", "## Against another variant", "",
             "Each family whose grid entry names another (`against`), paired by seed with it: "
             "the difference of the task's metric (accuracy in points; negative: lower than "
             "the other) and of the loss on the same split, mean ± the half-width of its 95 % "
             "t-interval, `*` where the interval excludes zero.", "",
             "| task | family | against | Δ metric | Δ loss | seeds |",
             "|---|---|---|---|---|---|"]

    def pm(mean, ci, n, scale, d):
        star = "*" if n > 1 and abs(mean) > ci else ""
        return (f"{scale * mean:+.{d}f} ± {scale * ci:.{d}f}{star}" if n > 1
                else f"{scale * mean:+.{d}f} (1 seed)")

    for t, f, a in rows:
        metric = grid["tasks"][t]["metric"]
        scale, d = (100, 1) if metric == "accuracy" else (1, 4 if metric == "mse" else 3)
        loss = (pm(a["loss_gap"], a["loss_gap_ci"], a["n"], 1, 4) if "loss_gap" in a
                else "—")
        lines.append(f"| {grid['tasks'][t].get('label', t)} | {stats[t, f]['label']} | "
                     f"{stats[t, a['family']]['label']} | "
                     f"{pm(a['gap'], a['gap_ci'], a['n'], scale, d)} ({metric}) | {loss} | "
                     f"{a['n']} |")
    return lines


def _figures(grid, stats, tasks, fams, results: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use(os.environ.get("MPLBACKEND", "Agg"))
    import matplotlib.pyplot as plt

    # the heat map of paired gaps (better-is-positive units), grey where a cell is empty
    G = np.full((len(fams), len(tasks)), np.nan)
    fig, ax = plt.subplots(figsize=(max(8.0, 1.9 * len(tasks) + 5), 0.5 * len(fams) + 2.0))
    for i, f in enumerate(fams):
        for j, t in enumerate(tasks):
            s = stats[t, f]
            g = better_gap(grid, t, s)
            if g is not None:
                G[i, j] = g[0]
    lim = max(1.0, float(np.nanmax(np.abs(G)))) if np.isfinite(G).any() else 1.0
    ax.imshow(np.where(np.isnan(G), 1.0, np.nan), cmap="Greys", vmin=0, vmax=6,
              aspect="auto")  # light grey: empty, pending or reference
    im = ax.imshow(G, cmap="RdBu", vmin=-lim, vmax=lim, aspect="auto")
    for i, f in enumerate(fams):
        for j, t in enumerate(tasks):
            s = stats[t, f]
            g = better_gap(grid, t, s)
            if f == REFERENCE and s["n"]:
                txt = "reference"
            elif s["reason"]:
                txt = "n/a"
            elif g is None:
                txt = "pending" if not s["n"] else "—"
            else:
                sig = s["gap_n"] > 1 and abs(g[0]) > g[1]
                txt = f"{g[0]:+.1f}" + (f"\n±{g[1]:.1f}" if s["gap_n"] > 1 else "") + \
                    ("*" if sig else "")
                if s["gap_n"] < len(seeds_of(grid, t)):
                    txt += f"\n({s['gap_n']} of {len(seeds_of(grid, t))} seeds)"
            ax.text(j, i, txt, ha="center", va="center", fontsize=7)
    ax.set_xticks(range(len(tasks)), [grid["tasks"][t].get("label", t) for t in tasks],
                  rotation=20, ha="right", fontsize=8)
    ax.set_yticks(range(len(fams)), [grid["families"][f].get("label", f) for f in fams],
                  fontsize=8)
    fig.colorbar(im, ax=ax, label="accuracy points; % lower perplexity or MSE")
    ax.set_title("Paired gap to softmax, better is positive\n(mean ± 95% t-interval over "
                 "seeds; * the interval excludes 0)", fontsize=9)
    fig.tight_layout()
    fig.savefig(results / "gaps.png", dpi=130)
    plt.close(fig)

    # quality against cost, one panel per task
    fig, axes = plt.subplots(1, len(tasks), figsize=(3.6 * len(tasks), 3.4), squeeze=False)
    for ax, t in zip(axes[0], tasks):
        metric = grid["tasks"][t]["metric"]
        scale = 100 if metric == "accuracy" else 1
        for f in fams:
            s = stats[t, f]
            if s["reason"] or not s["n"] or not s.get("throughput_ratio"):
                continue
            x = 1 / s["throughput_ratio"]
            ax.errorbar([x], [scale * s["mean"]],
                        yerr=[[scale * (s["ci"] if math.isfinite(s["ci"]) else 0)]],
                        fmt="o", ms=4, capsize=2)
            ax.annotate(f, (x, scale * s["mean"]), fontsize=6, xytext=(3, 3),
                        textcoords="offset points")
        ax.set_xscale("log")
        ax.set_xlabel("time per step (× softmax)")
        ax.set_ylabel(f"{metric}{' (%)' if metric == 'accuracy' else ''}, "
                      f"{grid['tasks'][t].get('split', 'val')}")
        ax.set_title(grid["tasks"][t].get("label", t), fontsize=9)
    fig.tight_layout()
    fig.savefig(results / "cost.png", dpi=130)
    plt.close(fig)


