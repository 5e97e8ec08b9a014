"""What the trainer needs from a dataset, and the error a dataset raises for a bad file."""

from __future__ import annotations

from typing import Protocol

import numpy as np


class DataFileError(ValueError):
    """A data file that exists but cannot be used: empty, truncated, not text, not in its
    format, or too short for the settings. The message names the file, the line where the
    format has lines, and what is wrong. `spinformer.train.build_dataset` reports it as a
    `ConfigError` on `data.path`, which the command line prints in one line."""


class Dataset(Protocol):
    """The interface `spinformer.train` uses; `BracketMatching` and `CharText` implement it.

    - `kind`: `"tagging"` (one class per position; a `Tagger`) or `"lm"` (next token; a
      `CausalLM`).
    - `vocab_size`, `num_classes`, `seq_len`: sizes the model is built with.
    - `batch(index, split)`: `{"inputs" (B, T) int32, "targets" (B, T) int32,
      "mask" (B, T) float32}` as numpy arrays; it depends only on the seed, the split and
      the index, so a resumed run sees the same data.
    - `baselines(batch)`: reference scores a model should beat on that batch, by name
      (e.g. `{"chance_accuracy": 0.2}`); `{}` when the dataset has none. The trainer stores
      them in `summary.json` under `"baselines"`.
    """

    kind: str
    vocab_size: int
    num_classes: int
    seq_len: int

    def batch(self, index: int, split: str = "train") -> dict[str, np.ndarray]: ...

    def baselines(self, batch: dict[str, np.ndarray]) -> dict[str, float]: ...
