"""From a config to a finished run directory.

Faults are reported before any training time is spent where they can be known: a run
directory that is a file, cannot be created or written (permissions, a read-only or full
disk), or holds another run (`check_run_dir`); a data file that is empty, truncated or
malformed, or a model the config cannot build (`build_dataset`, `build_model`). Each is a
`ConfigError` naming the directory, file or key and the fix. A write that fails during
training (e.g. the disk fills up) is a `RunDirError` naming the directory and the newest
intact checkpoint to `--resume` from.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import pathlib
import sys
from typing import Optional, Sequence

import equinox as eqx
import jax

from .. import config as _config
from .. import data as _data
from .. import nn as _nn
from . import _mesh, _orbax
from ._checkpoint import list_checkpoints, load_latest
from ._flops import StepFlops, step_flops
from ._loop import fit
from ._objective import Objective, init_stream_state
from ._optim import make_optimizer, make_schedule, num_params
from ._state import RunState


class RunDirError(_config.ConfigError):
    """A run directory that cannot be used: a file, not creatable or writable (permissions, a
    read-only or full disk), holding another run, or failing a write during training. The
    message names the directory and the fix. A `ConfigError`, so the command line prints it
    as one line."""


def build_dataset(cfg: "_config.Config"):
    """The dataset a config names.

    Raises `FileNotFoundError` for data that is not there (with the fetch or install command),
    and `ConfigError` for data that cannot be used: a `data.DataFileError` (an empty,
    truncated or malformed file, named with the line where the format has lines) as
    `data.path: ...`, and any other refusal of the dataset (e.g. a `data.seq_len` too short
    for the generated pairs) as `data (task ...): ...`.
    """
    d = cfg.data
    try:
        return _make_dataset(d)
    except _data.ImageDataNotFound as e:
        raise FileNotFoundError(str(e)) from None
    except FileNotFoundError:
        raise
    except _data.DataFileError as e:
        raise _config.ConfigError(f"data.path: {e}") from None
    except ImportError as e:  # a dataset whose reader is an optional dependency
        extra = (' (it comes with the notebooks and dev extras: pip install -e ".[notebooks]")'
                 if "scikit-learn" in str(e) else "")
        raise _config.ConfigError(f"data.task={d.task}: {e}{extra}") from None
    except ValueError as e:
        raise _config.ConfigError(f"data (task {d.task}): {e}") from None


def _make_dataset(d: "_config.DataConfig"):
    if d.corrupt is not None and d.task not in ("digits", "fashion_mnist"):
        raise _config.ConfigError(f"data.corrupt={d.corrupt}: only the image tasks (digits, "
                                  f"fashion_mnist) can be reconstructed; data.task is "
                                  f"{d.task}. Use data.corrupt: null.")
    if d.task == "brackets":
        return _data.BracketMatching(seq_len=d.seq_len, batch_size=d.batch_size, seed=d.seed)
    if d.task == "chars":
        return _data.CharText.from_path(
            d.path, seq_len=d.seq_len, batch_size=d.batch_size, seed=d.seed,
            val_fraction=d.val_fraction, test_fraction=d.test_fraction, max_chars=d.max_chars,
            stream=d.stream,
        )
    if d.task == "nli":
        phenomena = tuple(x.strip() for x in d.phenomena.split(",") if x.strip())
        return _data.GeneratedNLI(seq_len=d.seq_len, batch_size=d.batch_size, seed=d.seed,
                                  distractors=d.distractors, held_out=d.held_out,
                                  phenomena=phenomena)
    if d.task == "snli":
        return _data.NLIFile.from_path(d.path, seq_len=d.seq_len, batch_size=d.batch_size,
                                       seed=d.seed, max_vocab=d.max_vocab,
                                       max_examples=d.max_examples)
    if d.task in ("digits", "fashion_mnist"):
        if d.task == "digits":
            images = _data.ImageDataset.digits(batch_size=d.batch_size, seed=d.seed)
        else:
            default = _config.DataConfig.__dataclass_fields__["path"].default
            images = _data.ImageDataset.fashion_mnist(
                None if d.path == default else d.path, batch_size=d.batch_size, seed=d.seed,
                val_size=d.val_size, max_train=d.max_train)
        if d.corrupt is None:
            return images
        return _data.ImageReconstruction(images, d.corrupt, mask_fraction=d.mask_fraction,
                                         noise_variance=d.noise_variance)
    raise _config.ConfigError(f"data.task: unknown task {d.task!r}.")  # pragma: no cover


def build_model(cfg: "_config.Config", dataset, *, key):
    """The model for a config and dataset: a `CausalLM` for text, a `Tagger` for tagging, an
    `ImageClassifier` for images (`model.embed`, `model.residual`, ...), an
    `ImageReconstructor` for corrupted images (`data.corrupt`; `model.embed=patch`), a
    `PairClassifier` for sentence pairs (`model.pool`; the NeuroGame pooled head takes its
    options from `model.neurogame`). With `train.local_losses` the text models stop
    gradients between blocks (`detach_layers=True`).

    The attention is looked up in the registry (`nn.register_attention`); its registration
    turns the config section `model.<attention>` into constructor arguments
    (`Registration.kwargs_from`: the fields by name, solver sections built). A model
    the modules refuse to build (a `ValueError`, e.g. free-energy attention in a causal
    model, or a patch size that does not divide the images) is a `ConfigError` naming the
    attention and the task."""
    m = cfg.model
    reg = _nn.get_attention(m.attention)
    section = m.section(reg.name)
    common = dict(
        dim=m.dim, depth=m.depth, num_heads=m.num_heads, max_len=dataset.seq_len,
        attention=reg.cls, attention_kwargs=reg.kwargs_from(section),
        ffn_hidden=m.ffn_hidden, dropout=m.dropout,
    )
    sequence = dict(detach_layers=cfg.train.local_losses)

    def make(k):
        if dataset.kind == "image_classification":
            return _nn.ImageClassifier(
                tuple(dataset.image_shape), dataset.num_classes, dim=m.dim, depth=m.depth,
                num_heads=m.num_heads, attention=reg.cls,
                attention_kwargs=reg.kwargs_from(section),
                embed=m.embed, patch=m.patch,
                conv_channels=m.conv_channels, residual=m.residual, ffn_hidden=m.ffn_hidden,
                positions=m.positions, dropout=m.dropout, key=k)
        if dataset.kind == "reconstruction":
            if m.embed != "patch":
                raise ValueError("reconstruction maps each patch back to its pixels: use "
                                 "model.embed=patch (with model.patch dividing the image)")
            return _nn.ImageReconstructor(
                tuple(dataset.image_shape), dim=m.dim, depth=m.depth, num_heads=m.num_heads,
                attention=reg.cls, attention_kwargs=reg.kwargs_from(section), patch=m.patch,
                residual=m.residual, ffn_hidden=m.ffn_hidden, positions=m.positions,
                dropout=m.dropout, key=k)
        if dataset.kind == "pair_classification":
            head = _nn.pool_attention(m.pool)
            return _nn.PairClassifier(
                dataset.vocab_size, dataset.num_classes, pool=m.pool,
                pool_kwargs=head.kwargs_from(m.section(head.name)) if head else None,
                key=k, **common)
        if dataset.kind == "lm":
            return _nn.CausalLM(dataset.vocab_size, key=k, **common, **sequence)
        return _nn.Tagger(dataset.vocab_size, dataset.num_classes, causal=True, key=k, **common,
                          **sequence)

    try:
        return make(key)
    except ValueError as e:
        raise _config.ConfigError(f"model.attention={m.attention} with data.task="
                                  f"{cfg.data.task}: {e}") from None


def build_objective(cfg: "_config.Config") -> Objective:
    """What training minimises: the cross-entropy, plus `train.entropy_weight` times the
    entropy production, or with `train.local_losses` the sum of the layers' own losses."""
    return Objective(entropy_weight=cfg.train.entropy_weight,
                     local_losses=cfg.train.local_losses)


