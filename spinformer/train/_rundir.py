"""Run directories: whether a run can go into one, what a resume may change, and the
errors met writing into one.

Faults are reported before any training time is spent where they can be known: a run
directory that is a file, cannot be created or written (permissions, a read-only or full
disk), or holds another run (`check_run_dir`). Each is a `ConfigError` naming the directory
and the fix. A write that fails during training (e.g. the disk fills up) is a `RunDirError`
naming the directory and the newest intact checkpoint to `--resume` from
(`write_errors_named`).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import pathlib
from typing import Optional

from .. import config as _config
from ._checkpoint import list_checkpoints


class RunDirError(_config.ConfigError):
    """A run directory that cannot be used: a file, not creatable or writable (permissions, a
    read-only or full disk), holding another run, or failing a write during training. The
    message names the directory and the fix. A `ConfigError`, so the command line prints it
    as one line."""


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


def resumable(key: str) -> bool:
    """Whether the dotted config key `key` may change on --resume (`train.progress`,
    `description`, `train.mesh` and the keys under it, `train.steps`)."""
    return any(key == k or key.startswith(k + ".") for k in _RESUMABLE_CHANGES)


def changed_keys(old: "_config.Config", new: "_config.Config") -> list[str]:
    """The dotted keys at which `new` differs from `old`, apart from those that may change
    on --resume (`resumable`), in order (a run's config holds only the sections its model
    reads, so a default changed in another family's section does not show)."""
    return [k for k in _diff(_config.to_dict(old), _config.to_dict(new)) if not resumable(k)]


def _run_contents(out: pathlib.Path, cfg: "_config.Config") -> list[str]:
    """What in `out` belongs to a run that a fresh run would overwrite: checkpoints,
    `summary.json`, a non-empty `metrics.jsonl`, or a `config.yaml` of another config."""
    found = []
    saved = out / "config.yaml"
    if saved.exists():
        try:
            other = bool(changed_keys(_config.load_config(saved), cfg))
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
        changed = changed_keys(_config.load_config(saved), cfg)
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
def write_errors_named(out: pathlib.Path):
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


def finished_run(out: pathlib.Path, cfg: "_config.Config") -> Optional[dict]:
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
