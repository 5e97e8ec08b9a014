"""The training loop: logging, evaluation, early stopping, checkpoints, resume."""

from __future__ import annotations

import contextlib
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
from ..solvers._adjoint import has_fallback
from ..config import ConfigError, DataConfig, TrainConfig
from . import _checkpoint as ckpt
from . import _mesh, _orbax
from ._figures import plot_run
from ._objective import evaluate, init_stream_state, objective_for
from ._optim import optimizer_for, schedule_for
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
    # set while the command line's signal echo is active: it ends the process on a second
    # signal itself, so the handler must not also raise (a `KeyboardInterrupt` raised inside
    # a finalizer would print a traceback just before the exit)
    second_signal_exits_elsewhere = False
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
            if StopSignals.second_signal_exits_elsewhere:
                return
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


@contextlib.contextmanager
def _compiling(loop, what: str, first: bool):
    """Around the first call of a step (`first`): with progress on, a line saying that `what`
    is compiling, and one with how long compiling took (tracing, lowering, XLA) and how many
    programs came from the persistent compilation cache."""
    if not (first and loop.options.progress and loop.writer):
        yield
        return
    tqdm.write(f"spinformer: compiling the {what}...", file=sys.stderr)
    with _toolchain.CompileClock() as clock:
        yield
    p = clock.parts
    cached = (f"; {clock.cache_hits} program{'s' if clock.cache_hits > 1 else ''} read from "
              "the compilation cache" if clock.cache_hits else "")
    tqdm.write(f"spinformer: the {what} compiled in {clock.seconds:.1f} s (tracing "
               f"{p['trace']:.1f} s, lowering {p['lower']:.1f} s, XLA {p['xla']:.1f} s"
               f"{cached})", file=sys.stderr)


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


def train_batch(dataset, step: int, accumulate: int):
    """The batch of optimizer step `step`: `dataset.batch(step)`, or with accumulation the
    micro-batches `step*k .. step*k + k-1` stacked on a new leading axis."""
    if accumulate == 1:
        return dataset.batch(step, "train")
    parts = [dataset.batch(step * accumulate + j, "train") for j in range(accumulate)]
    return {k: np.stack([p[k] for p in parts]) for k in parts[0]}


def fit(
    model,
    dataset,
    options: TrainConfig = TrainConfig(),
    *,
    out_dir,
    resume: bool = False,
    eval_batches: Optional[int] = None,
    stream: bool = False,
    trackers: Sequence = (),
    flops=None,
    extra_summary: Optional[dict[str, Any]] = None,
):
    """Train `model` on `dataset` as `options` say and write a run directory.

    **Arguments:**

    - `model`: an Equinox model (called per example); `dataset`: anything with
      `batch(index, split)` (see `spinformer.data`).
    - `options`: the training options, a `config.TrainConfig` (a config's `cfg.train`); each
      field's meaning and default is there. `fit` reads them all (`count_flops` asks for
      `flops`): the optimizer, its schedule and the objective (`make_optimizer`,
      `Objective`), `steps`, `seed` (dropout keys are `fold_in(key(seed), step)`), the
      device mesh (`mesh`: see below), logging, evaluation, early stopping (`patience`),
      checkpoints (`checkpoint_every`, `keep_checkpoints`, `checkpointer`: `auto` is orbax
      only when parameters are split over a `model` axis of several processes), the progress
      display (on stderr: a tqdm bar on a terminal, otherwise one line every
      `PROGRESS_EVERY_S` seconds), skipped steps (`max_bad_steps`: a step with a non-finite
      loss, gradient or update changes nothing and is counted in `bad_steps`; that many in a
      row raise `FloatingPointError` after writing a checkpoint of the still finite state),
      `accumulate`, `precision` (see `jit_step`) and `tensorboard` (a `TensorBoard` tracker
      in `out_dir/tensorboard`, closed at the end).
    - `out_dir`: where `metrics.jsonl`, `summary.json`, checkpoints and figures go.
    - `resume`: continue from the newest intact checkpoint in `out_dir`; the result equals an
      uninterrupted run's.
    - `eval_batches`: validation batches per evaluation (None: `config.DataConfig`'s
      default, the `data.eval_batches` of a config).
    - `stream`: the batches are consecutive chunks of parallel streams
      (`data.CharText(stream=True)`, `data.stream`) and the model's attention carries its
      state: training starts from a zero state ("no history") and feeds each step the state
      the previous step returned, with no gradient into earlier chunks (truncated
      backpropagation through time); the state is part of every checkpoint
      (`RunState.stream`), so a resumed run equals an uninterrupted one. Each evaluation
      carries its own state through the validation batches, from zeros.
    - `trackers`: experiment trackers (`train._trackers.Tracker`: `log`, `image`, `close`)
      that get every record written to `metrics.jsonl` and, at the end, the run's figures.
      Only the writing process calls them; whoever made them closes them.
    - `flops`: a `StepFlops` (`step_flops(cfg)`): every step's training FLOPs from its own
      solver counts are summed into `flops`, written with every record, in the checkpoints
      (a resumed run continues the sum) and in the summary. Skipped steps count: their
      arithmetic was spent. `options.count_flops` without it is a `ValueError`.
    - `extra_summary`: entries added to the summary (`baselines` are also drawn in the
      figures).

    The device mesh is `make_mesh(options.mesh)`, or none (the default device, nothing
    sharded) where `options.mesh` is None on a single device: batches are split over its
    `data` axis, the model and optimiser state replicated (or split over `model`); the
    metrics are global. With several processes only process 0 writes files.

    SIGTERM or SIGINT (in the main thread) finish the step in flight, write a checkpoint and
    raise `TrainingInterrupted`; `resume=True` then continues bit-identically.

    The run is one `RunState` (model, optimizer state, carried stream state, step) from start
    to end: `jit_step` maps it to the next, every checkpoint holds it whole, and resume reads
    it back.

    **Returns:** `(model, summary)` where `summary` is what `summary.json` holds.
    """
    if options.count_flops and flops is None:
        raise ValueError("options.count_flops=True: pass the step's FLOPs as "
                         "flops=step_flops(cfg).")
    with contextlib.ExitStack() as closing:
        loop, state = _setup(model, dataset, options, out_dir=out_dir, resume=resume,
                            eval_batches=eval_batches, stream=stream, trackers=trackers,
                            flops=flops, closing=closing)
        state, step, last_eval = _train(loop, state, dataset)
        return state.model, _summarise(loop, state, step, last_eval, extra_summary)


