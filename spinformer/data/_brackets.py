"""Bracket matching: Dyck-1 words interleaved with filler tokens (Boltzmann-attention seed,
§4.3). For each closing bracket the target is the position of its matching opening bracket;
only closing brackets count in the loss and the accuracy."""

from __future__ import annotations

import numpy as np

OPEN, CLOSE = 0, 1
NUM_FILLERS = 10
VOCAB_SIZE = 2 + NUM_FILLERS  # "(", ")" and ten filler tokens: 12 in all
_SPLITS = {"train": 0, "val": 1, "test": 2}


def _split_id(split: str) -> int:
    if split not in _SPLITS:
        raise ValueError(f"unknown split {split!r}; choose one of {sorted(_SPLITS)}.")
    return _SPLITS[split]


def sample_brackets(rng: np.random.Generator, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """One sequence: `(tokens (T,), targets (T,))`, targets −1 except at closing brackets.

    The number of pairs is uniform in 1..T//2; their 2n positions are a uniform random subset
    of the T positions; the bracket word is a random Dyck-1 word (each still-open prefix opens
    with probability ½ while openings remain); the other positions get uniform filler tokens.
    """
    if seq_len < 2:
        raise ValueError(f"bracket matching needs seq_len >= 2; got {seq_len}.")
    n_pairs = int(rng.integers(1, seq_len // 2 + 1))
    positions = np.sort(rng.choice(seq_len, size=2 * n_pairs, replace=False))
    tokens = rng.integers(2, VOCAB_SIZE, size=seq_len)
    targets = np.full(seq_len, -1, dtype=np.int32)
    coins = rng.random(2 * n_pairs)
    stack: list[int] = []
    opens_left = n_pairs
    for pos, coin in zip(positions, coins):
        if opens_left > 0 and (not stack or coin < 0.5):
            tokens[pos] = OPEN
            stack.append(int(pos))
            opens_left -= 1
        else:
            tokens[pos] = CLOSE
            targets[pos] = stack.pop()
    return tokens.astype(np.int32), targets


class BracketMatching:
    """Deterministic batches of the bracket-matching task.

    **Arguments:**

    - `seq_len`: sequence length T (the number of classes is T: a target is a position).
    - `batch_size`: examples per batch.
    - `seed`: batch `i` of split `s` depends only on `(seed, s, i)`.

    `batch(i, split)` returns a dict of numpy arrays: `inputs (B, T)` int32, `targets (B, T)`
    int32 (0 where unused), `mask (B, T)` float32 (1 at closing brackets). `baselines(batch)`
    gives the chance and nearest-opening-bracket accuracies.
    """

    kind = "tagging"

    def __init__(self, seq_len: int = 12, batch_size: int = 32, seed: int = 0):
        if seq_len < 2:
            raise ValueError(f"bracket matching needs seq_len >= 2; got {seq_len}.")
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.seed = seed
        self.vocab_size = VOCAB_SIZE
        self.num_classes = seq_len

    def batch(self, index: int, split: str = "train") -> dict[str, np.ndarray]:
        rng = np.random.default_rng([self.seed, _split_id(split), index])
        toks, tgts = zip(*(sample_brackets(rng, self.seq_len) for _ in range(self.batch_size)))
        tokens, targets = np.stack(toks), np.stack(tgts)
        mask = (targets >= 0).astype(np.float32)
        return {"inputs": tokens, "targets": np.maximum(targets, 0), "mask": mask}

    def nearest_open_baseline(self, batch: dict[str, np.ndarray]) -> float:
        """Accuracy of guessing the closest preceding opening bracket (a reference above
        chance: right for every innermost pair)."""
        toks, tgts, mask = batch["inputs"], batch["targets"], batch["mask"]
        correct = total = 0.0
        for b in range(toks.shape[0]):
            last = -1
            for t in range(toks.shape[1]):
                if mask[b, t]:
                    correct += float(last == tgts[b, t])
                    total += 1
                if toks[b, t] == OPEN:
                    last = t
        return correct / max(total, 1.0)

    def chance_accuracy(self, batch: dict[str, np.ndarray]) -> float:
        """Expected accuracy of a uniform guess over the positions before each closing
        bracket (what a causal model knows without learning)."""
        t_idx = np.arange(batch["mask"].shape[1])[None, :]
        return float((batch["mask"] / np.maximum(t_idx, 1)).sum() / batch["mask"].sum())

    def baselines(self, batch: dict[str, np.ndarray]) -> dict[str, float]:
        """`chance_accuracy` and `nearest_open_accuracy` on `batch` (see the two methods)."""
        return {
            "chance_accuracy": self.chance_accuracy(batch),
            "nearest_open_accuracy": self.nearest_open_baseline(batch),
        }
