"""Reports over run directories (finished, still running, or stopped): a Markdown table and
comparison figures."""

from __future__ import annotations

import json
import pathlib
from typing import Sequence

import yaml

from ._figures import layers_of, plot_runs
from ._loop import read_metrics, skipped_steps_note
from ._rundir import _diff


def _solver_steps(metrics: dict) -> str:
    """`12.3 (10.1 / 14.5)`: mean forward solver steps, overall and per layer."""
    if "solver_steps" not in metrics:
        return "-"
    per_layer = " / ".join(f"{metrics[f'solver_steps/{i}']:.1f}" for i in layers_of([metrics]))
    return f"{metrics['solver_steps']:.1f}" + (f" ({per_layer})" if per_layer else "")


def attention_labels(configs: Sequence[dict], most: int = 3) -> list[str]:
    """Each run's attention for a table: its name, and the settings in which it differs
    from the other runs of the same attention (at most `most`, then `…`), e.g. `spin
    (adjoint.name: onestep)`. `configs` are the runs' config dicts."""
    atts = [(c.get("model") or {}).get("attention", "?") for c in configs]
    atts = [a if isinstance(a, dict) else {"name": a} for a in atts]

    def value(a, key):  # the setting at a dotted key, or `missing`
        for part in key.split("."):
            a = a.get(part, missing) if isinstance(a, dict) else missing
        return a

    missing, out = object(), []
    for a in atts:
        keys = sorted({k for b in atts if b.get("name") == a.get("name") for k in _diff(a, b)})
        shown = [f"{k}: {v}" for k in keys if (v := value(a, k)) is not missing]
        extra = ", ".join(shown[:most]) + (", …" if len(shown) > most else "")
        out.append(f"{a.get('name', '?')} ({extra})" if extra else str(a.get("name", "?")))
    return out


def _summary(d: pathlib.Path) -> dict:
    """`summary.json` of a run directory, or for a run still going or stopped before its end
    a stand-in from `metrics.jsonl` (`"unfinished": True`, the newest validation record as
    its metrics, else the newest training record); `FileNotFoundError` for neither."""
    s_path = d / "summary.json"
    if s_path.exists():
        return json.loads(s_path.read_text())
    records = read_metrics(d) if (d / "metrics.jsonl").exists() else []
    if not records:
        raise FileNotFoundError(
            f"{d}: neither summary.json nor metrics records: not a run directory, or a run "
            f"that has not logged a step yet; train it with `spinformer run CONFIG --out {d}`."
        )
    val = [r for r in records if r.get("split") == "val"]
    last = (val or records)[-1]
    metrics = {k: v for k, v in last.items() if k not in ("step", "split", "time_s")}
    return {"unfinished": True, "steps": max(r.get("step", 0) for r in records),
            "metrics": metrics, "wall_time_s": last.get("time_s"),
            "bad_steps": max((r.get("bad_steps", 0) for r in records), default=0)}


def report(run_dirs: Sequence, out_dir=None) -> str:
    """A Markdown table of the runs' final metrics, and comparison figures in `out_dir`
    (default: the run directory if there is one, else `./report`): `report_loss.png`,
    `report_accuracy.png`, and, one panel per run and one line per layer,
    `report_solver_steps.png` (forward solver steps over training) when a run solved fixed
    points, `report_local_loss.png` when a run trained with local losses and
    `report_entropy_production.png` when a run's model reports entropy production. A run
    without `summary.json` (still training, or killed) is reported from its `metrics.jsonl`,
    marked unfinished, so a run can be watched while it trains.

    **Returns:** the table as a string (also written to `out_dir/report.md`).
    """
    dirs = [pathlib.Path(d) for d in run_dirs]
    rows, runs, configs = [], {}, []
    unfinished, baselines = [], []
    for d in dirs:
        s = _summary(d)
        baselines.append(s.get("baselines"))
        if s.get("unfinished"):
            unfinished.append(d.name)
        cfg = yaml.safe_load((d / "config.yaml").read_text()) if (d / "config.yaml").exists() else {}
        m = s.get("metrics", {})
        configs.append(cfg)
        rows.append((
            d.name + (" (unfinished)" if s.get("unfinished") else ""), None, s.get("steps"),
            m.get("loss"), m.get("accuracy"), _solver_steps(m), s.get("wall_time_s"),
            s.get("bad_steps", 0),
        ))
        runs[d.name] = read_metrics(d)
    rows = [(r[0], label, *r[2:]) for r, label in zip(rows, attention_labels(configs))]
    head = ("| run | attention | steps | skipped steps | val loss | val accuracy | solver steps "
            "(per layer) | wall time (s) |")
    sep = "|---|---|---|---|---|---|---|---|"

    def fmt(v, p=4):
        if v is None:
            return "-"
        return f"{v:.{p}f}" if isinstance(v, float) else str(v)

    lines = [head, sep] + [
        f"| {r[0]} | {r[1]} | {r[2]} | {r[7]} | {fmt(r[3])} | {fmt(r[4])} | {r[5]} | "
        f"{fmt(r[6], 1)} |"
        for r in rows
    ]
    lines += [f"\n{r[0]}: {skipped_steps_note({'bad_steps': r[7], 'steps': r[2]})}"
              for r in rows if r[7]]
    if unfinished:
        lines.append(f"\nUnfinished (running, or stopped before train.steps): "
                     f"{', '.join(unfinished)}; their row is the newest validation record of "
                     "metrics.jsonl (the newest training record where none is logged yet).")
    table = "\n".join(lines)
    target = pathlib.Path(out_dir) if out_dir else (dirs[0] if len(dirs) == 1 else pathlib.Path("report"))
    shared = baselines[0] if all(b == baselines[0] for b in baselines) else None
    plot_runs(runs, target, prefix="report_", title=", ".join(runs)[:80], baselines=shared)
    (target / "report.md").write_text(table + "\n")
    return table
