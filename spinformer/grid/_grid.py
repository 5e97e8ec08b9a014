"""Grids of training runs: tasks × families × seeds on one trainer, one data pipeline and one
budget per task, compared with softmax paired by seed.

    spinformer grid plan   GRID     # the cells, their parameters, what is done
    spinformer grid price  GRID     # each cell's steps (FLOP budgets) and time per step
    spinformer grid run    GRID     # every unfinished run (--workers 2: two processes)
    spinformer grid report GRID     # tables + figures from the ledger

The grid file (a YAML file, or a shipped grid's name: `zoo/full`, `zoo/scaling`, ...) names
the tasks (a base config, changes, the metric and the split it is measured on, optionally a
budget of training FLOPs), the families (config changes, per-task changes, the knob that
matches the parameter count to softmax's, tasks skipped with a reason), the seeds, the
learning-rate candidates and the modules to import (`imports`: a family of one's own, whose
module registers its attention; `--import` adds more).

**Protocol.** For each task × family: the family's parameter count is matched to softmax's on
that task by its knob (`match`, e.g. the FFN width), where the knob can reach it. The first
seed trains once per learning-rate candidate (the task's `train.lr` times each
`lr_factors`, `train.coupling_lr` scaled alike); the candidate with the lowest final
validation loss is the cell's learning rate, and the other seeds train with it. Every family
gets the same candidates and the same budget, so none wins by tuning. A task with a FLOP
budget (`flops`) has each cell priced first (`price`: the steps that spend it) and every run
counts the FLOPs it spends.

**Resuming.** Runs go to `<runs>/<task>/<family>/lr<factor>_s<seed>`; a finished run
(`result.json`) is skipped, a run killed midway resumes from its checkpoint, and a run that
raised is recorded (`failed.json`, with the error) and the grid goes on (`retry_failed`
tries them again). Each outcome is also copied into the ledger (`<results>/ledger/`, the same
tree, outcomes only, with the prices and the imported modules), which is committed with the
report: a fresh checkout skips what the ledger holds and `report` reads it. A run that
outlives the grid's `max_run_minutes` (per task: `tasks.<task>.max_run_minutes`) is stopped
after the step in flight, checkpointed and recorded as failed with its pace; a run whose step
never returns after the stop request (a hang in compiled code) is recorded the same way
15 minutes later and its worker exits. Several workers may share one runs directory: each
claims a run with a lock directory (a stale lock of a dead process is taken over); on a
cluster, `engine="submitit"` hands each run to the scheduler instead (`_engine.py`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from typing import Optional, Sequence

import numpy as np
import yaml

import spinformer as sf

from .._toolchain import failure_message, release_compiled_code

METRICS = {"accuracy": True, "perplexity": False, "loss": False, "mse": False}  # higher better?
GRID_KEYS = {"description", "experiment", "seeds", "lr_factors", "match_params", "tasks",
             "families", "max_run_minutes", "imports"}
TASK_KEYS = {"label", "config", "set", "metric", "split", "test_batches", "max_run_minutes",
             "flops", "seeds", "probe_steps"}
FAMILY_KEYS = {"label", "set", "tasks", "match", "skip", "against"}
REFERENCE = "softmax"
NO_DATA = "the task's data is not available"
IMAGE_TASKS = ("digits", "fashion_mnist")  # tokens from the model's image stem, not seq_len


class GridError(sf.config.ConfigError):
    """A grid file, or a choice of its tasks and families, that cannot be run: the message
    names the file, the key and what would be valid."""


def find_file(grid, name: str, *, config: bool = False) -> Optional[pathlib.Path]:
    """A file a grid names (a task's `config`, a `data.path`, an import): as given (relative to
    the working directory), else relative to the grid file's folder or one of its parents, so
    that `configs/x.yaml` is found from a checkout's `configs/zoo/` and from the installed
    package's `spinformer/configs/zoo/` alike; with `config`, else a shipped config's name
    (`brackets_softmax`, as `spinformer list` shows it). None if there is none."""
    p = pathlib.Path(name)
    if p.is_absolute() or p.is_file():
        return p if p.is_file() else None
    here = pathlib.Path(grid["_path"]).resolve().parent
    found = next((d / p for d in (here, *here.parents) if (d / p).is_file()), None)
    if found is None and config and name:
        from ..cli import configs_dir

        found = next((c for c in (configs_dir() / p, configs_dir() / f"{name}.yaml")
                      if c.is_file()), None)
    return found


# ------------------------------------------------------------------------------ the grid

def load_grid(path, *, tasks: Optional[Sequence[str]] = None,
              families: Optional[Sequence[str]] = None) -> dict:
    """The grid file at `path`, checked, as a dict: unknown keys, a missing reference family,
    a metric, split or config file that does not exist are `GridError`s that name the key.
    `tasks` and `families` choose some of the grid's (default: all; softmax, the reference,
    is always added); they are kept as `grid["_tasks"]` and `grid["_families"]`, and the
    file's path as `grid["_path"]`."""
    path = pathlib.Path(path)
    try:
        grid = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as e:
        raise GridError(f"{path}: cannot be read as a grid file ({e}).") from None
    grid["_path"] = str(path)

    def bad(msg):
        raise GridError(f"{path}: {msg}")

    if set(grid) - GRID_KEYS - {"_path"}:
        bad(f"unknown key(s) {sorted(set(grid) - GRID_KEYS - {'_path'})}; known: "
            f"{sorted(GRID_KEYS)}.")
    for key in ("seeds", "lr_factors", "tasks", "families"):
        if not grid.get(key):
            bad(f"`{key}` is missing or empty.")
    if REFERENCE not in grid["families"]:
        bad(f"the families must include `{REFERENCE}` (every gap is taken to it).")
    for name, t in grid["tasks"].items():
        if set(t) - TASK_KEYS:
            bad(f"tasks.{name}: unknown key(s) {sorted(set(t) - TASK_KEYS)}; known: "
                f"{sorted(TASK_KEYS)}.")
        if t.get("metric") not in METRICS:
            bad(f"tasks.{name}.metric must be one of {sorted(METRICS)}; got {t.get('metric')!r}.")
        if t.get("split", "val") not in ("val", "test"):
            bad(f"tasks.{name}.split must be val or test; got {t.get('split')!r}.")
        if find_file(grid, t.get("config") or "", config=True) is None:
            bad(f"tasks.{name}.config: no config file {t.get('config')!r} (relative to the "
                "working directory, or to the grid file's folder or one above it), and no "
                "shipped config of that name (`spinformer list`).")
    for name, f in grid["families"].items():
        if set(f) - FAMILY_KEYS:
            bad(f"families.{name}: unknown key(s) {sorted(set(f) - FAMILY_KEYS)}; known: "
                f"{sorted(FAMILY_KEYS)}.")
        if f.get("against") is not None and f["against"] not in grid["families"]:
            bad(f"families.{name}.against: {f['against']!r} is not one of the grid's families "
                f"{sorted(grid['families'])}.")
        for t in list(f.get("tasks") or {}) + list(f.get("skip") or {}):
            if t not in grid["tasks"]:
                bad(f"families.{name}: task {t!r} is not in the grid's tasks "
                    f"{sorted(grid['tasks'])}.")
    for where, holder in [("max_run_minutes", grid)] + [
            (f"tasks.{name}.max_run_minutes", t) for name, t in grid["tasks"].items()]:
        m = holder.get("max_run_minutes")
        if m is not None and not (isinstance(m, (int, float)) and not isinstance(m, bool)
                                  and m > 0):
            bad(f"{where} must be a positive number of minutes (or absent: no limit); "
                f"got {m!r}.")
    for name, t in grid["tasks"].items():
        f = t.get("flops")
        if f is not None and not (isinstance(f, (int, float)) and not isinstance(f, bool)
                                  and f > 0):
            bad(f"tasks.{name}.flops must be a positive number of training FLOPs per run (or "
                f"absent: train.steps decides); got {f!r}.")
        if "seeds" in t and not t["seeds"]:
            bad(f"tasks.{name}.seeds is empty (leave it out to use the grid's seeds).")
    if not isinstance(grid.get("imports") or [], list):
        bad(f"imports must be a list of modules (.py files or dotted names); got "
            f"{grid['imports']!r}.")
    grid.setdefault("match_params", True)
    grid["seeds"] = [int(s) for s in grid["seeds"]]
    grid["lr_factors"] = [float(x) for x in grid["lr_factors"]]
    for key, names in (("tasks", tasks), ("families", families)):
        picked = list(names) if names else list(grid[key])
        if unknown := [n for n in picked if n not in grid[key]]:
            bad(f"no {key} {unknown} in the grid; its {key}: {sorted(grid[key])}.")
        grid[f"_{key}"] = picked
    if REFERENCE not in grid["_families"]:
        grid["_families"].insert(0, REFERENCE)  # every gap is taken to it
    return grid


