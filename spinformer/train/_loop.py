"""The training loop: logging, evaluation, early stopping, checkpoints, resume."""

from __future__ import annotations

import json
import math
import pathlib
import sys
import time
from typing import Any, Optional

import jax
import numpy as np
from tqdm import tqdm

from . import _checkpoint as ckpt
from ._figures import plot_run
from ._step import evaluate, init_opt_state, jit_step, to_device


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
        self.bar.set_postfix(loss=f"{rec['loss']:.3f}", acc=f"{rec['accuracy']:.3f}")
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


def _divergence_message(rec: dict, out: pathlib.Path) -> str:
    """What diverged, where to restart from, and what to look at."""
    last = ckpt.list_checkpoints(out)
    where = (f"the last good checkpoint is {last[-1][1]} (step {last[-1][0]})" if last
             else "no checkpoint was written before it")
    failures = rec.get("solver_failures")
    solver = (f"; {failures:.0%} of this step's forward solves failed" if failures else "")
    return (
        f"training diverged at step {rec['step']}: the training loss is {rec['loss']} "
        f"(gradient norm {rec.get('grad_norm', float('nan')):.3g}){solver}; {where}. "
        "Lower train.lr (or set train.grad_clip), and check the solver_steps and "
        f"solver_failures columns of {out / 'metrics.jsonl'}."
    )


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

    **Returns:** `(model, summary)` where `summary` is what `summary.json` holds.
    """
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    metrics_path = out / "metrics.jsonl"
    opt_state = init_opt_state(optimizer, model)
    start = 0
    es = {"best_loss": math.inf, "best_step": 0, "bad_evals": 0, "stopped_early": False}
    elapsed_before = 0.0
    if resume:
        got = ckpt.load_latest(out, (model, opt_state))
        if got is not None:
            start, model, opt_state, meta = got
            es = meta.get("early_stopping", es)
            elapsed_before = float(meta.get("elapsed_s", 0.0))
            if meta.get("data_position", start) != start:
                raise RuntimeError("checkpoint data position does not match its step.")
            records = [r for r in _read_records(metrics_path) if r.get("step", 0) <= start]
            _write_records(metrics_path, records)
        else:
            _write_records(metrics_path, [])
    else:
        _write_records(metrics_path, [])

    eval_set = [dataset.batch(i, "val") for i in range(eval_batches)]
    base_key = jax.random.key(seed)
    t0 = time.perf_counter()

    def now():
        return elapsed_before + time.perf_counter() - t0

    def log(record):
        with open(metrics_path, "a") as f:
            f.write(json.dumps(record) + "\n")

    def save(step):
        meta = {
            "data_position": step,
            "rng": {"seed": seed, "key_data": np.asarray(jax.random.key_data(base_key)).tolist()},
            "early_stopping": es,
            "elapsed_s": now(),
        }
        ckpt.save_checkpoint(out, step, model, opt_state, meta, keep=keep_checkpoints)

    step = start
    last_eval: Optional[dict] = None
    train_step = jit_step(optimizer)  # compiled once for the whole run
    show = _Progress(out.name, steps, start, enabled=progress)
    try:
        while step < steps and not es["stopped_early"]:
            batch = to_device(dataset.batch(step, "train"))
            key = jax.random.fold_in(base_key, step)
            model, opt_state, metrics = train_step(model, opt_state, batch, key)
            step += 1
            rec = None
            if step % log_every == 0 or step == steps:
                rec = {"step": step, "split": "train",
                       **{k: float(v) for k, v in metrics.items()}}
                if lr_schedule is not None:
                    rec["lr"] = float(lr_schedule(step - 1))
                rec["time_s"] = round(now(), 3)
                log(rec)
                if not math.isfinite(rec["loss"]):
                    raise FloatingPointError(_divergence_message(rec, out))
            show.update(step, rec)
            if step % eval_every == 0 or step == steps:
                last_eval = evaluate(model, eval_set)
                log({"step": step, "split": "val", **last_eval, "time_s": round(now(), 3)})
                if last_eval["loss"] < es["best_loss"]:
                    es.update(best_loss=last_eval["loss"], best_step=step, bad_evals=0)
                else:
                    es["bad_evals"] += 1
                    if patience and es["bad_evals"] >= patience:
                        es["stopped_early"] = True
            if checkpoint_every and step % checkpoint_every == 0:
                save(step)
    finally:
        show.close()

    records = _read_records(metrics_path)
    if last_eval is None:
        vals = [r for r in records if r.get("split") == "val" and r.get("step") == step]
        last_eval = (
            {k: v for k, v in vals[-1].items() if k not in ("step", "split", "time_s")}
            if vals else evaluate(model, eval_set)
        )
    if not (checkpoint_every and step % checkpoint_every == 0):
        save(step)
    summary = {
        "steps": step,
        "metrics": last_eval,
        "best": {"step": es["best_step"], "loss": es["best_loss"]},
        "stopped_early": bool(es["stopped_early"]),
        "wall_time_s": round(now(), 2),
        **(extra_summary or {}),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    plot_run(records, out)
    return model, summary