def check_objective(cfg: "_config.Config", model, dataset) -> None:
    """Refuse, before training, an objective the model cannot serve: a nonzero
    `train.entropy_weight` with a model that reports no entropy production, or local losses
    or streaming with a model that reports no per-layer outputs or no state. Traced once
    on one example (`jax.eval_shape`: nothing is computed); a `ConfigError` naming the keys."""
    t = cfg.train
    if not (t.entropy_weight or t.local_losses or cfg.data.stream):
        return
    batch = dataset.batch(0, "train")
    x = jax.numpy.asarray(batch["inputs"][0])
    diag = eqx.filter_eval_shape(lambda m, x: m(x, return_diagnostics=True)[1], model, x)
    if t.entropy_weight and getattr(diag, "entropy_production", None) is None:
        raise _config.ConfigError(
            f"train.entropy_weight={t.entropy_weight}: the model for data.task={cfg.data.task} "
            f"with model.attention={cfg.model.attention} reports no entropy production; use "
            "model.attention=spin, or train.entropy_weight=0.")
    if t.local_losses and (getattr(diag, "hidden", None) is None
                           or not hasattr(model, "layer_logits")):
        raise _config.ConfigError(
            f"train.local_losses=true: the model for data.task={cfg.data.task} with "
            f"model.attention={cfg.model.attention} has no per-layer readouts; use "
            "train.local_losses=false.")
    if cfg.data.stream and getattr(diag, "state", None) is None:
        raise _config.ConfigError(  # pragma: no cover - the config already checks this
            f"data.stream=true: model.attention={cfg.model.attention} carries no state.")