def use_imports(grid, runs: "Runs", extra: Sequence[str] = ()) -> list[str]:
    """Import the modules the grid needs (a family of one's own registers its attention when
    its module is imported): those its ledger recorded, the grid file's `imports` (`.py`
    paths relative to the grid file's folder, dotted names found from it too) and `extra`
    (`--import`, relative to the working directory); the new ones are recorded in the
    ledger, so that workers, a resumed grid and `report` import them by themselves. Returns
    the modules imported."""
    from ..train._plugins import import_modules, import_run_modules, record_imports

    names = []
    for name in [*(grid.get("imports") or []), *extra]:
        found = find_file(grid, name) if str(name).endswith(".py") else None
        names.append(str(found.resolve()) if found is not None else str(name))
    done = import_run_modules(runs.ledger) if runs.ledger is not None else []
    import_modules(names, search=[str(pathlib.Path(grid["_path"]).resolve().parent)],
                   where=f"{grid['_path']}: imports")
    if runs.ledger is not None and names:
        runs.ledger.mkdir(parents=True, exist_ok=True)
        record_imports(runs.ledger, names)
    return done + names


def _resolve(grid, changes: dict) -> dict:
    """`data.path` values that name a file (relative to the grid, see `find_file`) are made
    absolute, so that a grid works from any directory."""
    out = dict(changes)
    p = out.get("data.path")
    if isinstance(p, str) and (found := find_file(grid, p)) is not None:
        out["data.path"] = str(found.resolve())
    return out


def family_changes(grid, task: str, family: str) -> dict:
    f = grid["families"][family]
    per_task = (f.get("tasks") or {}).get(task) or {}
    return {**(f.get("set") or {}), **(per_task.get("set") or {})}


def family_label(grid, task: str, family: str) -> str:
    f = grid["families"][family]
    return ((f.get("tasks") or {}).get(task) or {}).get("label") or f.get("label") or family


def base_config(grid, task: str, family: str, extra: Optional[dict] = None):
    """The config of `family` on `task` before seeds, learning rate and matching."""
    t = grid["tasks"][task]
    cfg = sf.config.load_config(find_file(grid, t["config"], config=True))
    changes = {**_resolve(grid, t.get("set") or {}), **family_changes(grid, task, family),
               "train.progress": False, **(extra or {})}
    return cfg.replace(changes)


