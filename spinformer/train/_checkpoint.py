"""Checkpoints: written atomically with a checksum; a damaged one is skipped for the previous.

File layout (`ckpt-00000200.ckpt`): a magic line (`SPINFORMER-CKPT 2`), one line of JSON
(step, metadata, the carried stream state's shape and dtype or null, payload size and
SHA-256), then the payload: `eqx.tree_serialise_leaves` of the `RunState` (model, optimizer
state, stream state if any, step).

Version 1 files (`SPINFORMER-CKPT 1`, written for a few days before `RunState` held the step)
are refused with a message that says so.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pathlib
import re
import warnings
from typing import Any, Optional

import equinox as eqx
import jax.numpy as jnp
import numpy as np

from ._state import RunState, host_step

MAGIC = b"SPINFORMER-CKPT 2\n"
MAGIC_V1 = b"SPINFORMER-CKPT 1\n"
_NAME = re.compile(r"^ckpt-(\d{8})\.ckpt$")


class CorruptCheckpoint(RuntimeError):
    """A checkpoint file that is truncated, altered, or not a checkpoint."""


def checkpoint_path(directory, step: int) -> pathlib.Path:
    return pathlib.Path(directory) / f"ckpt-{step:08d}.ckpt"


def list_checkpoints(directory) -> list[tuple[int, pathlib.Path]]:
    """`(step, path)` of the checkpoint files in `directory`, oldest first."""
    d = pathlib.Path(directory)
    if not d.is_dir():
        return []
    out = []
    for p in d.iterdir():
        m = _NAME.match(p.name)
        if m:
            out.append((int(m.group(1)), p))
    return sorted(out)


def save_checkpoint(directory, state: RunState, meta: dict[str, Any],
                    keep: int = 3) -> pathlib.Path:
    """Write the `RunState` `state` and `meta` as the checkpoint of step `int(state.step)`;
    keep only the `keep` newest files. Returns its path.

    The file appears under its final name only once fully written and synced (write to a
    temporary file, fsync, `os.replace`), so a killed process leaves the previous checkpoints
    intact.
    """
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    step = host_step(state)
    buf = io.BytesIO()
    eqx.tree_serialise_leaves(buf, state)
    payload = buf.getvalue()
    stream = None if state.stream is None else np.shape(state.stream)
    header = {
        "step": step,
        "meta": meta,
        "stream": None if stream is None else {"shape": list(stream),
                                               "dtype": str(np.dtype(state.stream.dtype))},
        "payload_bytes": len(payload),
        "sha256": hashlib.sha256(payload).hexdigest(),
    }
    path = checkpoint_path(directory, step)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(MAGIC)
        f.write(json.dumps(header).encode() + b"\n")
        f.write(payload)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    try:
        fd = os.open(directory, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
    except OSError:  # pragma: no cover - directories cannot be fsynced on some systems
        pass
    for _, old in list_checkpoints(directory)[:-keep]:
        old.unlink(missing_ok=True)
    return path


def read_checkpoint(path, like: RunState) -> tuple[RunState, dict]:
    """Read one checkpoint into the structure of `like` (a `RunState`, e.g.
    `RunState.init(model, optimizer)`; only its structure, shapes and dtypes matter).

    A checkpoint of a streaming run read with `like.stream` None still returns its carried
    stream state.

    **Returns:** `(state, meta)`. Raises `CorruptCheckpoint` if the file is truncated, its
    checksum does not match, or it does not fit `like`.
    """
    path = pathlib.Path(path)
    data = path.read_bytes()
    if data.startswith(MAGIC_V1):
        raise CorruptCheckpoint(f"{path}: a version 1 checkpoint (written before the run "
                                "state held its step), which this version does not read; "
                                "start the run again.")
    if not data.startswith(MAGIC):
        raise CorruptCheckpoint(f"{path}: not a spinformer checkpoint (bad magic).")
    rest = data[len(MAGIC):]
    nl = rest.find(b"\n")
    if nl < 0:
        raise CorruptCheckpoint(f"{path}: truncated header.")
    try:
        header = json.loads(rest[:nl])
    except json.JSONDecodeError as e:
        raise CorruptCheckpoint(f"{path}: unreadable header ({e}).") from e
    payload = rest[nl + 1:]
    if len(payload) != header.get("payload_bytes"):
        raise CorruptCheckpoint(
            f"{path}: truncated: {len(payload)} of {header.get('payload_bytes')} payload bytes."
        )
    if hashlib.sha256(payload).hexdigest() != header.get("sha256"):
        raise CorruptCheckpoint(f"{path}: checksum mismatch (the file was altered).")
    try:
        stream = header.get("stream")
        if like.stream is None and stream is not None:  # read the file's stream state
            like = eqx.tree_at(lambda s: s.stream, like,
                               jnp.zeros(stream["shape"], stream["dtype"]),
                               is_leaf=lambda x: x is None)
        state = eqx.tree_deserialise_leaves(io.BytesIO(payload), like)
    except Exception as e:  # structure/shape mismatch
        raise CorruptCheckpoint(f"{path}: does not fit this model/optimizer: {e}") from e
    if host_step(state) != int(header["step"]):
        raise CorruptCheckpoint(f"{path}: the payload's step {host_step(state)} is not the "
                                f"header's {header['step']}.")
    return state, header.get("meta", {})


def load_latest(directory, like: RunState) -> Optional[tuple[RunState, dict]]:
    """`(state, meta)` of the newest readable checkpoint in `directory`, read into the
    structure of `like` (see `read_checkpoint`; newer damaged ones are reported with a
    warning and skipped), or None if there is none. Raises `CorruptCheckpoint` when there
    are checkpoints but none can be read into `like` (damaged, or of another model or
    optimizer), naming the newest one's fault."""
    faults = []
    for step, path in reversed(list_checkpoints(directory)):
        try:
            got = read_checkpoint(path, like)
        except (CorruptCheckpoint, OSError) as e:
            faults.append(e)
            continue
        for e in faults:
            warnings.warn(f"skipping checkpoint: {e}; using an older one.", stacklevel=2)
        return got
    if faults:
        raise CorruptCheckpoint(
            f"{directory}: no checkpoint there can be read into this model and optimizer "
            f"({len(faults)} tried); the newest: {faults[0]}")
    return None