def build_mesh(cfg: "_config.Config"):
    """The device mesh of `train.mesh` (None on a single device with no mesh asked for:
    training then runs unsharded, as it always has). Raises `ConfigError` when the mesh does
    not fit the devices or `data.batch_size` does not split over its `data` axis."""
    if cfg.train.mesh is None and jax.device_count() == 1:
        return None
    mesh = _mesh.make_mesh(cfg.train.mesh)
    _mesh.check_batch_size(cfg.data.batch_size, mesh)
    return mesh


def resolve_checkpointer(cfg: "_config.Config", mesh) -> str:
    """`train.checkpointer`, with `auto` made concrete: orbax when parameters are split over a
    `model` axis and there are several processes (no process holds whole arrays), native
    otherwise."""
    kind = cfg.train.checkpointer
    if kind == "auto":
        split = mesh is not None and mesh.shape["model"] > 1 and jax.process_count() > 1
        kind = "orbax" if split else "native"
    return kind


def build_optimizer(cfg: "_config.Config"):
    t = cfg.train
    return make_optimizer(
        steps=t.steps, lr=t.lr, coupling_lr=t.coupling_lr, weight_decay=t.weight_decay,
        coupling_weight_decay=t.coupling_weight_decay,
        warmup_steps=t.warmup_steps, min_lr_ratio=t.min_lr_ratio, grad_clip=t.grad_clip,
    )


def _diff(a: dict, b: dict, prefix="") -> list[str]:
    keys = []
    for k in sorted(set(a) | set(b)):
        va, vb = a.get(k), b.get(k)
        if isinstance(va, dict) and isinstance(vb, dict):
            keys += _diff(va, vb, prefix + k + ".")
        elif va != vb:
            keys.append(prefix + k)
    return keys


# Keys that may change on --resume, each with everything under it: how progress is shown,
# the description, the device mesh (a run may continue on another number of devices), and the
# number of steps (a run continued further; checked against its checkpoints).
_RESUMABLE_CHANGES = ("train.progress", "description", "train.mesh", "train.steps")


def _resumable(key: str) -> bool:
    return any(key == k or key.startswith(k + ".") for k in _RESUMABLE_CHANGES)


def _changed_keys(saved: pathlib.Path, cfg: "_config.Config") -> list[str]:
    """The dotted keys at which `cfg` differs from the config saved in `saved`, apart from
    those that may change on --resume (a run's config holds only the sections its model
    reads, so a default changed in another family's section does not show)."""
    old = _config.to_dict(_config.load_config(saved))
    return [k for k in _diff(old, _config.to_dict(cfg)) if not _resumable(k)]


def _run_contents(out: pathlib.Path, cfg: "_config.Config") -> list[str]:
    """What in `out` belongs to a run that a fresh run would overwrite: checkpoints,
    `summary.json`, a non-empty `metrics.jsonl`, or a `config.yaml` of another config."""
    found = []
    saved = out / "config.yaml"
    if saved.exists():
        try:
            other = bool(_changed_keys(saved, cfg))
        except (_config.ConfigError, OSError, UnicodeDecodeError):
            other = True  # unreadable, or written by an older schema
        if other:
            found.append("config.yaml (of another config)")
    ckpts = list_checkpoints(out)
    if ckpts:
        found.append(f"{len(ckpts)} checkpoint(s), the newest of step {ckpts[-1][0]}")
    if (out / "summary.json").exists():
        found.append("summary.json")
    metrics = out / "metrics.jsonl"
    if metrics.is_file() and metrics.stat().st_size > 0:
        found.append("metrics.jsonl")
    return found