def with_lr(cfg, factor: float, seed: int):
    t = cfg.train
    changes = {"train.lr": t.lr * factor, "train.seed": seed, "data.seed": seed}
    if t.coupling_lr is not None:
        changes["train.coupling_lr"] = t.coupling_lr * factor
    return cfg.replace(changes)


@dataclasses.dataclass
class Cell:
    """One task × family: its config changes (matching included), or why it does not run."""

    task: str
    family: str
    label: str
    changes: dict = dataclasses.field(default_factory=dict)  # on top of base_config
    params: Optional[int] = None
    match_note: str = ""
    reason: Optional[str] = None  # not None: the cell does not run, and this is why


_DATASETS: dict = {}


def _dataset(cfg, task):
    if task not in _DATASETS:
        _DATASETS[task] = sf.train.build_dataset(cfg)
    return _DATASETS[task]


def _count(cfg, dataset) -> int:
    import jax

    import equinox as eqx

    # abstract: the shapes of the model, nothing created
    model = eqx.filter_eval_shape(lambda k: sf.train.build_model(cfg, dataset, key=k),
                                  jax.random.key(0))
    return sf.train.num_params(model)


def plan_cells(grid, tasks, families) -> dict[tuple[str, str], Cell]:
    """Every task × family cell: built once (a family the library refuses gets its error as
    the reason), parameters matched to softmax's by the family's knob."""
    cells = {}
    for task in tasks:
        ref_cfg = base_config(grid, task, REFERENCE)
        try:
            dataset = _dataset(ref_cfg, task)
        except (sf.config.ConfigError, OSError, ValueError) as e:
            for fam in families:
                cells[task, fam] = Cell(task, fam, family_label(grid, task, fam),
                                        reason=f"{NO_DATA}: {e}")
            continue
        ref_params = _count(ref_cfg, dataset)
        for fam in families:
            label = family_label(grid, task, fam)
            skip = (grid["families"][fam].get("skip") or {}).get(task)
            if skip:
                cells[task, fam] = Cell(task, fam, label, reason=str(skip))
                continue
            try:
                cfg = base_config(grid, task, fam)
                params = _count(cfg, dataset)
            except (sf.config.ConfigError, ValueError) as e:
                cells[task, fam] = Cell(task, fam, label, reason=failure_message(e))
                continue
            cell = Cell(task, fam, label, params=params)
            knob = grid["families"][fam].get("match")
            if grid["match_params"] and knob and params != ref_params:
                cell.changes, cell.params, cell.match_note = _match(cfg, dataset, knob,
                                                                    ref_params)
            cells[task, fam] = cell
    return cells


def _get(cfg, dotted: str):
    obj = cfg
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def _match(cfg, dataset, knob: str, target: int):
    """`(changes, params, note)`: the knob's value whose parameter count is nearest
    `target`. The count is linear in an FFN width or a number of memories, so two builds
    give the line (0 may mean "the default" for a knob other than the FFN width, so the line
    is taken through two nonzero values)."""
    k0 = int(_get(cfg, knob) or 0)
    lo = 0 if knob == "model.ffn_hidden" else 1
    c1, c2 = (_count(cfg.replace({knob: k}), dataset) for k in (16, 80))
    b = (c2 - c1) / 64
    short = knob.rsplit(".", 1)[-1]
    if b <= 0:
        return {}, _count(cfg, dataset), f"{short} does not change the count"
    a = c1 - 16 * b
    k = max(lo, int(round((target - a) / b)))
    params = _count(cfg.replace({knob: k}), dataset)
    note = f"{short} {k0} → {k}"
    if k == lo and a + lo * b > 1.02 * target:
        note += f" (larger than softmax even at {lo}: {(a + lo * b) / target:.2f}×)"
    return {knob: k}, params, note


# ------------------------------------------------------------------------------ the runs

@dataclasses.dataclass(frozen=True)
class Runs:
    """Where the grid's runs are. `root/<task>/<family>/lr<factor>_s<seed>/` holds each run
    (config, logs, checkpoints: local to the machine that trains it). The `ledger` mirrors the
    same tree with only each run's outcome, `result.json` or `failed.json` (a few KiB a run),
    and lives beside the report (`--results`), where it is committed: a fresh checkout goes on
    with the grid instead of training the finished runs again, and `report` rebuilds the table
    from it. A run counts as finished or failed if either copy says so (the run directory's
    first). A cell's `choice.json` in the ledger fixes its learning-rate factor where the
    candidates' own records are not all there (runs recovered from an earlier report)."""

    root: pathlib.Path
    ledger: Optional[pathlib.Path] = None

    def dir(self, task, family, factor, seed) -> pathlib.Path:
        return self.root / task / family / f"lr{factor:g}_s{seed}"

    def _copies(self, out: pathlib.Path):
        yield out
        if self.ledger is not None:
            yield self.ledger / out.relative_to(self.root)

    def read(self, out: pathlib.Path, name: str) -> Optional[dict]:
        """`name` (result.json or failed.json) of the run at `out`, or None."""
        for d in self._copies(out):
            if (d / name).exists():
                return json.loads((d / name).read_text())
        return None

    def done(self, out: pathlib.Path) -> bool:
        return any((d / n).exists() for d in self._copies(out)
                   for n in ("result.json", "failed.json"))

    def publish(self, out: pathlib.Path) -> None:
        """Copy the run's outcome into the ledger (a result replaces an earlier failure)."""
        if self.ledger is None:
            return
        dst = self.ledger / out.relative_to(self.root)
        dst.mkdir(parents=True, exist_ok=True)
        if (out / "result.json").exists():
            shutil.copyfile(out / "result.json", dst / "result.json")
        if (out / "failed.json").exists():  # without the traceback (this machine's paths)
            info = json.loads((out / "failed.json").read_text())
            info.pop("traceback", None)
            (dst / "failed.json").write_text(json.dumps(info, indent=2))
        if (dst / "result.json").exists():
            (dst / "failed.json").unlink(missing_ok=True)

    def unfail(self, out: pathlib.Path) -> None:
        for d in self._copies(out):
            (d / "failed.json").unlink(missing_ok=True)

    def names(self, task, family) -> list[str]:
        """The run names (`lr<factor>_s<seed>`) of a cell in either place."""
        found = set()
        for base in (self.root, self.ledger):
            if base is not None:
                found |= {d.name for d in (base / task / family).glob("lr*_s*") if d.is_dir()}
        return sorted(found)

    def choice(self, task, family) -> Optional[float]:
        if self.ledger is None or not (self.ledger / task / family / "choice.json").exists():
            return None
        return json.loads((self.ledger / task / family / "choice.json").read_text())["factor"]


