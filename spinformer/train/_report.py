"""Reports over finished run directories: a Markdown table and comparison figures."""

from __future__ import annotations

import json
import pathlib
from typing import Sequence

import yaml

from ._figures import plot_runs
from ._loop import _read_records


def report(run_dirs: Sequence, out_dir=None) -> str:
    """A Markdown table of the runs' final metrics, and comparison figures in `out_dir`
    (default: the run directory if there is one, else `./report`).

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
            m.get("loss"), m.get("accuracy"), m.get("solver_steps"), s.get("wall_time_s"),
        ))
        runs[d.name] = _read_records(d / "metrics.jsonl")
    head = "| run | attention | steps | val loss | val accuracy | solver steps | wall time (s) |"
    sep = "|---|---|---|---|---|---|---|"

    def fmt(v, p=4):
        if v is None:
            return "-"
        return f"{v:.{p}f}" if isinstance(v, float) else str(v)

    lines = [head, sep] + [
        f"| {r[0]} | {r[1]} | {r[2]} | {fmt(r[3])} | {fmt(r[4])} | {fmt(r[5], 1)} | {fmt(r[6], 1)} |"
        for r in rows
    ]
    table = "\n".join(lines)
    target = pathlib.Path(out_dir) if out_dir else (dirs[0] if len(dirs) == 1 else pathlib.Path("report"))
    plot_runs(runs, target, prefix="report_")
    (target / "report.md").write_text(table + "\n")
    return table