def _os_reason(e: OSError, out: pathlib.Path) -> tuple[str, str]:
    """`(what went wrong, how to fix it)` for an `OSError` met writing into `out`."""
    if e.errno == errno.ENOSPC:
        return (f"the disk holding {out} is full (no space left on device)",
                "free some space, or choose another --out on a disk with room")
    if e.errno == getattr(errno, "EDQUOT", None):
        return (f"the disk quota for {out} is exceeded", "free some space, or choose another "
                "--out")
    if e.errno == errno.EROFS:
        return f"{out} is on a read-only file system", "choose another --out"
    if e.errno in (errno.EACCES, errno.EPERM):
        return (f"{out} is not writable (permission denied)",
                "choose another --out, or make the directory writable")
    return (f"{out} cannot be written ({e.strerror or e})", "choose another --out")


def _write_probe(path: pathlib.Path) -> None:
    """Create `path` and write, flush and sync a few bytes into it (the probe that shows a
    directory takes files; the caller removes it)."""
    with open(path, "xb") as f:
        f.write(b"spinformer write test\n" * 64)
        f.flush()
        os.fsync(f.fileno())


def check_run_dir(out_dir, cfg: "_config.Config", *, resume: bool = False,
                  write: bool = True) -> pathlib.Path:
    """Check that the run `cfg` can go into `out_dir`, before anything is built or trained.

    - A path that is a file, or lies under one, is refused.
    - Without `resume`, a directory that holds another run is refused, so that nothing is
      overwritten: one with checkpoints, a `summary.json`, a non-empty `metrics.jsonl`, or a
      `config.yaml` of another config. This includes a run of the same config: starting it
      afresh would overwrite its metrics and checkpoints. The message names the directory,
      what it holds and both ways on: `--resume` (continue that run) or another `--out`. A
      directory with only other files (logs, notes), an empty `metrics.jsonl` or the same
      config is used as it is.
    - With `resume`, the saved `config.yaml` must equal `cfg` apart from `train.progress`,
      `description`, `train.mesh` (and its keys: a run may resume on other devices),
      `train.steps`, which may grow (a finished run continued; not below its newest
      checkpoint's step).
    - With `write` (the process that writes; with several processes only process 0), the
      directory is created with its parents and probed: a small file is written, synced and
      removed. A directory that cannot be created or written (permission denied, read-only
      file system, full disk) is refused, naming the directory and the reason.

    **Returns:** `out_dir` as a `pathlib.Path`. Raises `RunDirError` (a `ConfigError`), or
    `ConfigError` for a config that differs on resume.
    """
    out = pathlib.Path(out_dir)
    above = next((p for p in (out, *out.parents) if p.exists() or p.is_symlink()), None)
    if above is not None and not above.is_dir():
        where = "is a file" if above == out else f"lies under {above}, which is a file"
        raise RunDirError(f"run directory {out} {where}, not a directory; choose another "
                          "--out.")
    saved = out / "config.yaml"
    if resume and saved.exists():
        changed = _changed_keys(saved, cfg)
        if changed:
            raise _config.ConfigError(
                f"--resume: the config differs from the one saved in {saved} at "
                f"{', '.join(changed)}; resume with the same config, or start a new run with "
                "another --out."
            )
        ckpts = list_checkpoints(out)
        if ckpts and ckpts[-1][0] > cfg.train.steps:
            raise _config.ConfigError(
                f"--resume: train.steps={cfg.train.steps}, but the run in {out} has taken "
                f"{ckpts[-1][0]} steps already; a run can be continued to more steps, not "
                "fewer.")
    if not resume and out.is_dir():
        found = _run_contents(out, cfg)
        if found:
            raise RunDirError(
                f"run directory {out} already holds a run ({'; '.join(found)}); a new run "
                "would overwrite it. Continue that run with --resume, or start this one in "
                "another directory with --out."
            )
    if not write:
        return out
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        reason, fix = _os_reason(e, out)
        raise RunDirError(f"run directory {out} cannot be created: {reason}; {fix}.") from None
    probe = out / f".spinformer-write-test-{os.getpid()}"
    try:
        _write_probe(probe)
    except OSError as e:
        reason, fix = _os_reason(e, out)
        raise RunDirError(f"run directory {out} cannot take files: {reason}; {fix}.") from None
    finally:
        with contextlib.suppress(OSError):
            probe.unlink()
    return out