def seeds_of(grid, task: str) -> list[int]:
    """The task's seeds (`tasks.<task>.seeds`), else the grid's."""
    return [int(s) for s in grid["tasks"][task].get("seeds") or grid["seeds"]]


def jobs(grid, cells) -> list[tuple[str, str, Optional[float], int]]:
    """`(task, family, factor, seed)` in priority order, task by task: the first seed's
    learning-rate candidates of every family, then the other seeds (factor None: the cell's
    chosen one, known once the candidates are done)."""
    out = []
    for task in grid["_tasks"]:
        first, rest = seeds_of(grid, task)[0], seeds_of(grid, task)[1:]
        live = [f for f in grid["_families"] if cells[task, f].reason is None]
        out += [(task, f, x, first) for f in live for x in grid["lr_factors"]]
        out += [(task, f, None, s) for s in rest for f in live]
    return out


def chosen_factor(grid, runs: Runs, task, family) -> tuple[Optional[float], dict]:
    """`(factor, losses)`: the candidate with the lowest final validation loss once every
    candidate is finished or failed (None while one is pending; NaN if all failed). Where
    the ledger fixes the cell's factor (`choice.json`), that factor; where the grid has one
    candidate, that one (the other seeds need not wait for the first)."""
    losses = {}
    fixed = runs.choice(task, family)
    if fixed is not None:
        return fixed, losses
    if len(grid["lr_factors"]) == 1:
        return grid["lr_factors"][0], losses
    for x in grid["lr_factors"]:
        d = runs.dir(task, family, x, seeds_of(grid, task)[0])
        if (r := runs.read(d, "result.json")) is not None:
            loss = r["val"]["loss"]
            losses[x] = loss if math.isfinite(loss) else math.inf
        elif runs.read(d, "failed.json") is not None:
            losses[x] = math.inf
        else:
            return None, losses
    best = min(losses, key=lambda x: losses[x])
    return (best if math.isfinite(losses[best]) else math.nan), losses


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def claim(out: pathlib.Path) -> bool:
    """Take the run's lock (a directory made atomically); a lock left by a dead process on
    this machine is taken over."""
    lock = out.parent / (out.name + ".lock")
    lock.parent.mkdir(parents=True, exist_ok=True)
    me = f"{socket.gethostname()} {os.getpid()}"
    try:
        lock.mkdir()
    except FileExistsError:
        try:
            host, pid = (lock / "owner").read_text().split()
        except (OSError, ValueError):
            return False  # being written by its owner right now
        if host != socket.gethostname() or _alive(int(pid)):
            return False
        shutil.rmtree(lock, ignore_errors=True)
        try:
            lock.mkdir()
        except FileExistsError:
            return False
    (lock / "owner").write_text(me)
    return True


def release(out: pathlib.Path) -> None:
    shutil.rmtree(out.parent / (out.name + ".lock"), ignore_errors=True)


def _train_records(out: pathlib.Path) -> list[dict]:
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    return [r for r in (json.loads(x) for x in path.read_text().splitlines() if x.strip())
            if r.get("split") == "train"]


def throughput(records) -> float:
    """Training steps per second between the first logged step (after the compile) and the
    last one (evaluations in between included); NaN with fewer than two records."""
    if len(records) < 2:
        return math.nan
    a, b = records[0], records[-1]
    dt = b["time_s"] - a["time_s"]
    return (b["step"] - a["step"]) / dt if dt > 0 else math.nan


def step_memory(cfg, dataset, model) -> float:
    """Bytes of the compiled training step: arguments + outputs + XLA's temporaries."""
    import jax

    opt = sf.train.build_optimizer(cfg)
    state = sf.train.RunState.init(model, opt)
    batch = {k: jax.numpy.asarray(v) for k, v in dataset.batch(0, "train").items()}
    step = sf.train.jit_step(opt, accumulate=cfg.train.accumulate,
                             precision=cfg.train.precision,
                             objective=sf.train.build_objective(cfg))
    compiled = step.lower(state, batch, jax.random.key(0)).compile()
    mem = getattr(compiled, "compiled", compiled).memory_analysis()  # (equinox wraps jax's)
    if mem is None:
        return math.nan
    return float(mem.argument_size_in_bytes + mem.output_size_in_bytes
                 + mem.temp_size_in_bytes)


