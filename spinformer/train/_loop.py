"""The training loop: logging, evaluation, early stopping, checkpoints, resume."""

from __future__ import annotations

import json
import math
import pathlib
import signal
import sys
import threading
import time
from typing import Any, Optional, Sequence

import equinox as eqx
import jax
import numpy as np
from tqdm import tqdm

from .. import _toolchain
from . import _checkpoint as ckpt
from . import _mesh, _orbax
from ._figures import plot_run
from ._objective import evaluate, init_stream_state
from ._state import RunState, host_step
from ._step import jit_step, to_device


class TrainingInterrupted(Exception):
    """Training stopped by SIGTERM or SIGINT after writing a checkpoint; `--resume`
    continues exactly where it stopped.

    **Attributes:** `signum`, `step` (the last completed step), `checkpoint` (its path)."""

    def __init__(self, signum: int, step: int, checkpoint):
        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        name = signal.Signals(signum).name
        super().__init__(f"{name} at step {step}: checkpoint written to {checkpoint}; "
                         "continue with --resume.")


class StopSignals:
    """While active, SIGTERM and SIGINT only set `received` (the loop checkpoints and stops
    after the step in flight); a second signal interrupts at once. Inactive outside the main
    thread, where Python cannot install handlers. Used by `fit` and by experiments with their
    own loops (`with StopSignals() as stop: ... if stop.received: save and stop`).

    `StopSignals.request()` asks the same from any thread without a signal (a time budget's
    timer, for example): it sets `received` of the innermost active instance, or, when none
    is active, is kept for the next one to enter, until `StopSignals.withdraw()`. A signal is
    not a reliable messenger for this: Python runs its handler in whatever code the main
    thread executes next, and a `KeyboardInterrupt` raised inside a finalizer is printed and
    dropped.

    A repeat of the same signal within `SAME_REQUEST_S` of the first is the same request
    delivered twice, not a second one: coreutils `timeout` (and any process-group kill after
    a direct one) sends SIGTERM to the process and then to its whole group."""

    SAME_REQUEST_S = 0.25
    _lock = threading.Lock()
    _active: list = []
    _pending: Optional[int] = None

    def __init__(self):
        self.received: Optional[int] = None
        self.received_at = -float("inf")
        self.old: dict = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self.old[sig] = signal.signal(sig, self._handle)
        with StopSignals._lock:
            if StopSignals._pending is not None:
                self.received, StopSignals._pending = StopSignals._pending, None
            StopSignals._active.append(self)
        return self

    def _handle(self, signum, frame):
        now = time.monotonic()
        if self.received is not None:
            if signum == self.received and now - self.received_at < self.SAME_REQUEST_S:
                return  # the same request delivered twice
            raise KeyboardInterrupt  # asked twice: stop now (checkpoints on disk are intact)
        self.received, self.received_at = signum, now

    def __exit__(self, *exc):
        with StopSignals._lock:
            if self in StopSignals._active:
                StopSignals._active.remove(self)
        for sig, old in self.old.items():
            signal.signal(sig, old)
        return False

    @classmethod
    def request(cls, signum: int = signal.SIGINT) -> None:
        """Ask the active loop to stop after the step in flight, as `signum` would (any
        thread); with no loop active, the next one to start stops after its first step."""
        with cls._lock:
            if cls._active:
                if cls._active[-1].received is None:
                    cls._active[-1].received = signum
            else:
                cls._pending = signum

    @classmethod
    def withdraw(cls) -> None:
        """Forget a `request()` that no loop has taken up yet."""
        with cls._lock:
            cls._pending = None


def _read_records(path: pathlib.Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut short by a kill
            break
    return out


def read_metrics(run_dir) -> list[dict]:
    """The records of a run directory's `metrics.jsonl`, in order (`[]` if there is none;
    a last line cut short by a kill is dropped). Each has `step`, `split` (`"train"` or
    `"val"`), `time_s` and the metrics logged then."""
    return _read_records(pathlib.Path(run_dir) / "metrics.jsonl")


def _write_records(path: pathlib.Path, records: list[dict]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in records))
    tmp.replace(path)


PROGRESS_EVERY_S = 30.0


