"""Reports over finished run directories: a Markdown table and comparison figures."""

from __future__ import annotations

import json
import pathlib
from typing import Sequence

import yaml

from ._figures import layers_of, plot_runs
from ._loop import read_metrics, skipped_steps_note


def _solver_steps(metrics: dict) -> str:
    """`12.3 (10.1 / 14.5)`: mean forward solver steps, overall and per layer."""
    if "solver_steps" not in metrics:
        return "-"
    per_layer = " / ".join(f"{metrics[f'solver_steps/{i}']:.1f}" for i in layers_of([metrics]))
    return f"{metrics['solver_steps']:.1f}" + (f" ({per_layer})" if per_layer else "")


def report(run_dirs: Sequence, out_dir=None) -> str:
    """A Markdown table of the runs' final metrics, and comparison figures in `out_dir`
    (default: the run directory if there is one, else `./report`): `report_loss.png`,
    `report_accuracy.png`, and, one panel per run and one line per layer,
    `report_solver_steps.png` (forward solver steps over training) when a run solved fixed
    points, `report_local_loss.png` when a run trained with local losses and
    `report_entropy_production.png` when a run's model reports entropy production.

    **Returns:** the table as a string.
    """
    dirs = [pathlib.Path(d) for d in run_dirs]
    rows, runs = [], {}
    for d in dirs:
        s_path = d / "summary.json"
        if not s_path.exists():
            raise FileNotFoundError(
                f"{d}: no summary.json (not a finished run directory); run `spinformer run "
                f"CONFIG --out {d}` or `--resume` it first."
            )
        s = json.loads(s_path.read_text())
        cfg = yaml.safe_load((d / "config.yaml").read_text()) if (d / "config.yaml").exists() else {}
        m = s.get("metrics", {})
        rows.append((
            d.name, (cfg.get("model") or {}).get("attention", "?"), s.get("steps"),
            m.get("loss"), m.get("accuracy"), _solver_steps(m), s.get("wall_time_s"),
            s.get("bad_steps", 0),
        ))
        runs[d.name] = read_metrics(d)
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
    table = "\n".join(lines)
    target = pathlib.Path(out_dir) if out_dir else (dirs[0] if len(dirs) == 1 else pathlib.Path("report"))
    plot_runs(runs, target, prefix="report_")
    (target / "report.md").write_text(table + "\n")
    return table
