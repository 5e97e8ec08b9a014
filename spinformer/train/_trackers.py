"""Experiment trackers: where a run's records go besides `metrics.jsonl`.

A tracker is anything with `log(record)` (one `metrics.jsonl` record: `step`, `split`,
`time_s` and the metrics), `image(tag, path, step)` (a figure written at the end of the run)
and `close()`. `fit(trackers=[...])` calls them; the loop knows nothing else about them, so a
new tracker is one class. `TensorBoard` is the one shipped (`train.tensorboard: true`).
"""

from __future__ import annotations

import pathlib
from typing import Protocol

__all__ = ["Tracker", "TensorBoard"]

# record keys that are not metrics
_NOT_METRICS = ("step", "split", "time_s")


class Tracker(Protocol):
    def log(self, record: dict) -> None: ...

    def image(self, tag: str, path: pathlib.Path, step: int) -> None: ...

    def close(self) -> None: ...


class TensorBoard:
    """TensorBoard event files in `log_dir` (default `<run>/tensorboard`), written by
    tensorboardX (`pip install -e ".[track]"`): every metric of every record as the scalar
    `<split>/<metric>` at the record's step (per-layer metrics keep their `/<layer>`:
    `train/solver_steps/0`), and each figure of the run as an image at the last step.
    Non-finite values are written too (TensorBoard shows them as gaps)."""

    def __init__(self, log_dir):
        try:
            from tensorboardX import SummaryWriter
        except ImportError:
            raise ImportError("train.tensorboard needs tensorboardX, which is not installed: "
                              "`pip install tensorboardX` (or `pip install -e \".[track]\"`)."
                              ) from None
        self.log_dir = pathlib.Path(log_dir)
        self._writer = SummaryWriter(str(self.log_dir))

    def log(self, record: dict) -> None:
        split, step = record.get("split", "train"), int(record["step"])
        for key, value in record.items():
            if is_metric(key, value):
                self._writer.add_scalar(f"{split}/{key}", float(value), step)
        self._writer.flush()

    def image(self, tag: str, path: pathlib.Path, step: int) -> None:
        import matplotlib.image

        pixels = matplotlib.image.imread(str(path))  # (H, W, 3 or 4) floats in [0, 1]
        self._writer.add_image(tag, pixels[..., :3], step, dataformats="HWC")
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


def is_metric(key: str, value) -> bool:
    """Whether a record entry is written as a scalar (what `TensorBoard.log` writes)."""
    return (key not in _NOT_METRICS and not isinstance(value, bool)
            and isinstance(value, (int, float)))