@contextlib.contextmanager
def _write_errors_named(out: pathlib.Path):
    """Turn an `OSError` met writing into `out` during training (a full disk, a directory
    removed or made read-only) into a `RunDirError` naming the directory and the newest
    intact checkpoint; partly written checkpoint files are removed."""
    try:
        yield
    except OSError as e:
        filename = getattr(e, "filename", None)
        if filename:
            target, root = pathlib.Path(os.fsdecode(filename)).resolve(), out.resolve()
            if target != root and root not in target.parents:
                raise  # not a write into the run directory
        for tmp in out.glob("ckpt-*.ckpt.tmp"):
            with contextlib.suppress(OSError):
                tmp.unlink()
        reason, fix = _os_reason(e, out)
        ckpts = list_checkpoints(out)
        kept = (f"its newest intact checkpoint is {ckpts[-1][1].name} (step {ckpts[-1][0]}; "
                "checkpoints are written atomically)" if ckpts else "no checkpoint was written "
                "yet")
        raise RunDirError(
            f"training stopped: writing to run directory {out} failed: {reason}"
            f"{f' (writing {filename})' if filename else ''}; {kept}. To go on, {fix}, "
            "and continue with --resume."
        ) from e


# The modules a run was trained with `--import` (they register its attention), beside its
# config.yaml: whatever reads the config again (diagnose, generate, --resume) imports them first.
IMPORTS_FILE = "imports.json"


def import_modules(names: Sequence[str], *, search: Sequence[str] = (),
                   where: str = "--import") -> None:
    """Import each module: a path to a `.py` file, or a dotted name found on `sys.path`
    with the current directory first, then the directories `search`. A `.py` file already
    imported from the same path is not run again (what it registered stands). A module
    that cannot be imported is a `ConfigError` naming `where`, the module and the error."""
    import importlib
    import importlib.util

    for name in names:
        try:
            path = pathlib.Path(name)
            if name.endswith(".py"):
                if not path.is_file():
                    raise FileNotFoundError(f"no file {name}")
                loaded = sys.modules.get(path.stem)
                if (loaded is not None and getattr(loaded, "__file__", None)
                        and pathlib.Path(loaded.__file__).resolve() == path.resolve()):
                    continue
                spec = importlib.util.spec_from_file_location(path.stem, path)
                module = importlib.util.module_from_spec(spec)
                sys.modules[path.stem] = module
                spec.loader.exec_module(module)
            else:
                if "" not in sys.path and str(pathlib.Path.cwd()) not in sys.path:
                    sys.path.insert(0, str(pathlib.Path.cwd()))
                sys.path.extend(d for d in search if d not in sys.path)
                importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 - any failure of the user's module is reported
            raise _config.ConfigError(f"{where} {name}: {type(e).__name__}: {e}") from None


def record_imports(out: pathlib.Path, names: Sequence[str]) -> None:
    """Add the `--import` modules of a run to `out/imports.json` (kept on --resume): `.py`
    paths made absolute, dotted names with the directory they were imported from."""
    if not names:
        return
    path = out / IMPORTS_FILE
    rec = json.loads(path.read_text()) if path.exists() else {"modules": [], "search": []}
    for name in names:
        entry = str(pathlib.Path(name).resolve()) if name.endswith(".py") else name
        if entry not in rec["modules"]:
            rec["modules"].append(entry)
    cwd = str(pathlib.Path.cwd())
    if cwd not in rec["search"] and any(not n.endswith(".py") for n in names):
        rec["search"].append(cwd)
    path.write_text(json.dumps(rec, indent=2) + "\n")


def import_run_modules(run_dir) -> list[str]:
    """Import the modules a run was trained with (`record_imports`), so that its config
    reads again; returns their names (none for a run without `--import`)."""
    path = pathlib.Path(run_dir) / IMPORTS_FILE
    if not path.exists():
        return []
    try:
        rec = json.loads(path.read_text())
        modules, search = list(rec["modules"]), list(rec.get("search", []))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise _config.ConfigError(f"{path}: unreadable ({e}); it lists the modules the run "
                                  "was trained with (--import).") from None
    import_modules(modules, search=search, where=f"{path} (the run's --import):")
    return modules