class _Loop:
    """What the parts of `fit` share: what is fixed at the start (`options`, the optimizer,
    its schedule, the objective, the checkpointer, the validation batches, the trackers) and
    the host-side counters that every checkpoint holds (`es`: early stopping, `bad_total`,
    `flops_total`, `elapsed_before`: the time before a resume)."""

    def __init__(self, options: TrainConfig, out: pathlib.Path, *, stream: bool, mesh,
                 trackers: Sequence, flops):
        self.options, self.out, self.stream, self.mesh = options, out, stream, mesh
        self.trackers, self.flops = tuple(trackers), flops
        self.writer = _mesh.is_writer()
        self.metrics_path = out / "metrics.jsonl"
        self.optimizer = optimizer_for(options)
        self.schedule = schedule_for(options)
        self.objective = objective_for(options)
        kind = options.checkpointer
        if kind == "auto":  # orbax where no process holds whole arrays
            split = mesh is not None and mesh.shape["model"] > 1 and jax.process_count() > 1
            kind = "orbax" if split else "native"
        if kind not in ("native", "orbax"):
            raise ValueError(f"checkpointer={kind!r}: use 'auto', 'native' or 'orbax'.")
        self.orbax = (_orbax.OrbaxCheckpoints(out, options.keep_checkpoints)
                      if kind == "orbax" else None)
        self.base_key = jax.random.key(options.seed)
        self.es = {"best_loss": math.inf, "best_step": 0, "bad_evals": 0,
                   "stopped_early": False}
        self.elapsed_before, self.bad_total, self.flops_total = 0.0, 0, 0.0
        self.evaluated = False  # the evaluation step has been compiled
        self.eval_set: list = []
        self.t0 = time.perf_counter()

    def now(self) -> float:
        return self.elapsed_before + time.perf_counter() - self.t0

    def place_batch(self, b):
        return to_device(b) if self.mesh is None else _mesh.shard_batch(b, self.mesh)

    def log(self, record: dict) -> None:
        if self.writer:
            with open(self.metrics_path, "a") as f:
                f.write(json.dumps(record) + "\n")
            for t in self.trackers:
                t.log(record)

    def save(self, state: RunState, step: int):
        """Write the checkpoint of `state` (at `step`); returns its path."""
        meta = {
            "data_position": step,
            "rng": {"seed": self.options.seed,
                    "key_data": np.asarray(jax.random.key_data(self.base_key)).tolist()},
            "early_stopping": self.es,
            "elapsed_s": self.now(),
            "bad_steps": self.bad_total,
            "flops": self.flops_total,
        }
        if self.orbax is not None:  # every process writes its own shards
            return self.orbax.save(state, meta)
        whole = state if self.mesh is None else _mesh.gather(state)
        if self.writer:
            return ckpt.save_checkpoint(self.out, whole, meta, keep=self.options.keep_checkpoints)
        return ckpt.checkpoint_path(self.out, step)