def run_one(grid, cell: Cell, factor: float, seed: int, out: pathlib.Path, *,
            measure_memory: bool, runs: Optional[Runs] = None) -> dict:
    """Train one run (resuming a killed one), score it on the task's split and write
    `result.json` (with the validation curve: step, training FLOPs where counted, seconds,
    loss; for a model with solves, `solver_effect` on the same split). A task with a FLOP budget (`flops`) trains the cell's priced number of steps
    (`price`) and counts its FLOPs."""
    task = grid["tasks"][cell.task]
    cfg = with_lr(base_config(grid, cell.task, cell.family, cell.changes), factor, seed)
    counted = None
    if runs is not None and task.get("flops") is not None:  # a budget of training FLOPs
        priced = price(grid, runs, cell)
        cfg = cfg.replace({"train.steps": priced["steps"], "train.count_flops": True})
        counted = sf.train.StepFlops(**priced["step_flops"])  # not counted again per run
    summary = sf.train.run(cfg, out, resume=(out / "config.yaml").exists(), progress=False,
                           flops=counted)
    records = _train_records(out)
    result = {"task": cell.task, "family": cell.family, "seed": seed, "lr_factor": factor,
              "lr": cfg.train.lr, "val": summary["metrics"], "split": task.get("split", "val"),
              "steps": summary["steps"], "bad_steps": summary.get("bad_steps", 0),
              "wall_time_s": summary.get("wall_time_s"), "num_params": summary.get("num_params"),
              "steps_per_s": throughput(records), "flops": summary.get("flops"),
              "curve": _val_curve(out)}
    result["backward_steps"] = _mean_of(records, "backward_steps")
    result["backward_fallbacks"] = _mean_of(records, "backward_fallbacks")
    solves = "solver_steps" in summary["metrics"]
    if result["split"] == "test" or measure_memory or solves:
        _, dataset, model = sf.train.load_run(out)
        n = (int(task.get("test_batches", cfg.data.eval_batches)) if result["split"] == "test"
             else cfg.data.eval_batches)
        batches = [dataset.batch(i, result["split"]) for i in range(n)]
        if result["split"] == "test":
            result["test"] = sf.train.evaluate(model, batches)
        if solves:  # is the solver doing anything? (its loss cut to the start, one step)
            result["solver_effect"] = sf.train.solver_effect(model, batches)
        if measure_memory:
            result["step_memory_bytes"] = step_memory(cfg, dataset, model)
    (out / "result.json").write_text(json.dumps(result, indent=2))
    return result


def _val_curve(out: pathlib.Path) -> list[list]:
    """`[step, flops or None, time_s, loss]` of every validation record of a run."""
    path = out / "metrics.jsonl"
    recs = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    return [[r["step"], r.get("flops"), r.get("time_s"), r["loss"]] for r in recs
            if r.get("split") == "val"]


def _probe(cfg, dataset, steps: int):
    """`(state, counts)`: `steps` training steps of `cfg` (its schedule cut to that length)
    and the solver counts (`solver_steps`, `backward_steps`) of the second half."""
    import jax

    opt = sf.train.build_optimizer(cfg.replace({"train.steps": steps}))
    state = sf.train.RunState.init(sf.train.build_model(cfg, dataset, key=jax.random.key(0)),
                                   opt)
    step = sf.train.jit_step(opt, accumulate=cfg.train.accumulate,
                             precision=cfg.train.precision,
                             objective=sf.train.build_objective(cfg))
    counts = {"solver_steps": [], "backward_steps": []}
    for i in range(steps):
        batch = {k: jax.numpy.asarray(v) for k, v in dataset.batch(i, "train").items()}
        state, m = step(state, batch, jax.random.key(i))
        for k in counts:
            if k in m and i >= steps // 2:
                counts[k].append(float(m[k]))
    return state, counts


def price(grid, runs: Runs, cell: Cell, *, trained: Optional[list] = None) -> dict:
    """The training steps a run of `cell` takes to spend its task's FLOP budget: the cell's
    FLOPs per step (`sf.train.step_flops`) at the mean solver iterations and backward products
    of the steps `probe_steps` (default 100) to twice that of a probe run (the first seed,
    the first learning-rate candidate), kept as `price.json` beside the cell's runs and in
    the ledger, so every machine trains the same number of steps. Each run counts its own
    FLOPs (`train.count_flops`), so the report plots what was spent. A list passed as
    `trained` receives the probe's trained `RunState` (when a probe ran), for timing a step
    where the solves take their trained iteration counts without training again."""

    task = grid["tasks"][cell.task]
    rel = pathlib.Path(cell.task) / cell.family / "price.json"
    for base in (runs.root, runs.ledger):
        if base is not None and (base / rel).exists():
            return json.loads((base / rel).read_text())
    cfg = with_lr(base_config(grid, cell.task, cell.family, cell.changes),
                  grid["lr_factors"][0], seeds_of(grid, cell.task)[0])
    dataset = _dataset(cfg, cell.task)
    model_flops = sf.train.step_flops(cfg, dataset)
    probe = int(task.get("probe_steps", 100))
    counts = {"solver_steps": [], "backward_steps": []}
    if model_flops.forward_iteration or model_flops.backward_product:
        state, counts = _probe(cfg, dataset, 2 * probe)
        if trained is not None:
            trained.append(state)
    k_f = float(np.mean(counts["solver_steps"])) if counts["solver_steps"] else 0.0
    p_b = float(np.mean(counts["backward_steps"])) if counts["backward_steps"] else 0.0
    per_step = model_flops(k_f, p_b)
    out = {"flops": float(task["flops"]), "flops_per_step": per_step,
           "steps": max(1, int(math.ceil(task["flops"] / per_step))),
           "solver_steps": k_f, "backward_steps": p_b,
           "step_flops": {k: v for k, v in model_flops._asdict().items() if v == v},
           "probe_steps": probe}
    for base in (runs.root, runs.ledger):
        if base is not None:
            (base / rel).parent.mkdir(parents=True, exist_ok=True)
            (base / rel).write_text(json.dumps(out, indent=2))
    return out


def _mean_of(records, key):
    vals = [r[key] for r in records if key in r]
    return float(np.mean(vals)) if vals else None


