"""A grid on a cluster: each run one job of submitit (https://github.com/facebookincubator/submitit),
which submits to SLURM where there is one and runs jobs as local processes otherwise. The
scheduler shares out the runs; the ledger stays the grid's one record, so a grid goes on
across machines and engines (`spinformer grid run GRID --engine submitit`).

submitit rather than Dask (dask-jobqueue): a grid is a bag of independent runs of minutes to
hours, each in a process of its own, which is what a batch job is; submitit gives that with
one call per run, the job's logs in a folder, and SLURM's time limits and requeueing, without
a scheduler process and workers to keep alive for the length of the grid.
"""

from __future__ import annotations

import os
import pathlib
from typing import Optional, Sequence

from ._grid import (Runs, _unfail, jobs, load_grid, pending, plan_cells, train_run,
                    use_imports)


def _job(grid_path: str, tasks: list, families: list, imports: list, root: str, ledger: str,
         task: str, family: str, factor: float, seed: int) -> Optional[str]:
    """One run, in the job's own process (what submitit pickles and calls): the grid read
    again, the modules imported, the run trained under its lock and recorded in the ledger."""
    from .._toolchain import use_compilation_cache

    use_compilation_cache()
    grid = load_grid(grid_path, tasks=tasks, families=families)
    runs = Runs(pathlib.Path(root), pathlib.Path(ledger))
    use_imports(grid, runs, imports)
    cell = plan_cells(grid, [task], [family])[task, family]
    return train_run(grid, runs, cell, factor, seed)


def run_submitit(grid, runs: Runs, *, retry_failed: bool = False, imports: Sequence[str] = (),
                 options: Optional[dict] = None) -> list:
    """Train every unfinished run of the grid as one submitit job each, in waves: the runs
    that can train now (every seed of a cell with one learning-rate candidate; with several,
    the first seed's candidates, then the other seeds once the best is chosen), waiting for
    each wave to end. `options` go to the executor's `update_parameters` (for SLURM e.g.
    `slurm_partition`, `cpus_per_task`, `timeout_min`), except `cluster` ("slurm", "local",
    "debug"; default: SLURM where it is installed, else local processes, all at once).
    The default time limit is the grid's longest `max_run_minutes` plus 30 minutes (24 hours
    without one). Job logs go to `<runs>/submitit/`. Returns the lines of the runs trained."""
    # submitit configures logging when imported (`dictConfig`, which closes every handler
    # already set up, the caller's among them) unless told not to; the grid prints its own
    # lines
    os.environ.setdefault("SUBMITIT_LOG_LEVEL", "NOCONFIG")
    try:
        import submitit
    except ImportError:
        raise ImportError("--engine submitit needs submitit: `pip install submitit` (or "
                          "`pip install 'spinformer[cluster]'`).") from None
    options = dict(options or {})
    cluster = options.pop("cluster", None)
    limits = [m for m in [grid.get("max_run_minutes")]
              + [t.get("max_run_minutes") for t in grid["tasks"].values()] if m]
    options.setdefault("timeout_min", int(max(limits) + 30) if limits else 24 * 60)
    executor = submitit.AutoExecutor(folder=runs.root / "submitit", cluster=cluster)
    executor.update_parameters(name="spinformer-grid", **options)
    cells = plan_cells(grid, grid["_tasks"], grid["_families"])
    todo = jobs(grid, cells)
    if retry_failed:
        _unfail(grid, runs, todo)
    common = (str(pathlib.Path(grid["_path"]).resolve()), grid["_tasks"], grid["_families"],
              [str(pathlib.Path(m).resolve()) if m.endswith(".py") else m for m in imports],
              str(runs.root.resolve()), str(runs.ledger.resolve()))
    done, submitted = [], set()
    while True:
        ready, waiting = pending(grid, runs, cells, todo)
        ready = [r for r in ready if (r[0].task, r[0].family, r[1], r[2]) not in submitted]
        if not ready:
            if waiting:
                raise RuntimeError("grid: runs wait for learning-rate candidates that no job "
                                   "trains (held by another worker?); run the grid again "
                                   "once they finish.")
            return done
        with executor.batch():
            handles = [executor.submit(_job, *common, c.task, c.family, f, s)
                       for c, f, s in ready]
        print(f"grid: submitted {len(handles)} runs ({executor.cluster}); logs in "
              f"{runs.root / 'submitit'}", flush=True)
        for (c, f, s), h in zip(ready, handles):
            submitted.add((c.task, c.family, f, s))
            try:
                line = h.result()
            except Exception as e:  # noqa: BLE001 - the job itself died (time limit, node)
                line = f"{c.task}/{c.family} lr×{f:g} s{s}: job {h.job_id} ended: " \
                       f"{str(e).strip().splitlines()[-1] if str(e).strip() else e!r}"
            print(line if line else f"{c.task}/{c.family} lr×{f:g} s{s}: held elsewhere",
                  flush=True)
            if line:
                done.append(line)