def _setup(model, dataset, options: TrainConfig, *, out_dir, resume: bool,
           eval_batches: Optional[int], stream: bool, trackers: Sequence, flops,
           closing: contextlib.ExitStack) -> tuple[_Loop, RunState]:
    """The run directory, the trackers, the device mesh, the first `RunState` (or the one a
    resume reads back, with the counters of its checkpoint and the records up to its step),
    placed on the devices, and the validation batches."""
    out = pathlib.Path(out_dir)
    mesh = _mesh.mesh_for(options.mesh)
    _toolchain.check_jaxlib()
    writer = _mesh.is_writer()
    if writer:
        out.mkdir(parents=True, exist_ok=True)
    if options.tensorboard and writer:
        from ._trackers import TensorBoard

        try:
            board = TensorBoard(out / "tensorboard")
        except ImportError as e:
            raise ConfigError(f"train.tensorboard=true: {e}") from None
        closing.callback(board.close)
        trackers = (*trackers, board)
    loop = _Loop(options, out, stream=stream, mesh=mesh, trackers=trackers, flops=flops)
    # streaming: the state carried from step to step (host values until placed below)
    carried = np.asarray(init_stream_state(model, dataset.batch(0, "train"))) if stream else None
    state = RunState.init(model, loop.optimizer, stream=carried)
    records_kept: list[dict] = []
    if resume:
        if loop.orbax is not None:  # each process reads its own shards onto the current mesh
            shardings = None if mesh is None else _mesh.state_shardings(state, mesh)
            got = loop.orbax.restore_latest(state, shardings)
        else:
            got = ckpt.load_latest(out, state)
        if got is not None:
            state, meta = got
            start = host_step(state)
            loop.es = meta.get("early_stopping", loop.es)
            loop.elapsed_before = float(meta.get("elapsed_s", 0.0))
            loop.bad_total = int(meta.get("bad_steps", 0))
            loop.flops_total = float(meta.get("flops", 0.0))
            if meta.get("data_position", start) != start:
                raise RuntimeError("checkpoint data position does not match its step.")
            records_kept = [r for r in _read_records(loop.metrics_path)
                            if r.get("step", 0) <= start]
    if writer:
        _write_records(loop.metrics_path, records_kept)
    if mesh is not None:  # the stream state split over `data` like the batches
        state = _mesh.place_state(state, mesh)
    elif state.stream is not None:
        state = eqx.tree_at(lambda s: s.stream, state,
                            loop.place_batch({"state": state.stream})["state"])
    if eval_batches is None:
        eval_batches = DataConfig().eval_batches
    loop.eval_set = [loop.place_batch(dataset.batch(i, "val")) for i in range(eval_batches)]
    loop.t0 = time.perf_counter()
    return loop, state


def _train(loop: _Loop, state: RunState, dataset) -> tuple[RunState, int, Optional[dict]]:
    """The step loop, from `state.step` to `options.steps` (or an early stop): each step's
    record, skipped steps, evaluation, checkpoints and stop signals. Returns the final state,
    its step and the last evaluation (None when no step was taken)."""
    o = loop.options
    step = start = host_step(state)
    last_eval: Optional[dict] = None
    # compiled once, without the backward solves' fallbacks (seconds of compiling that most
    # runs never use); the first skipped step of a model that has them compiles them in and
    # is taken again, and later steps keep them
    lazy = has_fallback(state.model)

    def compile_step(fallback):
        return jit_step(loop.optimizer, accumulate=o.accumulate, precision=o.precision,
                        mesh=loop.mesh, objective=loop.objective, backward_fallback=fallback)

    train_step = compile_step(not lazy)
    show = _Progress(loop.out.name, o.steps, step, enabled=o.progress and loop.writer)
    bad_run = 0
    with StopSignals() as signals:
        try:
            while step < o.steps and not loop.es["stopped_early"]:
                batch = loop.place_batch(train_batch(dataset, step, o.accumulate))
                key = jax.random.fold_in(loop.base_key, step)
                with _compiling(loop, "training step", first=step == start):
                    new, metrics = train_step(state, batch, key)
                    bad = bool(metrics["bad_step"])  # (waits for the step)
                if bad and lazy:
                    lazy, train_step = False, compile_step(True)
                    with _compiling(loop, "training step with the backward solves' fallbacks "
                                    f"(step {step + 1} was not finite without them)", True):
                        new, metrics = train_step(state, batch, key)
                        bad = bool(metrics["bad_step"])
                state = new
                step += 1  # = state.step, kept on the host
                bad_run = bad_run + 1 if bad else 0
                loop.bad_total += bad
                rec = _record_step(loop, step, metrics, bad_run)
                if bad_run >= o.max_bad_steps:
                    path = loop.save(state, step)
                    raise FloatingPointError(_divergence_message(
                        step, bad_run, {k: float(v) for k, v in metrics.items()}, loop.out,
                        path))
                show.update(step, rec)
                if step % o.eval_every == 0 or step == o.steps:
                    last_eval = _evaluate(loop, state, step)
                if o.checkpoint_every and step % o.checkpoint_every == 0:
                    loop.save(state, step)
                if signals.received is not None:
                    path = loop.save(state, step)
                    raise TrainingInterrupted(signals.received, step, path)
        finally:
            show.close()
    return state, step, last_eval