class RunOverBudget(RuntimeError):
    """A run stopped by the grid's wall-time budget (`max_run_minutes`)."""


class _Budget:
    """Asks the trainer to stop (`sf.train.StopSignals.request`, what SIGINT does, without a
    signal, which Python can drop) once a run has used `minutes` of wall time in all (the time
    of earlier, resumed attempts included): the trainer checkpoints after the step in flight
    and stops, and `fired` tells the grid it was the budget. A no-op for `minutes` None.

    A step that never returns (a hang inside compiled code never gets back to the loop, where
    the request is read) would hold the worker for good: `grace_s` after the request,
    the run is recorded as failed and the process exits with code 3, so the grid's other
    workers go on and a rerun skips the run."""

    def __init__(self, minutes: Optional[float], spent_s: float, out=None,
                 grace_s: float = 900.0, publish=None):
        self.minutes, self.out, self.grace_s = minutes, out, grace_s
        self.publish = publish
        self.left_s = math.inf if minutes is None else 60.0 * minutes - spent_s
        self.fired = self.left_s <= 0  # spent already: the run is not started again
        self._timers: list = []

    def _arm(self, seconds, fn):
        t = threading.Timer(seconds, fn)
        t.daemon = True
        t.start()
        self._timers.append(t)

    def start(self):
        """Arm the timer (call inside the `try` that handles the interrupt)."""
        if math.isfinite(self.left_s) and self.left_s > 0:
            self._arm(self.left_s, self._fire)

    def _fire(self):
        self.fired = True
        if self.out is not None:
            self._arm(self.grace_s, self._abandon)
        sf.train.StopSignals.request(signal.SIGINT)

    def _abandon(self):
        try:
            e = RunOverBudget(f"{_over_budget(self.out, self.minutes)}; the step in flight did "
                              f"not return within {self.grace_s:.0f} s of the stop request (a "
                              "hang in compiled code): the worker exited")
            info = _failure(self.out, e)
            if self.publish is not None:
                self.publish(self.out)
            release(self.out)
            print(f"zoo: {self.out}: {info['message']}", flush=True)
        finally:
            os._exit(3)

    def cancel(self):
        for t in self._timers:
            t.cancel()
        if self.fired:  # a request the trainer never took up must not stop the next run
            sf.train.StopSignals.withdraw()


def _over_budget(out: pathlib.Path, minutes: float) -> RunOverBudget:
    """The error recorded for a run stopped by its budget, with its pace: the seconds per
    step over its first and its last logged stretch (a run that slowed down says so)."""
    recs = [r for r in _train_records(out) if "time_s" in r]
    pace = ""
    if len(recs) >= 3:
        def rate(a, b):
            return (b["time_s"] - a["time_s"]) / max(b["step"] - a["step"], 1)

        pace = (f"; {rate(recs[0], recs[1]):.2f} s per step at steps {recs[0]['step']}–"
                f"{recs[1]['step']}, {rate(recs[-2], recs[-1]):.2f} s at steps "
                f"{recs[-2]['step']}–{recs[-1]['step']}")
    ckpts = sorted(out.glob("ckpt-*"))
    where = (f"stopped at step {int(ckpts[-1].name[5:13])} (checkpointed)" if ckpts
             else "stopped before its first checkpoint")
    return RunOverBudget(f"over the grid's time budget of {minutes:g} min per run, "
                         f"{where}{pace}")


def _failure(out: pathlib.Path, e: BaseException) -> dict:
    records = _train_records(out)
    # paths inside the working directory are written relative to it: the message goes into
    # the committed ledger and report
    message = failure_message(e).replace(str(pathlib.Path.cwd()) + os.sep, "")
    info = {"error": type(e).__name__, "message": message[:500],
            "last_logged_step": records[-1]["step"] if records else None,
            "traceback": traceback.format_exc()[-3000:]}
    out.mkdir(parents=True, exist_ok=True)
    (out / "failed.json").write_text(json.dumps(info, indent=2))
    return info


def _metric_of(result: dict, metric: str) -> float:
    scores = result.get("test") if result.get("split") == "test" else result["val"]
    return float(scores[metric])


def _fmt_metric(metric, value) -> str:
    return f"{100 * value:.1f}%" if metric == "accuracy" else f"{value:.4g}"


def _pin_to_one_cpu() -> None:
    """Run this worker on one CPU (the `SPINFORMER_GRID_WORKER`-th of those it may use), before
    JAX starts its CPU backend, whose intra-op thread pool then has a single thread.

    With a pool of two threads (2 cores), free-energy training steps deadlocked: jaxlib's
    batched LAPACK kernels (here the Cholesky factorisation, `lapack_spotrf_ffi`) split their
    batch over the same pool that runs them (`jax::ParallelBatchMap`) and wait for the parts;
    with two factorisations running at once, each on one of the pool's two threads, both
    wait for parts queued behind the other, and the step never returns (every thread idle;
    native stacks taken with gdb, jaxlib 0.10). A pool of one thread runs the parts inline
    and cannot wedge. The project's bounds now exclude jaxlib 0.10, so the pin matters for
    an environment that has it anyway; it also keeps each worker to the one core
    `workers` promises, so that parallel workers do not share cores."""
    if not hasattr(os, "sched_setaffinity"):
        return
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) > 1:
        index = int(os.environ.get("SPINFORMER_GRID_WORKER", os.getpid()))
        os.sched_setaffinity(0, {cpus[index % len(cpus)]})


