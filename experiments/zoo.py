"""The attention zoo: every registered attention family on every task it applies to, on one
trainer, one data pipeline and one budget per task, in one table.

    python experiments/zoo.py run                  # every unfinished run of configs/zoo/full.yaml
    python experiments/zoo.py run --workers 2      # two worker processes (one core each)
    python experiments/zoo.py report               # tables + figures from what is finished
    python experiments/zoo.py all --quick          # the quick grid (configs/zoo/quick.yaml)
    python experiments/zoo.py plan                 # what would run, and why cells are empty
    python experiments/zoo.py cost --tasks chars   # time per training step of each cell

The grid file (`--config`, default `configs/zoo/full.yaml`; `--quick`: `configs/zoo/quick.yaml`)
names the tasks (a base config, changes, the metric and the split it is measured on), the
families (config changes, per-task changes, the knob that matches the parameter count to
softmax's, tasks skipped with a reason), the seeds and the learning-rate candidates.

**Protocol.** For each task × family: the family's parameter count is matched to softmax's on
that task by its knob (`match`, e.g. the FFN width), where the knob can reach it. The first
seed trains once per learning-rate candidate (the task's `train.lr` times each
`lr_factors`, `train.coupling_lr` scaled alike); the candidate with the lowest final
validation loss is the cell's learning rate, and the other seeds train with it. Every family
gets the same candidates and the same budget, so none wins by tuning. The first seed's runs
chose the learning rate on the validation split; the metric is read on the test split where the
task has one (for characters, which has none, on validation: a small optimistic bias that every
family shares).

**Cells.** The task metric (mean ± the half-width of the 95 % t-interval over seeds), its gap
to softmax paired by seed (and for perplexity the paired ratio), and the costs measured in the
same runs: parameters, training throughput (steps per second after the first log, as a ratio to
softmax's on the same task; workers running side by side share the machine, so read it as
rough), the compiled training step's memory (arguments + outputs + XLA's temporaries, from
`memory_analysis()`), forward solver steps and backward products per layer (the diagnostics'
means over layers), failed solves and skipped steps. A family that cannot run a task gets a
cell that says why: the grid's `skip` reason, or the library's own error when it refuses to
build the model (for example, a non-causal attention in a language model).

**Resuming.** Runs go to `--runs/<task>/<family>/lr<factor>_s<seed>` (default `runs/zoo`,
`runs/zoo_quick` with `--quick`); a finished run (`result.json`) is skipped, a run killed
midway resumes from its checkpoint, and a run that raised is recorded (`failed.json`, with the
error) and the grid goes on (`--retry-failed` tries them again). Each outcome is also copied
into the ledger `--results/ledger/` (the same tree, outcomes only), which is committed with the
report: a fresh checkout skips what the ledger holds and `report` reads it. A run that outlives
the grid's `max_run_minutes` (per task: `tasks.<task>.max_run_minutes`) is stopped after the
step in flight, checkpointed and recorded as failed with its pace, so one family that slows to
a crawl mid-training does not hold the grid (`--retry-failed` leaves such runs alone; raise the
budget to continue them); a run whose step never returns after the stop request (a hang in
compiled code) is recorded the same way 15 minutes later and its worker exits. Several workers
may share one `--runs` directory: each claims a run with a lock directory (a stale lock of a
dead process is taken over).

`report` writes `--results` (default `experiments/results/zoo`, `.../zoo_quick` with `--quick`):
`zoo.md` (the summary table and one table per task), `zoo.json` (every number), `gaps.png`
(a heat map of the paired gaps to softmax) and `cost.png` (quality against throughput per task).
"""

from __future__ import annotations

import argparse
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
from typing import Optional

import numpy as np
import yaml

import spinformer as sf

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _cli import ROOT, chosen, dispatch, failure_message, make_parser, run_script  # noqa: E402
from _stats import mean_ci  # noqa: E402

METRICS = {"accuracy": True, "perplexity": False, "loss": False, "mse": False}  # higher better?
GRID_KEYS = {"description", "experiment", "seeds", "lr_factors", "match_params", "tasks",
             "families", "max_run_minutes"}