def describe(cfg: "_config.Config") -> str:
    """What a run trains, read from the config itself (the `description` of `summary.json`):
    the config file's own `description` is written for its defaults, and says nothing of
    `--set model.attention=softmax`."""
    m = cfg.model
    heads = f"{m.num_heads} head{'s' if m.num_heads != 1 else ''}"
    return (f"{m.attention} attention, data.task {cfg.data.task}: width {m.dim}, depth "
            f"{m.depth}, {heads}, {cfg.train.steps} steps")


def _finished(out: pathlib.Path, cfg: "_config.Config") -> Optional[dict]:
    """The saved summary of a run in `out` that has nothing left to do for `cfg` (it reached
    `train.steps` or stopped early), marked `"nothing_to_do": True`; None otherwise."""
    path = out / "summary.json"
    if not path.exists():
        return None
    try:
        summary = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if summary.get("steps", 0) < cfg.train.steps and not summary.get("stopped_early"):
        return None
    return {**summary, "nothing_to_do": True}


def _build(cfg: "_config.Config"):
    """`(mesh, dataset, model, optimizer)`: what `run` builds from `cfg` before its first
    step (each step's errors name the config key at fault); nothing is compiled."""
    mesh = build_mesh(cfg)
    dataset = build_dataset(cfg)
    model = build_model(cfg, dataset, key=jax.random.key(cfg.train.seed))
    check_objective(cfg, model, dataset)
    return mesh, dataset, model, build_optimizer(cfg)


def run(cfg: "_config.Config", out_dir, *, resume: bool = False, progress: Optional[bool] = None,
        imports: Sequence[str] = (), flops: Optional[StepFlops] = None):
    """Train the experiment `cfg` into `out_dir` (see `fit`); returns the summary dict.

    The run directory is checked first (`train._experiment.check_run_dir`): without `resume`
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
    done = _finished(out, cfg) if resume else None
    if done is not None:
        check_run_dir(out, cfg, resume=True, write=False)
        return done
    try:
        check_run_dir(out, cfg, resume=resume, write=_mesh.is_writer())
        mesh, dataset, model, optimizer = _build(cfg)
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
    trackers = []
    if t.tensorboard and _mesh.is_writer():
        from ._trackers import TensorBoard

        try:
            trackers.append(TensorBoard(out / "tensorboard"))
        except ImportError as e:
            raise _config.ConfigError(f"train.tensorboard=true: {e}") from None
    extra = {
        "num_params": num_params(model),
        "description": describe(cfg),
        "config_description": cfg.description,
        "baselines": dataset.baselines(dataset.batch(0, "val")),
    }
    with _write_errors_named(out), contextlib.ExitStack() as closing:
        for tracker in trackers:
            closing.callback(tracker.close)
        _, summary = fit(
            model, optimizer, dataset, out_dir=out, steps=t.steps, seed=t.seed,
            eval_batches=cfg.data.eval_batches, log_every=t.log_every, eval_every=t.eval_every,
            patience=t.patience, checkpoint_every=t.checkpoint_every,
            keep_checkpoints=t.keep_checkpoints, resume=resume,
            progress=t.progress if progress is None else progress,
            lr_schedule=make_schedule(t.lr, t.steps, t.warmup_steps, t.min_lr_ratio),
            extra_summary=extra, max_bad_steps=t.max_bad_steps, accumulate=t.accumulate,
            precision=t.precision, mesh=mesh, checkpointer=resolve_checkpointer(cfg, mesh),
            objective=build_objective(cfg), stream=cfg.data.stream, trackers=trackers,
            flops=(flops or step_flops(cfg, dataset)) if t.count_flops else None,
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
    model = build_model(cfg, dataset, key=jax.random.key(cfg.train.seed))
    # the run state its checkpoints hold (a streaming run's also the carried stream state)
    stream = init_stream_state(model, dataset.batch(0, "train")) if cfg.data.stream else None
    like = RunState.init(model, build_optimizer(cfg), stream=stream)
    got = load_latest(run_dir, like)
    if got is None and _orbax.OrbaxCheckpoints(run_dir).exists():  # a sharded run's
        got = _orbax.OrbaxCheckpoints(run_dir).restore_latest(like)
    if got is None:
        raise FileNotFoundError(f"{run_dir}: no checkpoint to load (the run wrote none yet).")
    state, _ = got
    return cfg, dataset, state.model