def train_run(grid, runs: Runs, cell: Cell, factor: float, seed: int, *,
              label: str = "") -> Optional[str]:
    """Train one run of the grid (`run_one`) under its lock, its time budget and the ledger:
    the outcome (a result, a failure with its message, a stop by the time budget) is written
    and published; the process's compiled programs are released after it (each XLA:CPU
    executable holds memory mappings, and a process that kept them all died at the kernel's
    limit after 38 runs). Returns the line it printed, or None where it did nothing: the run
    is finished, or another worker holds it. A KeyboardInterrupt (not the budget's) is raised
    again after the run checkpointed."""
    out = runs.dir(cell.task, cell.family, factor, seed)
    if runs.done(out) or not claim(out):
        return None
    task, t0 = cell.task, time.time()
    head = f"{label}{task}/{cell.family} lr×{factor:g} s{seed}"
    budget = _Budget(None, 0.0)
    try:
        if runs.done(out):
            return None
        measure = seed == seeds_of(grid, task)[0] and factor == grid["lr_factors"][0]
        minutes = grid["tasks"][task].get("max_run_minutes", grid.get("max_run_minutes"))
        done = [r for r in _train_records(out) if "time_s" in r]
        budget = _Budget(minutes, done[-1]["time_s"] if done else 0.0, out,
                         publish=runs.publish)
        try:
            if budget.fired:
                raise KeyboardInterrupt  # recorded below, not trained again
            budget.start()
            r = run_one(grid, cell, factor, seed, out, measure_memory=measure, runs=runs)
            budget.cancel()
            runs.publish(out)
            metric = grid["tasks"][task]["metric"]
            line = (f"{head}: {metric} {_fmt_metric(metric, _metric_of(r, metric))} "
                    f"({time.time() - t0:.0f} s)")
        except (KeyboardInterrupt, SystemExit, sf.train.TrainingInterrupted):
            if not budget.fired:
                raise
            try:
                raise _over_budget(out, minutes)
            except RunOverBudget as e:
                info = _failure(out, e)
            runs.publish(out)
            line = f"{head}: STOPPED: {info['message']}"
        except Exception as e:  # recorded; the grid goes on
            info = _failure(out, e)
            runs.publish(out)
            line = f"{head}: FAILED after step {info['last_logged_step']}: {info['message']}"
    finally:
        budget.cancel()
        release(out)
        release_compiled_code()
    print(line, flush=True)
    return line


def pending(grid, runs: Runs, cells, todo) -> tuple[list, bool]:
    """`(runnable, waiting)`: the runs of `todo` (from `jobs`) that can train now, as
    `(cell, factor, seed)` in priority order, and whether others wait for a cell's
    learning-rate candidates to finish."""
    out, waiting = [], False
    for task, fam, factor, seed in todo:
        if factor is not None and runs.choice(task, fam) not in (None, factor):
            continue  # a candidate of a cell whose factor the ledger fixes: not needed
        if factor is None:
            factor, _ = chosen_factor(grid, runs, task, fam)
            if factor is None:  # candidates not finished yet
                waiting = True
                continue
            if math.isnan(factor):  # every candidate failed: nothing to train
                continue
        if not runs.done(runs.dir(task, fam, factor, seed)):
            out.append((cells[task, fam], factor, seed))
    return out, waiting


def _unfail(grid, runs: Runs, todo) -> None:
    """Forget the failures of `todo`'s runs, so that they train again; not the runs stopped
    by the time budget: they would stop again."""
    for task, fam, _, _ in todo:
        for name in runs.names(task, fam):
            out = runs.root / task / fam / name
            f = runs.read(out, "failed.json")
            if f is not None and f.get("error") != RunOverBudget.__name__:
                runs.unfail(out)


def run_grid(grid, runs: Runs, *, workers: int = 1, retry_failed: bool = False,
             worker: bool = False, imports: Sequence[str] = ()) -> None:
    """Train every unfinished run of the grid's chosen tasks and families, the learning-rate
    candidates of every cell first. `workers` > 1 starts that many worker processes on the
    same runs directory (`spinformer grid run --worker`, one core and one thread each);
    `worker` is what each of them passes (it pins the process to its core, so call it
    before JAX starts). `retry_failed` trains the failed runs again (not those stopped by
    the time budget). `imports` are passed on to the workers."""
    if worker:
        _pin_to_one_cpu()
    missing = {}
    for task in [] if worker else grid["_tasks"]:  # checked once, by the process that spawns
        try:
            _dataset(base_config(grid, task, REFERENCE), task)
        except (sf.config.ConfigError, OSError, ValueError) as e:
            missing[task] = e
    if missing and len(missing) == len(grid["_tasks"]):  # nothing could train: say why
        raise GridError(f"run: {NO_DATA} for task(s) {sorted(missing)}, so nothing of them can "
                        f"be trained: {next(iter(missing.values()))}")
    for task, e in missing.items():
        print(f"grid: task {task} is left out: {NO_DATA}: {e}", flush=True)
    if workers > 1:
        return _spawn(grid, runs, workers, retry_failed, imports)
    cells = plan_cells(grid, grid["_tasks"], grid["_families"])
    todo = jobs(grid, cells)
    tag = f"[worker {os.getpid()}] " if worker else ""
    print(f"{tag}grid: {len(todo)} runs over {sum(c.reason is None for c in cells.values())} "
          f"cells ({sum(c.reason is not None for c in cells.values())} empty) -> "
          f"{runs.root} (outcomes also in {runs.ledger})", flush=True)
    if retry_failed:
        _unfail(grid, runs, todo)
    t_start, n = time.time(), 0
    while True:
        ready, waiting = pending(grid, runs, cells, todo)
        for cell, factor, seed in ready:
            if train_run(grid, runs, cell, factor, seed, label=f"{tag}[{n + 1}] "):
                n += 1
                break  # re-scan from the top: a finished candidate may unblock others
            waiting = True  # held by another worker
        else:
            if not waiting:
                break
            time.sleep(5.0)
    print(f"{tag}grid: nothing left to run ({n} trained here, "
          f"{time.time() - t_start:.0f} s).", flush=True)