TASK_KEYS = {"label", "config", "set", "metric", "split", "test_batches", "max_run_minutes",
             "flops", "seeds", "probe_steps"}
FAMILY_KEYS = {"label", "set", "tasks", "match", "skip"}
REFERENCE = "softmax"
NO_DATA = "the task's data is not available"
IMAGE_TASKS = ("digits", "fashion_mnist")  # tokens from the model's image stem, not seq_len


# ------------------------------------------------------------------------------ the grid

def load_grid(path) -> dict:
    """The grid file, checked: unknown keys, a missing reference family, a metric or split
    that does not exist are errors that name the key."""
    path = pathlib.Path(path)
    grid = yaml.safe_load(path.read_text()) or {}

    def bad(msg):
        raise SystemExit(f"{path}: {msg}")

    if set(grid) - GRID_KEYS:
        bad(f"unknown key(s) {sorted(set(grid) - GRID_KEYS)}; known: {sorted(GRID_KEYS)}.")
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
        if not (ROOT / t.get("config", "")).is_file():
            bad(f"tasks.{name}.config: no config file {t.get('config')!r} (relative to the "
                "repository root).")
    for name, f in grid["families"].items():
        if set(f) - FAMILY_KEYS:
            bad(f"families.{name}: unknown key(s) {sorted(set(f) - FAMILY_KEYS)}; known: "
                f"{sorted(FAMILY_KEYS)}.")
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
    grid.setdefault("match_params", True)
    grid["seeds"] = [int(s) for s in grid["seeds"]]
    grid["lr_factors"] = [float(x) for x in grid["lr_factors"]]
    return grid


def _resolve(changes: dict) -> dict:
    """`data.path` values that name a file of the repository are made absolute (so a grid
    works from any directory)."""
    out = dict(changes)
    p = out.get("data.path")
    if isinstance(p, str) and (ROOT / p).is_file():
        out["data.path"] = str(ROOT / p)
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
    cfg = sf.config.load_config(ROOT / t["config"])
    changes = {**_resolve(t.get("set") or {}), **family_changes(grid, task, family),
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
    the ledger fixes the cell's factor (`choice.json`), that factor."""
    losses = {}
    fixed = runs.choice(task, family)
    if fixed is not None:
        return fixed, losses
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
    loss). A task with a FLOP budget (`flops`) trains the cell's priced number of steps
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
    if result["split"] == "test" or measure_memory:
        _, dataset, model = sf.train.load_run(out)
        if result["split"] == "test":
            n = int(task.get("test_batches", cfg.data.eval_batches))
            result["test"] = sf.train.evaluate(model, [dataset.batch(i, "test")
                                                       for i in range(n)])
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
    # paths inside the repository are written relative to it: the message goes into the
    # committed ledger and report
    message = failure_message(e).replace(str(ROOT) + os.sep, "")
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
    """Run this worker on one CPU (the `ZOO_WORKER_INDEX`-th of those it may use), before
    JAX starts its CPU backend, whose intra-op thread pool then has a single thread.

    With a pool of two threads (2 cores), free-energy training steps deadlocked: jaxlib's
    batched LAPACK kernels (here the Cholesky factorisation, `lapack_spotrf_ffi`) split their
    batch over the same pool that runs them (`jax::ParallelBatchMap`) and wait for the parts;
    with two factorisations running at once, each on one of the pool's two threads, both
    wait for parts queued behind the other, and the step never returns (every thread idle;
    native stacks taken with gdb, jaxlib 0.10). A pool of one thread runs the parts inline
    and cannot wedge. The project's bounds now exclude jaxlib 0.10, so the pin matters for
    an environment that has it anyway; it also keeps each worker to the one core
    `--workers` promises, so that parallel workers do not share cores."""
    if not hasattr(os, "sched_setaffinity"):
        return
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) > 1:
        index = int(os.environ.get("ZOO_WORKER_INDEX", os.getpid()))
        os.sched_setaffinity(0, {cpus[index % len(cpus)]})


