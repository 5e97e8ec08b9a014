"""From a config to a finished run directory (`run`), and back to its trained model
(`load_run`).

`run` checks the run directory (`train._rundir`), builds the run's objects from the config
(`train._build`), records the config and the `--import`ed modules (`train._plugins`) and
trains (`fit`); `load_run` reads a run directory's config and newest checkpoint.
"""

from __future__ import annotations

import contextlib
import dataclasses
import pathlib
from typing import Optional, Sequence

import equinox as eqx
import jax

from .. import config as _config
from . import _mesh, _orbax
from ._build import (
    build_dataset,
    build_mesh,
    build_model,
    build_optimizer,
    check_objective,
)
from ._checkpoint import load_latest
from ._flops import StepFlops, step_flops
from ._loop import fit
from ._objective import init_stream_state
from ._optim import num_params
from ._plugins import import_run_modules, record_imports
from ._rundir import check_run_dir, finished_run, write_errors_named
from ._state import RunState


def describe(cfg: "_config.Config") -> str:
    """What a run trains, read from the config itself (the `description` of `summary.json`):
    the config file's own `description` is written for its defaults, and says nothing of
    `--set model.attention=softmax`."""
    m = cfg.model
    heads = f"{m.num_heads} head{'s' if m.num_heads != 1 else ''}"
    return (f"{m.attention.name} attention, data.task {cfg.data.task}: width {m.dim}, depth "
            f"{m.depth}, {heads}, {cfg.train.steps} steps")


def _objects(cfg: "_config.Config"):
    """`(dataset, model)`: what `run` builds from `cfg` before its first step, after checking
    that its device mesh fits (`build_mesh`; `fit` makes the same mesh). Each step's errors
    name the config key at fault; nothing is compiled."""
    build_mesh(cfg)
    dataset = build_dataset(cfg)
    model = build_model(cfg, dataset, key=jax.random.key(cfg.train.seed))
    check_objective(cfg, model, dataset)
    return dataset, model


def run(cfg: "_config.Config", out_dir, *, resume: bool = False, progress: Optional[bool] = None,
        imports: Sequence[str] = (), flops: Optional[StepFlops] = None):
    """Train the experiment `cfg` into `out_dir` (see `fit`); returns the summary dict.

    The run directory is checked first (`train._rundir.check_run_dir`): without `resume`
    it must not hold another run, and it must be writable. The resolved config is saved as
    `out_dir/config.yaml`. With `resume=True` the saved config must match `cfg` (apart from
    `train.progress`, `description`, `train.mesh` and a larger `train.steps`), and training
    continues from the newest intact checkpoint; a run that is already finished (its
    `summary.json` reached `train.steps`, or it stopped early) is not touched, and its summary
    is returned with `"nothing_to_do": True`. Resuming with a larger `train.steps` continues
    a finished run (the learning-rate schedule is then the longer run's: its cosine decay is
    stretched to the new length, so the rate steps up where the run resumes). A write that
    fails during training (a full disk) is a `RunDirError` naming the directory and the
    checkpoint to resume from. `imports`: the modules imported for this run (the command
    line's `--import`), recorded in `out_dir/imports.json` for those who read its config
    again (`load_run`, `--resume`). `flops`: the step's FLOP count (`step_flops(cfg)`) when
    it is already known, as a grid's price holds it; with `train.count_flops` and no `flops`
    the run counts it, lowering the step once per straight-line variant (`step_flops`).
    """
    out = pathlib.Path(out_dir)
    saved = out / "config.yaml"
    created = not out.exists()
    done = finished_run(out, cfg) if resume else None
    if done is not None:
        check_run_dir(out, cfg, resume=True, write=False)
        return done
    try:
        check_run_dir(out, cfg, resume=resume, write=_mesh.is_writer())
        dataset, model = _objects(cfg)
    except BaseException:
        if created:  # leave no empty directory behind for a run that never started
            with contextlib.suppress(OSError):
                out.rmdir()
        raise
    if _mesh.is_writer():  # with several processes only process 0 writes
        out.mkdir(parents=True, exist_ok=True)
        _config.save_config(cfg, saved)
        record_imports(out, imports)
        if callable(getattr(dataset, "save", None)):  # e.g. the vocabulary of a tokenizer
            dataset.save(out)
    t = cfg.train
    options = t if progress is None else dataclasses.replace(t, progress=progress)
    extra = {
        "num_params": num_params(model),
        "description": describe(cfg),
        "config_description": cfg.description,
        "baselines": dataset.baselines(dataset.batch(0, "val")),
    }
    with write_errors_named(out):
        _, summary = fit(
            model, dataset, options, out_dir=out, resume=resume,
            eval_batches=cfg.data.eval_batches, stream=cfg.data.stream,
            flops=(flops or step_flops(cfg, dataset)) if t.count_flops else None,
            extra_summary=extra,
        )
    return summary


def load_run(run_dir, *, dataset=None):
    """The trained model of a run directory: `(cfg, dataset, model)` from its saved
    `config.yaml` and newest intact checkpoint, native or orbax (raises
    `FileNotFoundError` if there is none). The one run loader: diagnose, generate and the
    experiment scripts use it.

    **Arguments:** `run_dir`; `dataset`: what `build_model` needs of the data (its sizes),
    when building the dataset itself is not wanted (generation reads a saved vocabulary);
    default `build_dataset(cfg)`."""
    run_dir = pathlib.Path(run_dir)
    saved = run_dir / "config.yaml"
    if not saved.exists():
        raise FileNotFoundError(f"{run_dir}: no config.yaml; is this a run directory?")
    import_run_modules(run_dir)  # a run trained with --import: its attention's module
    cfg = _config.load_config(saved)
    dataset = build_dataset(cfg) if dataset is None else dataset
    batch = dataset.batch(0, "train") if cfg.data.stream else None

    def shape_of_state():  # the run state its checkpoints hold (a streaming run's also
        # the carried stream state); only its shapes are built: the checkpoint has every
        # value, and building the model's arrays would compile some 50 small programs
        model = build_model(cfg, dataset, key=jax.random.key(cfg.train.seed))
        stream = init_stream_state(model, batch) if batch is not None else None
        return RunState.init(model, build_optimizer(cfg), stream=stream)

    like = eqx.filter_eval_shape(shape_of_state)
    got = load_latest(run_dir, like)
    if got is None and _orbax.OrbaxCheckpoints(run_dir).exists():  # a sharded run's
        got = _orbax.OrbaxCheckpoints(run_dir).restore_latest(like)
    if got is None:
        raise FileNotFoundError(f"{run_dir}: no checkpoint to load (the run wrote none yet).")
    state, _ = got
    return cfg, dataset, state.model