def _spawn(grid, runs: Runs, workers: int, retry_failed: bool, imports) -> None:
    """`workers` worker processes on the same runs directory, one thread each."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen=false "
                        "intra_op_parallelism_threads=1").strip()
    cmd = [sys.executable, "-m", "spinformer", "grid", "run", str(grid["_path"]), "--worker",
           "--runs", str(runs.root), "--results", str(runs.ledger.parent),
           "--tasks", ",".join(grid["_tasks"]), "--families", ",".join(grid["_families"])]
    cmd += ["--retry-failed"] * retry_failed + [x for m in imports for x in ("--import", m)]
    procs = []
    for i in range(workers):
        procs.append(subprocess.Popen(cmd, env=dict(env, SPINFORMER_GRID_WORKER=str(i))))
        time.sleep(2.0)  # let the first claim its run before the next scans
    try:
        codes = [p.wait() for p in procs]
    except KeyboardInterrupt:
        for p in procs:
            p.wait()
        raise
    if any(codes):
        raise SystemExit(f"grid: worker exit codes {codes}")


def plan(grid, runs: Runs) -> list[str]:
    """One line per cell: its parameters against softmax's (and how they were matched), the
    runs done and failed; or why the cell is empty."""
    cells = plan_cells(grid, grid["_tasks"], grid["_families"])
    ref = {t: cells[t, REFERENCE].params for t in grid["_tasks"]}
    lines = []
    for (task, fam), c in cells.items():
        if c.reason:
            lines.append(f"{task:12s} {fam:20s} empty: {c.reason}")
            continue
        outs = [runs.root / task / fam / n for n in runs.names(task, fam)]
        done = sum(runs.read(o, "result.json") is not None for o in outs)
        failed = sum(runs.read(o, "result.json") is None
                     and runs.read(o, "failed.json") is not None for o in outs)
        lines.append(f"{task:12s} {fam:20s} {c.params:>8,} params "
                     f"({c.params / ref[task]:.2f}× softmax"
                     f"{'; ' + c.match_note if c.match_note else ''}); {done} done, "
                     f"{failed} failed")
    return lines


def price_grid(grid, runs: Runs) -> None:
    """Per live cell: the training step's compile time and time per step (3 steps after the
    compile, the first learning-rate candidate), its ratio to softmax's on the same task, and
    the estimated time of one run and of the cell; written to `<runs>/step_cost.json`. For
    deciding, before the grid spends it, which cells a budget affords (a cell too costly gets
    a `skip` reason in the grid with these numbers). A task with a FLOP budget is priced
    first (`price`: its steps per run), and the step is timed after that probe's training,
    where the solves take their trained iteration counts; the last line sums the grid."""
    import jax

    total_min = 0.0
    cells = plan_cells(grid, grid["_tasks"], grid["_families"])
    runs.root.mkdir(parents=True, exist_ok=True)
    path = runs.root / "step_cost.json"
    costs = json.loads(path.read_text()) if path.exists() else {}
    for (task, fam), cell in cells.items():
        per_cell = len(grid["lr_factors"]) + len(seeds_of(grid, task)) - 1
        if cell.reason:
            continue
        key = f"{task}/{fam}"
        if key not in costs:
            budget = grid["tasks"][task].get("flops")
            trained: list = []
            priced = price(grid, runs, cell, trained=trained) if budget else None
            cfg = with_lr(base_config(grid, task, fam, cell.changes), grid["lr_factors"][0],
                          seeds_of(grid, task)[0])
            dataset = _dataset(cfg, task)
            model = sf.train.build_model(cfg, dataset, key=jax.random.key(0))
            opt = sf.train.build_optimizer(cfg)
            state = sf.train.RunState.init(model, opt)
            step = sf.train.jit_step(opt, accumulate=cfg.train.accumulate,
                                     precision=cfg.train.precision,
                                     objective=sf.train.build_objective(cfg))
            batch = {k: jax.numpy.asarray(v) for k, v in dataset.batch(0, "train").items()}
            loops = priced and (priced["step_flops"].get("forward_iteration")
                                or priced["step_flops"].get("backward_product"))
            if loops:  # timed where the solves take their trained iteration counts
                state = trained[0] if trained else _probe(
                    cfg, dataset, 2 * priced["probe_steps"])[0]
            t0 = time.perf_counter()
            state, m = step(state, batch, jax.random.key(0))
            jax.block_until_ready(m)
            compile_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            for i in range(3):
                state, m = step(state, batch, jax.random.key(i + 1))
                jax.block_until_ready(m)
            costs[key] = {"compile_s": compile_s, "step_s": (time.perf_counter() - t0) / 3,
                          "steps": priced["steps"] if priced else cfg.train.steps}
            path.write_text(json.dumps(costs, indent=2))
        c = costs[key]
        ref = costs.get(f"{task}/{REFERENCE}")
        ratio = c["step_s"] / ref["step_s"] if ref else math.nan
        run_min = (c["compile_s"] + c["step_s"] * c["steps"]) / 60
        print(f"{task:14s} {fam:20s} compile {c['compile_s']:6.1f} s, step "
              f"{1e3 * c['step_s']:8.1f} ms (x{ratio:.1f} softmax): a run ~{run_min:.1f} min, "
              f"the cell ~{per_cell * run_min:.0f} min", flush=True)
        total_min += per_cell * run_min
    print(f"the grid: ~{total_min / 60:.1f} hours of one process", flush=True)