def cmd_run(args) -> None:
    if args.worker:
        _pin_to_one_cpu()
    grid = _grid(args)
    if args.workers > 1:
        return _spawn(args)
    runs = _runs(args)
    cells = plan_cells(grid, grid["_tasks"], grid["_families"])
    todo = jobs(grid, cells)
    tag = f"[worker {os.getpid()}] " if args.worker else ""
    print(f"{tag}zoo: {len(todo)} runs over {sum(c.reason is None for c in cells.values())} "
          f"cells ({sum(c.reason is not None for c in cells.values())} empty) -> "
          f"{runs.root} (outcomes also in {runs.ledger})",
          flush=True)
    if args.retry_failed:  # not the runs stopped by the time budget: they would stop again
        for task, fam, factor, seed in todo:
            for name in runs.names(task, fam):
                out = runs.root / task / fam / name
                f = runs.read(out, "failed.json")
                if f is not None and f.get("error") != RunOverBudget.__name__:
                    runs.unfail(out)
    t_start = time.time()
    while True:
        waiting = progressed = False
        for n, (task, fam, factor, seed) in enumerate(todo):
            cell = cells[task, fam]
            if factor is not None and runs.choice(task, fam) not in (None, factor):
                continue  # a candidate of a cell whose factor the ledger fixes: not needed
            if factor is None:
                factor, _ = chosen_factor(grid, runs, task, fam)
                if factor is None:  # candidates not finished yet (another worker has them)
                    waiting = True
                    continue
                if math.isnan(factor):  # every candidate failed: nothing to train
                    continue
            out = runs.dir(task, fam, factor, seed)
            if runs.done(out):
                continue
            if not claim(out):
                waiting = True
                continue
            t0 = time.time()
            budget = _Budget(None, 0.0)
            try:
                if runs.done(out):
                    continue
                measure = (seed == seeds_of(grid, task)[0]
                           and factor == grid["lr_factors"][0])
                minutes = grid["tasks"][task].get("max_run_minutes",
                                                  grid.get("max_run_minutes"))
                done = [r for r in _train_records(out) if "time_s" in r]
                budget = _Budget(minutes, done[-1]["time_s"] if done else 0.0, out,
                                 publish=runs.publish)
                try:
                    if budget.fired:
                        raise KeyboardInterrupt  # recorded below, not trained again
                    budget.start()
                    r = run_one(grid, cell, factor, seed, out, measure_memory=measure,
                                runs=runs)
                    budget.cancel()
                    runs.publish(out)
                    metric = grid["tasks"][task]["metric"]
                    print(f"{tag}[{n + 1}/{len(todo)}] {task}/{fam} lr×{factor:g} s{seed}: "
                          f"{metric} {_fmt_metric(metric, _metric_of(r, metric))} "
                          f"({time.time() - t0:.0f} s)", flush=True)
                except (KeyboardInterrupt, SystemExit, sf.train.TrainingInterrupted):
                    if not budget.fired:
                        raise
                    try:
                        raise _over_budget(out, minutes)
                    except RunOverBudget as e:
                        info = _failure(out, e)
                    runs.publish(out)
                    print(f"{tag}[{n + 1}/{len(todo)}] {task}/{fam} lr×{factor:g} s{seed}: "
                          f"STOPPED: {info['message']}", flush=True)
                except Exception as e:  # recorded; the grid goes on
                    info = _failure(out, e)
                    runs.publish(out)
                    print(f"{tag}[{n + 1}/{len(todo)}] {task}/{fam} lr×{factor:g} s{seed}: "
                          f"FAILED after step {info['last_logged_step']}: {info['message']}",
                          flush=True)
            finally:
                budget.cancel()
                release(out)
            progressed = True
            break  # re-scan from the top: a finished candidate may unblock higher priorities
        if not progressed:
            if not waiting:
                break
            time.sleep(5.0)
    print(f"{tag}zoo: nothing left to run ({time.time() - t_start:.0f} s).", flush=True)


