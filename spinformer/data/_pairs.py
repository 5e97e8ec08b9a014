"""What both NLI sources share: the labels, the tokenizer and vocabulary, packing a
premise and hypothesis into one row of token and segment ids, and the baselines (see
`_nli` for the batch format)."""

from __future__ import annotations

import json
import os
import pathlib
import re
from collections import Counter
from typing import Iterable, Sequence, Union

import numpy as np

NLI_LABELS = ("entailment", "neutral", "contradiction")
ENTAILMENT, NEUTRAL, CONTRADICTION = 0, 1, 2
_LABEL_ID = {name: i for i, name in enumerate(NLI_LABELS)}
PAD, CLS, SEP, UNK = 0, 1, 2, 3
SPECIAL_TOKENS = ("[PAD]", "[CLS]", "[SEP]", "[UNK]")
_SPLITS = {"train": 0, "val": 1, "test": 2}
# Words the overlap baseline treats as negation cues.
NEGATION_WORDS = frozenset(
    {"no", "not", "n't", "never", "nobody", "nothing", "none", "nowhere", "neither", "nor",
     "without"}
)
_VOCAB_FORMAT = "spinformer.nli_vocab"


def _split_id(split: str) -> int:
    if split not in _SPLITS:
        raise ValueError(f"unknown split {split!r}; choose one of {sorted(_SPLITS)}.")
    return _SPLITS[split]


def _check_index(index) -> int:
    if isinstance(index, bool) or not isinstance(index, (int, np.integer)) or index < 0:
        raise ValueError(f"batch index must be a non-negative integer; got {index!r}.")
    return int(index)


# --------------------------------------------------------------------------------------------
# Tokenizer and vocabulary
# --------------------------------------------------------------------------------------------

_TOKEN_RE = re.compile(r"\w+(?=n't\b)|n't\b|'\w+|\w+|[^\w\s]")


def tokenize(text: str) -> list[str]:
    """Lower-cases `text` and splits it into words and punctuation marks; contractions are
    split Penn-Treebank style ("don't" → "do", "n't"; "dog's" → "dog", "'s")."""
    return _TOKEN_RE.findall(text.lower())


def build_vocab(texts: Iterable[str], *, max_vocab: int = 20000, min_count: int = 1
                ) -> list[str]:
    """Words by id: `[PAD]`, `[CLS]`, `[SEP]`, `[UNK]`, then the words of `texts` (after
    `tokenize`) seen at least `min_count` times, most frequent first (ties alphabetical), cut
    so that the list, the four special tokens included, has at most `max_vocab` entries.
    Other words map to `[UNK]`."""
    if max_vocab < len(SPECIAL_TOKENS) + 1:
        raise ValueError(f"max_vocab must be at least 5 (4 special tokens and a word); "
                         f"got {max_vocab}.")
    if min_count < 1:
        raise ValueError(f"min_count must be at least 1; got {min_count}.")
    counts = Counter()
    for t in texts:
        counts.update(tokenize(t))
    kept = sorted((w for w, c in counts.items() if c >= min_count and w not in SPECIAL_TOKENS),
                  key=lambda w: (-counts[w], w))
    return list(SPECIAL_TOKENS) + kept[: max_vocab - len(SPECIAL_TOKENS)]


def _check_vocab(words, where: str) -> list[str]:
    if not isinstance(words, (list, tuple)) or not all(isinstance(w, str) for w in words):
        raise ValueError(f"{where}: a vocabulary is a list of words by id; found "
                         f"{type(words).__name__}.")
    words = list(words)
    if tuple(words[:4]) != SPECIAL_TOKENS:
        raise ValueError(f"{where}: a vocabulary must start with {list(SPECIAL_TOKENS)}; "
                         f"found {words[:4]}.")
    dup = [w for w, c in Counter(words).items() if c > 1]
    if dup:
        raise ValueError(f"{where}: the vocabulary lists some words twice, e.g. {dup[:5]}.")
    return words


def save_vocab(words: Sequence[str], path: Union[str, os.PathLike]) -> pathlib.Path:
    """Writes a vocabulary (words by id) as JSON: `{"format", "version", "lowercase",
    "words"}`."""
    words = _check_vocab(words, "save_vocab")
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"format": _VOCAB_FORMAT, "version": 1, "lowercase": True, "words": words}
    path.write_text(json.dumps(payload, ensure_ascii=False), encoding="utf-8")
    return path


