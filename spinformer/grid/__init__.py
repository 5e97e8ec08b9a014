"""Grids of training runs against softmax, at equal steps or equal compute: the zoo, the
scaling study, and a family of one's own (`imports`) against any of them.

    spinformer grid plan   zoo/scaling            # cells, parameters, what is done
    spinformer grid price  zoo/scaling            # steps per run and time per step, priced
    spinformer grid run    zoo/scaling --workers 2
    spinformer grid report zoo/scaling            # tables and figures from the ledger

A grid file names tasks, families, seeds and learning-rate candidates (`load_grid`); every
run's outcome goes into a ledger that is the one record of the grid, so that it resumes and
continues on another machine (`Runs`); `report` writes the tables and figures from the
ledger alone: at equal compute (`scaling_report`) where every task has a budget of training
FLOPs, else at equal steps (`zoo_report`). The guide: docs/guides/grids.md.
"""

from __future__ import annotations

import pathlib

from ._grid import (REFERENCE, Cell, GridError, Runs, find_file, jobs, load_grid, plan,
                    plan_cells, price, price_grid, run_grid, seeds_of, train_run, use_imports)
from ._report import zoo_report
from ._scaling import scaling_report
from ._stats import mean_ci, t975

__all__ = ["REFERENCE", "Cell", "GridError", "Runs", "find_file", "jobs", "load_grid", "mean_ci",
           "plan", "plan_cells", "price", "price_grid", "report", "run_grid", "scaling_report",
           "seeds_of", "t975", "train_run", "use_imports", "zoo_report"]


def report(grid, runs: Runs, results) -> dict:
    """The grid's report from its ledger, written into `results`: at equal compute
    (`scaling_report`: power laws, the frontier, gaps at equal FLOPs and equal time) where
    every task has a FLOP budget, else at equal steps (`zoo_report`)."""
    if all(t.get("flops") for t in grid["tasks"].values()):
        return scaling_report(grid, runs, pathlib.Path(results))
    return zoo_report(grid, runs, pathlib.Path(results))
