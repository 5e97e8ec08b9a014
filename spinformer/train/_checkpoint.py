"""Checkpoints: written atomically with a checksum; a damaged one is skipped for the previous.

File layout (`ckpt-00000200.ckpt`): a magic line, one line of JSON (step, metadata, payload
size and SHA-256), then the payload: `eqx.tree_serialise_leaves` of `(model, opt_state)`.
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

MAGIC = b"SPINFORMER-CKPT 1\n"
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


def save_checkpoint(directory, step: int, model, opt_state, meta: dict[str, Any],
                    keep: int = 3) -> pathlib.Path:
    """Write `(model, opt_state)` and `meta` for `step`; keep only the `keep` newest files.

    The file appears under its final name only once fully written and synced (write to a
    temporary file, fsync, `os.replace`), so a killed process leaves the previous checkpoints
    intact.
    """
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    eqx.tree_serialise_leaves(buf, (model, opt_state))
    payload = buf.getvalue()
    header = {
        "step": int(step),
        "meta": meta,
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


def read_checkpoint(path, like) -> tuple[int, Any, Any, dict]:
    """Read one checkpoint into the structure of `like = (model, opt_state)`.

    **Returns:** `(step, model, opt_state, meta)`. Raises `CorruptCheckpoint` if the file is
    truncated, its checksum does not match, or it does not fit `like`.
    """
    path = pathlib.Path(path)
    data = path.read_bytes()
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
        model, opt_state = eqx.tree_deserialise_leaves(io.BytesIO(payload), like)
    except Exception as e:  # structure/shape mismatch
        raise CorruptCheckpoint(f"{path}: does not fit this model/optimizer: {e}") from e
    return int(header["step"]), model, opt_state, header.get("meta", {})


def load_latest(directory, like) -> Optional[tuple[int, Any, Any, dict]]:
    """The newest readable checkpoint in `directory` (damaged ones are reported with a
    warning and skipped), or None if there is none."""
    for step, path in reversed(list_checkpoints(directory)):
        try:
            return read_checkpoint(path, like)
        except (CorruptCheckpoint, OSError) as e:
            warnings.warn(f"skipping checkpoint: {e}; trying the previous one.", stacklevel=2)
    return None