class _Progress:
    """A tqdm bar on a terminal; elsewhere (a log file, CI) a plain line every
    `PROGRESS_EVERY_S` seconds and one at the end."""

    def __init__(self, name: str, total: int, initial: int, *, enabled: bool):
        self.name, self.total = name, total
        self.interactive = enabled and sys.stderr.isatty()
        self.plain = enabled and not self.interactive
        self.bar = tqdm(total=total, initial=initial, disable=not self.interactive, desc=name,
                        dynamic_ncols=True)
        self.last_print = time.perf_counter()
        self.step, self.rec, self.printed = initial, None, initial

    def update(self, step: int, rec: Optional[dict] = None) -> None:
        self.bar.update(step - self.step)
        self.step = step
        if rec is None:
            return
        self.rec = rec
        self.bar.set_postfix({"loss": f"{rec['loss']:.3f}",
                              **({"acc": f"{rec['accuracy']:.3f}"} if "accuracy" in rec else {})})
        if self.plain and time.perf_counter() - self.last_print >= PROGRESS_EVERY_S:
            self._print()

    def _print(self) -> None:
        r = self.rec or {}
        metrics = "".join(f" {k} {r[k]:.4g}" for k in ("loss", "accuracy") if k in r)
        print(f"{self.name}: step {self.step}/{self.total}{metrics} ({r.get('time_s', 0):.0f} s)",
              file=sys.stderr, flush=True)
        self.last_print, self.printed = time.perf_counter(), self.step

    def close(self) -> None:
        self.bar.close()
        if self.plain and self.rec is not None and self.printed != self.step:
            self._print()


def _divergence_message(step: int, bad: int, metrics: dict, out: pathlib.Path,
                        saved: pathlib.Path) -> str:
    """What diverged, where to restart from, and what to look at."""
    where = (f"the newest checkpoint is {saved} (step {step}; the skipped steps changed "
             "nothing)")
    failures = metrics.get("solver_failures")
    solver = (f"; {failures:.0%} of the last step's forward solves failed" if failures else "")
    return (
        f"training diverged at step {step}: {bad} steps in a row had a non-finite loss, "
        f"gradient or update (the last: loss {metrics.get('loss')}, gradient norm "
        f"{metrics.get('grad_norm', float('nan')):.3g}){solver}, and were skipped; {where}. "
        "Lower train.lr (or set train.grad_clip), and check the solver_steps and "
        f"solver_failures columns of {out / 'metrics.jsonl'}; train.max_bad_steps sets how "
        "many skipped steps in a row are tolerated."
    )


def skipped_steps_note(summary: dict) -> str:
    """One line on a run's skipped steps (`summary["bad_steps"]` of `summary["steps"]`), for
    the end of the run and its report."""
    n, steps = int(summary.get("bad_steps", 0)), summary.get("steps")
    of = f" of {steps}" if steps else ""
    return (f"{n}{of} optimizer steps were skipped: their loss or gradient was not finite "
            "(often a backward solve that missed its tolerance: see the backward_residual and "
            "backward_fallbacks columns of metrics.jsonl) and the parameters did not change "
            "at them; loss.png marks where.")


def _train_batch(dataset, step: int, accumulate: int):
    """The batch of optimizer step `step`: `dataset.batch(step)`, or with accumulation the
    micro-batches `step*k .. step*k + k-1` stacked on a new leading axis."""
    if accumulate == 1:
        return dataset.batch(step, "train")
    parts = [dataset.batch(step * accumulate + j, "train") for j in range(accumulate)]
    return {k: np.stack([p[k] for p in parts]) for k in parts[0]}