def load_vocab(path: Union[str, os.PathLike]) -> list[str]:
    """The words by id of a vocabulary written by `save_vocab` or `dataset.save(out_dir)`
    (`vocab.json`; a plain JSON list of words is read too). Pass it to
    `NLIFile.from_path(..., vocab=...)` so a later run keeps the ids of an earlier one."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"vocabulary file {str(path)!r} not found; dataset.save(out_dir) "
                                f"writes it as vocab.json into a run directory.")
    try:
        payload = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path.name} is not valid JSON ({e.msg}); expected a vocabulary "
                         f"written by save_vocab.") from None
    if isinstance(payload, dict):
        if "words" not in payload:
            raise ValueError(f"{path.name} is not an NLI vocabulary: expected a JSON object "
                             f"with a 'words' list; found keys {sorted(payload)}.")
        payload = payload["words"]
    return _check_vocab(payload, path.name)


# --------------------------------------------------------------------------------------------
# Packing pairs into the batch format
# --------------------------------------------------------------------------------------------


def _fit_lengths(lp: int, lh: int, budget: int) -> tuple[int, int]:
    """Lengths after truncating to `lp + lh <= budget`: tokens are dropped from the end of
    the longer sentence, one at a time (the premise's on ties)."""
    excess = lp + lh - budget
    if excess <= 0:
        return lp, lh
    if lp >= lh and lp - excess >= lh:
        return lp - excess, lh
    if lh > lp and lh - excess >= lp:
        return lp, lh - excess
    return budget // 2, budget - budget // 2


def _segments(lens: np.ndarray, seq_len: int) -> np.ndarray:
    """Segment ids `(N, T)` from sentence lengths `lens (N, 2)` (premise, hypothesis)."""
    pos = np.arange(seq_len)[None, :]
    lp, lh = lens[:, 0:1], lens[:, 1:2]
    return np.where(pos < lp + 2, 1, np.where(pos < lp + lh + 3, 2, 0)).astype(np.int32)


def _pack(pairs: Sequence[tuple[list[int], list[int]]], seq_len: int, dtype):
    """`tokens (N, T)`, `lens (N, 2)` and the number of truncated pairs."""
    n = len(pairs)
    tokens = np.zeros((n, seq_len), dtype)
    lens = np.zeros((n, 2), np.int32)
    budget = seq_len - 3
    truncated = 0
    for i, (p, h) in enumerate(pairs):
        lp, lh = _fit_lengths(len(p), len(h), budget)
        truncated += (lp, lh) != (len(p), len(h))
        row = [CLS, *p[:lp], SEP, *h[:lh], SEP]
        tokens[i, : len(row)] = row
        lens[i] = lp, lh
    return tokens, lens, truncated


def _decode_row(row: np.ndarray, words: Sequence[str]) -> tuple[list[str], list[str]]:
    row = np.asarray(row)
    if row.ndim != 2 or row.shape[0] != 2:
        raise ValueError(f"decode takes one example's inputs, shape (2, T); got {row.shape}.")
    toks, seg = row
    n1, n2 = int((seg == 1).sum()), int((seg == 2).sum())
    prem = [words[int(t)] for t in toks[1 : n1 - 1]]
    hyp = [words[int(t)] for t in toks[n1 : n1 + n2 - 1]]
    return prem, hyp


class _OverlapRule:
    """The shallow baseline: each pair gets the key (share of the hypothesis's distinct words
    that occur in the premise, in five bins [0, .25), [.25, .5), [.5, .75), [.75, 1), {1};
    whether the premise holds a negation word; whether the hypothesis does), and is labelled
    with the most frequent training label of its key (the training majority for keys never
    seen in training)."""

    def __init__(self, negation_ids: Iterable[int]):
        self.neg = frozenset(int(i) for i in negation_ids)
        self.table = None

    def keys(self, inputs: np.ndarray) -> np.ndarray:
        out = np.empty(inputs.shape[0], np.int64)
        for b, (toks, seg) in enumerate(np.asarray(inputs)):
            n1, n2 = int((seg == 1).sum()), int((seg == 2).sum())
            prem = set(toks[1 : n1 - 1].tolist())
            hyp = set(toks[n1 : n1 + n2 - 1].tolist())
            share = len(hyp & prem) / max(len(hyp), 1)
            bin_ = 4 if share >= 1.0 else int(share * 4)
            out[b] = bin_ * 4 + 2 * bool(prem & self.neg) + bool(hyp & self.neg)
        return out

    def fit(self, inputs: np.ndarray, targets: np.ndarray) -> "_OverlapRule":
        keys = self.keys(inputs)
        counts = np.zeros((20, 3), np.int64)
        np.add.at(counts, (keys, np.asarray(targets)), 1)
        overall = int(np.argmax(counts.sum(0)))
        self.table = np.where(counts.sum(1) > 0, counts.argmax(1), overall)
        return self

    def predict(self, inputs: np.ndarray) -> np.ndarray:
        return self.table[self.keys(inputs)]


def _baselines(batch, majority_label: int, rule: _OverlapRule) -> dict[str, float]:
    t, m = batch["targets"], batch["mask"].astype(np.float64)
    total = max(float(m.sum()), 1.0)
    return {
        "chance_accuracy": 1.0 / 3.0,
        "majority_accuracy": float(((t == majority_label) * m).sum() / total),
        "overlap_accuracy": float(((rule.predict(batch["inputs"]) == t) * m).sum() / total),
    }