def _spawn(args) -> None:
    """`--workers N`: N worker processes on the same runs directory, one thread each."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen=false "
                        "intra_op_parallelism_threads=1").strip()
    cmd = [sys.executable, __file__, "run", "--workers", "1", "--worker", "--runs", args.runs,
           "--results", args.results, "--config", str(args.config)]
    for opt in ("tasks", "families"):
        if getattr(args, opt):
            cmd += [f"--{opt}", getattr(args, opt)]
    if args.retry_failed:
        cmd.append("--retry-failed")
    procs = []
    for i in range(args.workers):
        procs.append(subprocess.Popen(cmd, env=dict(env, ZOO_WORKER_INDEX=str(i))))
        time.sleep(2.0)  # let the first claim its run before the next scans
    try:
        codes = [p.wait() for p in procs]
    except KeyboardInterrupt:
        for p in procs:
            p.wait()
        raise
    if any(codes):
        raise SystemExit(f"zoo: worker exit codes {codes}")


def cmd_plan(args) -> None:
    grid = _grid(args)
    runs = _runs(args)
    cells = plan_cells(grid, grid["_tasks"], grid["_families"])
    ref = {t: cells[t, REFERENCE].params for t in grid["_tasks"]}
    for (task, fam), c in cells.items():
        if c.reason:
            print(f"{task:12s} {fam:20s} empty: {c.reason}")
            continue
        names = runs.names(task, fam)
        done = sum(runs.read(runs.root / task / fam / n, "result.json") is not None
                   for n in names)
        failed = sum(runs.read(runs.root / task / fam / n, "result.json") is None
                     and runs.read(runs.root / task / fam / n, "failed.json") is not None
                     for n in names)
        print(f"{task:12s} {fam:20s} {c.params:>8,} params ({c.params / ref[task]:.2f}× "
              f"softmax{'; ' + c.match_note if c.match_note else ''}); {done} done, "
              f"{failed} failed")


def cmd_cost(args) -> None:
    """Per live cell: the training step's compile time and time per step (3 steps after the
    compile, the first learning-rate candidate), its ratio to softmax's on the same task, and
    the estimated time of one run and of the cell; written to `<runs>/step_cost.json`. For
    deciding, before the grid spends it, which cells a budget affords (a cell too costly gets
    a `skip` reason in the grid with these numbers). A task with a FLOP budget is priced
    first (`price`: its steps per run), and the step is timed after that probe's training,
    where the solves take their trained iteration counts; the last line sums the grid."""
    import jax

    grid = _grid(args)
    total_min = 0.0
    cells = plan_cells(grid, grid["_tasks"], grid["_families"])
    runs = pathlib.Path(args.runs)
    runs.mkdir(parents=True, exist_ok=True)
    path = runs / "step_cost.json"
    costs = json.loads(path.read_text()) if path.exists() else {}
    for (task, fam), cell in cells.items():
        per_cell = len(grid["lr_factors"]) + len(seeds_of(grid, task)) - 1
        if cell.reason:
            continue
        key = f"{task}/{fam}"
        if key not in costs:
            budget = grid["tasks"][task].get("flops")
            trained: list = []
            priced = price(grid, _runs(args), cell, trained=trained) if budget else None
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


# ------------------------------------------------------------------------------ the report

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
        s["lr"] = next(iter(res.values()))["lr"]
        s["wall_s"] = float(np.mean([r["wall_time_s"] or 0 for r in res.values()]))
    return out


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


def cmd_report(args) -> None:
    grid = _grid(args)
    runs = _runs(args)
    results = pathlib.Path(args.results)
    results.mkdir(parents=True, exist_ok=True)
    cells = plan_cells(grid, grid["_tasks"], grid["_families"])
    missing = sorted({t for (t, f), c in cells.items()
                      if c.reason and c.reason.startswith(NO_DATA) and runs.names(t, f)})
    if missing:  # the report would show their finished runs as empty cells
        why = cells[missing[0], REFERENCE].reason
        raise SystemExit(f"zoo report: task(s) {missing} have finished runs but their data is "
                         f"not on this machine, so their cells cannot be built ({why}). Make the "
                         "data available, or report the other tasks with --tasks and "
                         "--results elsewhere; nothing was written.")
    stats = summarise(grid, collect(grid, runs, cells))
    tasks, fams = grid["_tasks"], grid["_families"]
    unit = {"accuracy": "accuracy %", "perplexity": "perplexity", "loss": "loss",
            "mse": "MSE per pixel"}
    lines = ["# The attention zoo", "", grid.get("description", ""), "",
             f"Grid `{_rel(args.config)}`; seeds {grid['seeds']}; learning rate: the task's "
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
    print(f"zoo: wrote {results / 'zoo.md'}, zoo.json, gaps.png, cost.png")


def _jsonable(x):
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return str(x)


def _rel(p) -> str:
    p = pathlib.Path(p).resolve()
    return str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else str(p)


def _task_table(grid, task, fams, stats) -> list[str]:
    t = grid["tasks"][task]
    metric = t["metric"]
    ref = stats[task, REFERENCE]
    head = (f"| family | {metric} ({t.get('split', 'val')}) | gap to softmax | "
            + ("ratio to softmax | " if metric != "accuracy" else "")
            + "params | matched by | lr | steps/s (× softmax) | step memory MiB | "
              "fwd steps/layer | bwd products/layer | failed solves | fallbacks | "
              "skipped steps | seeds |")
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
            f"{num(s['fallbacks'], '.3f')} | {s['skipped_steps']} | {s['n']} |")
    reasons = [(stats[task, f]["label"], stats[task, f]["reason"]) for f in fams
               if stats[task, f]["reason"]]
    if reasons:
        lines += [""] + [f"- {lab}: {why}" for lab, why in reasons]
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


# ------------------------------------------------------------------------------ command line

def _runs(args) -> Runs:
    return Runs(pathlib.Path(args.runs), pathlib.Path(args.results) / "ledger")


def _grid(args) -> dict:
    grid = load_grid(args.config)
    grid["_tasks"] = chosen(args.tasks, grid["tasks"], grid["tasks"])
    grid["_families"] = chosen(args.families, grid["families"], grid["families"])
    if REFERENCE not in grid["_families"]:
        grid["_families"].insert(0, REFERENCE)  # every gap is taken to it
    return grid


def main(argv=None) -> None:
    p = make_parser(__doc__, runs=None, results=None,
                    commands=("run", "report", "plan", "cost"))
    p.add_argument("--config", default=None,
                   help="the grid file (default configs/zoo/full.yaml)")
    p.add_argument("--quick", action="store_true",
                   help="the quick grid (configs/zoo/quick.yaml; a smoke test, not a result)")
    p.add_argument("--tasks", default=None, help="comma-separated tasks (default: all)")
    p.add_argument("--families", default=None,
                   help="comma-separated families (default: all; softmax is always added)")
    p.add_argument("--workers", type=int, default=1,
                   help="worker processes sharing the runs directory (one thread each)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # (--workers' own)
    p.add_argument("--retry-failed", action="store_true",
                   help="train the runs recorded as failed again")
    args = p.parse_args(argv)
    name = "zoo_quick" if args.quick else "zoo"
    args.config = args.config or str(ROOT / "configs" / "zoo" /
                                     ("quick.yaml" if args.quick else "full.yaml"))
    args.runs = args.runs or str(ROOT / "runs" / name)
    args.results = args.results or str(ROOT / "experiments" / "results" / name)
    try:
        if args.command == "cost":  # not part of `all`
            return cmd_cost(args)
        dispatch(args, plan=cmd_plan, run=cmd_run, report=cmd_report)
    except sf.train.TrainingInterrupted as e:  # the run saved a checkpoint; a rerun resumes
        print(f"zoo: stopped by {e}", file=sys.stderr)
        raise SystemExit(128 + e.signum) from None


if __name__ == "__main__":
    run_script(main)