def _counted(loop: _Loop) -> dict:
    """The running totals written with every record (the FLOPs, when counted)."""
    return {"flops": loop.flops_total} if loop.flops is not None else {}


def _record_step(loop: _Loop, step: int, metrics: dict, bad_run: int) -> Optional[dict]:
    """Add the step's FLOPs to the total, and log its training record when it is due (every
    `log_every` steps, the last step, a run of skipped steps that stops training); returns
    the record (None when none was due)."""
    o = loop.options
    if loop.flops is not None:
        loop.flops_total += loop.flops.of_metrics(
            {k: float(metrics[k]) for k in ("solver_steps", "backward_steps") if k in metrics})
    if not (step % o.log_every == 0 or step == o.steps or bad_run >= o.max_bad_steps):
        return None
    rec = {"step": step, "split": "train", **{k: float(v) for k, v in metrics.items()},
           "bad_steps": loop.bad_total, **_counted(loop)}
    rec["lr"] = float(loop.schedule(step - 1))
    rec["time_s"] = round(loop.now(), 3)
    loop.log(rec)
    return rec


def _evaluate(loop: _Loop, state: RunState, step: int) -> dict:
    """Evaluate on the validation batches, log the record and update early stopping (a
    better loss resets the count; `patience` evaluations without one stop the run)."""
    with _compiling(loop, "evaluation step", first=not loop.evaluated):
        result = evaluate(state.model, loop.eval_set, objective=loop.objective,
                          stream=loop.stream)
    loop.evaluated = True
    loop.log({"step": step, "split": "val", **result, "time_s": round(loop.now(), 3),
             **_counted(loop)})
    es = loop.es
    if result["loss"] < es["best_loss"]:
        es.update(best_loss=result["loss"], best_step=step, bad_evals=0)
    else:
        es["bad_evals"] += 1
        if loop.options.patience and es["bad_evals"] >= loop.options.patience:
            es["stopped_early"] = True
    return result


def _summarise(loop: _Loop, state: RunState, step: int, last_eval: Optional[dict],
               extra_summary: Optional[dict]) -> dict:
    """The final checkpoint (unless the last step wrote one), `summary.json` and the
    figures; returns the summary."""
    o = loop.options
    records = _read_records(loop.metrics_path) if loop.writer else []
    if last_eval is None:  # resumed a finished run: every process evaluates (collectives)
        last_eval = evaluate(state.model, loop.eval_set, objective=loop.objective,
                             stream=loop.stream)
    if not (o.checkpoint_every and step % o.checkpoint_every == 0):
        loop.save(state, step)
    flops = loop.flops
    summary = {
        "steps": step,
        "metrics": last_eval,
        "best": {"step": loop.es["best_step"], "loss": loop.es["best_loss"]},
        "stopped_early": bool(loop.es["stopped_early"]),
        "bad_steps": loop.bad_total,
        "wall_time_s": round(loop.now(), 2),
        **({"flops": loop.flops_total, "step_flops": {k: v for k, v in flops._asdict().items()
                                                      if v == v}} if flops is not None else {}),
        **(extra_summary or {}),
    }
    if loop.writer:
        (loop.out / "summary.json").write_text(json.dumps(summary, indent=2))
        figures = plot_run(records, loop.out, title=loop.out.name,
                           baselines=(extra_summary or {}).get("baselines"))
        for t in loop.trackers:
            for path in figures:
                t.image(f"figures/{path.stem}", path, step)
    return summary