def fit(
    model,
    optimizer,
    dataset,
    *,
    out_dir,
    steps: int,
    seed: int = 0,
    eval_batches: int = 8,
    log_every: int = 10,
    eval_every: int = 100,
    patience: int = 0,
    checkpoint_every: int = 0,
    keep_checkpoints: int = 3,
    resume: bool = False,
    progress: bool = True,
    lr_schedule=None,
    extra_summary: Optional[dict[str, Any]] = None,
    max_bad_steps: int = 20,
    accumulate: int = 1,
    precision: str = "float32",
    mesh=None,
    checkpointer: str = "native",
    objective=None,
    stream: bool = False,
    trackers: Sequence = (),
    flops=None,
):
    """Train `model` on `dataset` and write a run directory.

    **Arguments:**

    - `model`, `optimizer`: an Equinox model (called per example) and an optax optimizer.
    - `dataset`: anything with `batch(index, split)` (see `spinformer.data`).
    - `out_dir`: where `metrics.jsonl`, `summary.json`, checkpoints and figures go.
    - `steps`: total optimizer steps; `seed`: dropout keys are `fold_in(key(seed), step)`.
    - `eval_batches`, `log_every`, `eval_every`, `patience` (evaluations without a better
      validation loss before stopping; 0: never), `checkpoint_every` (0: only at the end),
      `keep_checkpoints`.
    - `resume`: continue from the newest intact checkpoint in `out_dir`; the result equals an
      uninterrupted run's.
    - `progress`: show progress on stderr: a tqdm bar when stderr is a terminal, otherwise
      one line every `PROGRESS_EVERY_S` seconds (a log file gets no bar redraws).
    - `max_bad_steps`: a step with a non-finite loss, gradient or update is skipped (nothing
      changes; the records count them in `bad_steps`); this many in a row raise
      `FloatingPointError` after writing a checkpoint of the (still finite) state.
    - `accumulate`, `precision`, `objective`: see `jit_step`.
    - `stream`: the batches are consecutive chunks of parallel streams
      (`data.CharText(stream=True)`) and the model's attention carries its state: training
      starts from a zero state ("no history") and feeds each step the state the previous
      step returned, with no gradient into earlier chunks (truncated backpropagation through
      time); the state is part of every checkpoint (`RunState.stream`), so a resumed run
      equals an uninterrupted one. Each evaluation carries its own state through the
      validation batches, from zeros.
    - `checkpointer`: `"native"` (one checksummed file per checkpoint, written by process 0
      from whole arrays) or `"orbax"` (orbax-checkpoint: every process writes its own shards
      under `out_dir/orbax/`; for state no process holds whole). Resume reads the same kind.
    - `mesh`: a `jax.sharding.Mesh` from `make_mesh` (None: this process's default device,
      nothing sharded). Batches are split over its `data` axis, the model and optimiser
      state replicated (or split over `model`); the metrics are global. With several
      processes only process 0 writes files.

    - `trackers`: experiment trackers (`train._trackers.Tracker`: `log`, `image`, `close`)
      that get every record written to `metrics.jsonl` and, at the end, the run's figures;
      e.g. `TensorBoard(out_dir / "tensorboard")` (`train.tensorboard: true`). Only the
      writing process calls them; whoever made them closes them (`run` does).
    - `flops`: a `train._flops.StepFlops` (`step_flops(cfg)`): every step's training FLOPs
      from its own solver counts are summed into `flops`, written with every record, in
      the checkpoints (a resumed run continues the sum) and in the summary. Skipped steps
      count: their arithmetic was spent.

    SIGTERM or SIGINT (in the main thread) finish the step in flight, write a checkpoint and
    raise `TrainingInterrupted`; `resume=True` then continues bit-identically.

    The run is one `RunState` (model, optimizer state, carried stream state, step) from start
    to end: `jit_step` maps it to the next, every checkpoint holds it whole, and resume reads
    it back.

    **Returns:** `(model, summary)` where `summary` is what `summary.json` holds.
    """
    out = pathlib.Path(out_dir)
    _toolchain.check_jaxlib()
    writer = _mesh.is_writer()
    if writer:
        out.mkdir(parents=True, exist_ok=True)
    metrics_path = out / "metrics.jsonl"
    # streaming: the state carried from step to step (host values until placed below)
    carried = np.asarray(init_stream_state(model, dataset.batch(0, "train"))) if stream else None
    state = RunState.init(model, optimizer, stream=carried)
    start = 0
    es = {"best_loss": math.inf, "best_step": 0, "bad_evals": 0, "stopped_early": False}
    elapsed_before, bad_total, flops_total = 0.0, 0, 0.0
    records_kept: list[dict] = []
    if checkpointer not in ("native", "orbax"):
        raise ValueError(f"checkpointer={checkpointer!r}: use 'native' or 'orbax'.")
    orbax = _orbax.OrbaxCheckpoints(out, keep_checkpoints) if checkpointer == "orbax" else None
    if resume:
        if orbax is not None:  # each process reads its own shards onto the current mesh
            shardings = None if mesh is None else _mesh.state_shardings(state, mesh)
            got = orbax.restore_latest(state, shardings)
        else:
            got = ckpt.load_latest(out, state)
        if got is not None:
            state, meta = got
            start = host_step(state)
            es = meta.get("early_stopping", es)
            elapsed_before = float(meta.get("elapsed_s", 0.0))
            bad_total = int(meta.get("bad_steps", 0))
            flops_total = float(meta.get("flops", 0.0))
            if meta.get("data_position", start) != start:
                raise RuntimeError("checkpoint data position does not match its step.")
            records_kept = [r for r in _read_records(metrics_path) if r.get("step", 0) <= start]
    if writer:
        _write_records(metrics_path, records_kept)

    def place_batch(b):
        return to_device(b) if mesh is None else _mesh.shard_batch(b, mesh)

    if mesh is not None:  # the stream state split over `data` like the batches
        state = _mesh.place_state(state, mesh)
    elif state.stream is not None:
        state = eqx.tree_at(lambda s: s.stream, state,
                            place_batch({"state": state.stream})["state"])
    eval_set = [place_batch(dataset.batch(i, "val")) for i in range(eval_batches)]
    base_key = jax.random.key(seed)
    t0 = time.perf_counter()

    def now():
        return elapsed_before + time.perf_counter() - t0

    def log(record):
        if writer:
            with open(metrics_path, "a") as f:
                f.write(json.dumps(record) + "\n")
            for t in trackers:
                t.log(record)

    def save(step):  # the checkpoint of `state` (at `step`)
        meta = {
            "data_position": step,
            "rng": {"seed": seed, "key_data": np.asarray(jax.random.key_data(base_key)).tolist()},
            "early_stopping": es,
            "elapsed_s": now(),
            "bad_steps": bad_total,
            "flops": flops_total,
        }
        if orbax is not None:  # every process writes its own shards
            return orbax.save(state, meta)
        whole = state if mesh is None else _mesh.gather(state)
        if writer:
            return ckpt.save_checkpoint(out, whole, meta, keep=keep_checkpoints)
        return ckpt.checkpoint_path(out, step)

    step = start
    last_eval: Optional[dict] = None
    train_step = jit_step(optimizer, accumulate=accumulate, precision=precision,
                          mesh=mesh, objective=objective)  # compiled once
    show = _Progress(out.name, steps, start, enabled=progress and writer)
    bad_run = 0
    with StopSignals() as signals:
        try:
            while step < steps and not es["stopped_early"]:
                batch = place_batch(_train_batch(dataset, step, accumulate))
                key = jax.random.fold_in(base_key, step)
                state, metrics = train_step(state, batch, key)
                step += 1  # = state.step, kept on the host
                bad = bool(metrics["bad_step"])
                bad_run = bad_run + 1 if bad else 0
                bad_total += bad
                if flops is not None:
                    flops_total += flops.of_metrics(
                        {k: float(metrics[k]) for k in ("solver_steps", "backward_steps")
                         if k in metrics})
                counted = {"flops": flops_total} if flops is not None else {}
                rec = None
                if step % log_every == 0 or step == steps or bad_run >= max_bad_steps:
                    rec = {"step": step, "split": "train",
                           **{k: float(v) for k, v in metrics.items()}, "bad_steps": bad_total,
                           **counted}
                    if lr_schedule is not None:
                        rec["lr"] = float(lr_schedule(step - 1))
                    rec["time_s"] = round(now(), 3)
                    log(rec)
                if bad_run >= max_bad_steps:
                    path = save(step)
                    raise FloatingPointError(_divergence_message(
                        step, bad_run, {k: float(v) for k, v in metrics.items()}, out, path))
                show.update(step, rec)
                if step % eval_every == 0 or step == steps:
                    last_eval = evaluate(state.model, eval_set, objective=objective,
                                         stream=stream)
                    log({"step": step, "split": "val", **last_eval, "time_s": round(now(), 3),
                         **counted})
                    if last_eval["loss"] < es["best_loss"]:
                        es.update(best_loss=last_eval["loss"], best_step=step, bad_evals=0)
                    else:
                        es["bad_evals"] += 1
                        if patience and es["bad_evals"] >= patience:
                            es["stopped_early"] = True
                if checkpoint_every and step % checkpoint_every == 0:
                    save(step)
                if signals.received is not None:
                    path = save(step)
                    raise TrainingInterrupted(signals.received, step, path)
        finally:
            show.close()

    records = _read_records(metrics_path) if writer else []
    if last_eval is None:  # resumed a finished run: every process evaluates (collectives)
        last_eval = evaluate(state.model, eval_set, objective=objective, stream=stream)
    if not (checkpoint_every and step % checkpoint_every == 0):
        save(step)
    summary = {
        "steps": step,
        "metrics": last_eval,
        "best": {"step": es["best_step"], "loss": es["best_loss"]},
        "stopped_early": bool(es["stopped_early"]),
        "bad_steps": bad_total,
        "wall_time_s": round(now(), 2),
        **({"flops": flops_total, "step_flops": {k: v for k, v in flops._asdict().items()
                                                   if v == v}} if flops is not None else {}),
        **(extra_summary or {}),
    }
    if writer:
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
        figures = plot_run(records, out, title=out.name,
                           baselines=(extra_summary or {}).get("baselines"))
        for t in trackers:
            for path in figures:
                t.image(f"figures/{path.stem}", path, step)
    return state.model, summary
