"""Natural language inference: is a hypothesis entailed by, neutral to, or contradicted by a
premise? Two sources share one batch format: `NLIFile` reads SNLI/MultiNLI-style JSON-lines
files the user supplies; `GeneratedNLI` generates pairs from a small logic over a toy world,
with the label computed from the documented semantics (`oracle` checks it by model
enumeration).

**Batch format** (`kind = "pair_classification"`): `batch(index, split)` returns numpy arrays

- `inputs (B, 2, T) int32`: row 0 holds the token ids of `[CLS] premise [SEP] hypothesis [SEP]`
  followed by `[PAD]` (id 0, only at padded positions); row 1 the segment ids: 1 for `[CLS]`,
  the premise and its `[SEP]`, 2 for the hypothesis and its `[SEP]`, 0 for padding.
  Ids 1, 2, 3 are `[CLS]`, `[SEP]`, `[UNK]`.
- `targets (B,) int32`: the label id, 0 = entailment, 1 = neutral, 2 = contradiction
  (`NLI_LABELS`).
- `mask (B,) float32`: ones (every example counts).
"""

from __future__ import annotations

import functools
import itertools
import json
import math
import os
import pathlib
import re
from collections import Counter
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence, Union

import numpy as np

from ._protocol import DataFileError

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


# --------------------------------------------------------------------------------------------
# NLIFile: SNLI / MultiNLI JSON lines
# --------------------------------------------------------------------------------------------

_SNLI = ("snli_1.0_train.jsonl", "snli_1.0_dev.jsonl", "snli_1.0_test.jsonl")
_MNLI = ("multinli_1.0_train.jsonl", "multinli_1.0_dev_matched.jsonl",
         "multinli_1.0_dev_mismatched.jsonl")
_FIELDS = ("sentence1", "sentence2", "gold_label")
_LAYOUT_HINT = (
    "Point `path` at a directory holding SNLI (snli_1.0_train.jsonl, snli_1.0_dev.jsonl, "
    "snli_1.0_test.jsonl), MultiNLI (multinli_1.0_train.jsonl, multinli_1.0_dev_matched.jsonl) "
    "or JSON-lines files whose names contain 'train' and 'dev' or 'val' (and optionally "
    "'test'), or at a single JSON-lines training file."
)


def _read_records(path: pathlib.Path, limit: Optional[int] = None):
    """`[(premise, hypothesis, label id or None for "-")]` from a JSON-lines file; stops once
    `limit` labelled pairs are read. Blank lines are skipped; a malformed line, bytes that are
    not UTF-8, or a file that cannot be read is a `DataFileError` naming the file and the
    line (a cut-short last line is called truncated)."""
    path = pathlib.Path(path)
    out, kept = [], 0
    try:
        f = open(path, "rb")
    except OSError as e:
        raise DataFileError(f"{path}: cannot be read ({e.strerror or e}).") from None
    with f:
        for lineno, raw in enumerate(f, start=1):
            where = f"{path}, line {lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataFileError(
                    f"{where}: not UTF-8 text (byte 0x{raw[e.start]:02x} at column "
                    f"{e.start + 1}); is this a JSON-lines file?") from None
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                cut = (" The line does not end with a newline: the file looks truncated."
                       if not line.endswith("\n") else "")
                raise DataFileError(
                    f"{where}: not valid JSON ({e.msg}); each line must be a JSON object with "
                    f"fields {list(_FIELDS)}. Found: {line.strip()[:80]!r}.{cut}"
                ) from None
            if not isinstance(rec, dict):
                raise DataFileError(f"{where}: expected a JSON object with fields "
                                    f"{list(_FIELDS)}; found a {type(rec).__name__}.")
            missing = [k for k in _FIELDS if k not in rec]
            if missing:
                raise DataFileError(f"{where}: missing field(s) {missing}; expected fields "
                                    f"{list(_FIELDS)}, found {sorted(rec)}.")
            bad = [k for k in _FIELDS if not isinstance(rec[k], str)]
            if bad:
                raise DataFileError(f"{where}: field(s) {bad} must be strings; found "
                                    f"{[type(rec[k]).__name__ for k in bad]}.")
            gold = rec["gold_label"]
            if gold == "-":
                out.append((rec["sentence1"], rec["sentence2"], None))
                continue
            if gold not in _LABEL_ID:
                raise DataFileError(f"{where}: unknown gold_label {gold!r}; expected one of "
                                    f"{list(NLI_LABELS)} or '-' (no consensus, dropped).")
            out.append((rec["sentence1"], rec["sentence2"], _LABEL_ID[gold]))
            kept += 1
            if limit is not None and kept >= limit:
                break
    return out


def read_jsonl(path: Union[str, os.PathLike], max_examples: Optional[int] = None
               ) -> tuple[list[tuple[str, str, int]], int]:
    """`(examples, dropped)` from one SNLI/MultiNLI JSON-lines file: `(premise, hypothesis,
    label id)` per line with a gold label, and the number of lines labelled `"-"` (no
    annotator consensus), which are dropped. Each line must be a JSON object with string
    fields `sentence1`, `sentence2`, `gold_label` (others are ignored); anything else is a
    `DataFileError` (a `ValueError`) naming the file and the line. `max_examples`: stop after
    that many."""
    recs = _read_records(pathlib.Path(path), max_examples)
    kept = [r for r in recs if r[2] is not None]
    return kept, len(recs) - len(kept)


def _resolve_nli_files(path) -> tuple[dict[str, pathlib.Path], list[str]]:
    """`({split: file}, notes)` for a directory, or `({"file": path}, notes)` for one file."""
    p = pathlib.Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"NLI data {str(p)!r} not found. {_LAYOUT_HINT}")
    if p.is_file():
        return {"file": p}, []
    for sub in (p, p / "snli_1.0", p / "multinli_1.0"):
        if (sub / _SNLI[0]).is_file():
            files = dict(zip(("train", "val", "test"), (sub / n for n in _SNLI)))
            missing = [f.name for f in files.values() if not f.is_file()]
            if missing:
                raise FileNotFoundError(f"SNLI in {str(sub)!r} lacks {missing}. {_LAYOUT_HINT}")
            return files, []
        if (sub / _MNLI[0]).is_file():
            matched, mismatched = sub / _MNLI[1], sub / _MNLI[2]
            if not matched.is_file():
                raise FileNotFoundError(f"MultiNLI in {str(sub)!r} lacks {_MNLI[1]}. "
                                        f"{_LAYOUT_HINT}")
            notes = ["MultiNLI has no public test labels: test = dev_matched"]
            if mismatched.is_file():
                notes.append("val = dev_mismatched")
                val = mismatched
            else:
                notes.append(f"val = dev_matched too ({_MNLI[2]} not found)")
                val = matched
            return {"train": sub / _MNLI[0], "val": val, "test": matched}, notes
    cands = sorted(f for f in p.iterdir() if f.is_file() and not f.name.startswith(".")
                   and f.suffix.lower() in (".jsonl", ".json"))
    found = {}
    for split, keys in (("train", ("train",)), ("val", ("dev", "val")), ("test", ("test",))):
        hits = [f for f in cands if any(k in f.name.lower() for k in keys)]
        if len(hits) > 1:
            raise ValueError(f"several {split} files in {str(p)!r}: {[f.name for f in hits]}; "
                             f"keep one, or point `path` at a single file.")
        if hits:
            found[split] = hits[0]
    for split, what in (("train", "'train'"), ("val", "'dev' or 'val'")):
        if split not in found:
            raise FileNotFoundError(
                f"no {split} file in {str(p)!r}: looked for SNLI/MultiNLI file names and for a "
                f".jsonl file whose name contains {what} (found {[f.name for f in cands]}). "
                f"{_LAYOUT_HINT}"
            )
    notes = []
    if "test" not in found:
        found["test"] = found["val"]
        notes.append(f"no test file: test = {found['val'].name}")
    return found, notes


class NLIFile:
    """Premise/hypothesis pairs from SNLI/MultiNLI-style data, word-tokenized.

    Build it with `NLIFile.from_path(path, ...)`, or directly from in-memory examples.

    **Arguments:**

    - `examples`: `{"train": [...], "val": [...], "test": [...]}`, each a list of
      `(premise, hypothesis, label)` with label an id (0, 1, 2) or a name from `NLI_LABELS`.
    - `seq_len`: T, the padded length of `[CLS] premise [SEP] hypothesis [SEP]`; longer pairs
      are truncated (tokens dropped from the end of the longer sentence first, both `[SEP]`
      always kept) and counted in `truncated[split]`.
    - `batch_size`: B.
    - `seed`: the training order; batch `i` of split `s` depends only on `(seed, s, i)`.
    - `max_vocab`, `min_count`: the vocabulary, built on the training split only (see
      `build_vocab`: at most `max_vocab` entries, special tokens included; rarer words and
      words seen fewer than `min_count` times become `[UNK]`).
    - `vocab`: a vocabulary to reuse instead: words by id (`load_vocab`), or the path of a
      vocab.json.
    - `dropped`: `{split: count}` of examples dropped while reading (reported only).
    - `source`, `notes`: shown by `summary()`.

    **Attributes:** `kind = "pair_classification"`, `num_classes = 3`, `vocab_size`,
    `seq_len`, `batch_size`, `seed`, `vocab` (words by id), `sizes`, `dropped` and
    `truncated` (`{split: count}`), `majority_label` (the most frequent training label).

    **Batches:** the training split is shuffled per epoch: batch `i` takes positions
    `j*B ... j*B + B - 1` (wrapping around) of a permutation of the training pairs drawn from
    `(seed, i // batches_per_epoch)`, `j = i % batches_per_epoch`, with
    `batches_per_epoch = max(1, n_train // B)`. Validation and test batches walk their split in
    file order and wrap around: batch `i` holds pairs `i*B ... i*B + B - 1` (mod n).
    """

    kind = "pair_classification"
    num_classes = 3

    def __init__(self, examples: dict, *, seq_len: int = 64, batch_size: int = 32,
                 seed: int = 0, max_vocab: int = 20000, min_count: int = 1,
                 vocab: Union[Sequence[str], str, os.PathLike, None] = None,
                 dropped: Optional[dict] = None, source: str = "in-memory examples",
                 notes: Sequence[str] = ()):
        if seq_len < 5:
            raise ValueError(f"seq_len must be at least 5 ([CLS], a premise token, [SEP], a "
                             f"hypothesis token, [SEP]); got {seq_len}.")
        if batch_size < 1:
            raise ValueError(f"batch_size must be positive; got {batch_size}.")
        missing = [s for s in _SPLITS if not examples.get(s)]
        if missing:
            raise ValueError(f"NLIFile needs non-empty 'train', 'val' and 'test' example lists; "
                             f"{missing} missing or empty.")
        if vocab is None:
            vocab = build_vocab((t for p, h, _ in examples["train"] for t in (p, h)),
                                max_vocab=max_vocab, min_count=min_count)
        elif isinstance(vocab, (str, os.PathLike)):
            vocab = load_vocab(vocab)
        self.vocab = _check_vocab(vocab, "NLIFile vocab")
        self._ids = {w: i for i, w in enumerate(self.vocab)}
        self.vocab_size = len(self.vocab)
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.seed = seed
        self.source = source
        self.notes = list(notes)
        self.dropped = {s: int((dropped or {}).get(s, 0)) for s in _SPLITS}
        dtype = np.uint16 if self.vocab_size <= 65536 else np.int32
        self._tokens, self._lens, self._labels = {}, {}, {}
        self.truncated, self.sizes = {}, {}
        for split in _SPLITS:
            pairs, labels = [], []
            for k, (p, h, y) in enumerate(examples[split]):
                if isinstance(y, str):
                    if y not in _LABEL_ID:
                        raise ValueError(f"{split} example {k}: unknown label {y!r}; expected "
                                         f"one of {list(NLI_LABELS)} or 0, 1, 2.")
                    y = _LABEL_ID[y]
                if int(y) not in (0, 1, 2):
                    raise ValueError(f"{split} example {k}: label {y!r} is not 0, 1 or 2.")
                pairs.append((self._encode(p), self._encode(h)))
                labels.append(int(y))
            tokens, lens, n_trunc = _pack(pairs, seq_len, dtype)
            self._tokens[split], self._lens[split] = tokens, lens
            self._labels[split] = np.asarray(labels, np.int32)
            self.truncated[split] = int(n_trunc)
            self.sizes[split] = len(labels)
        counts = np.bincount(self._labels["train"], minlength=3)
        self.majority_label = int(np.argmax(counts))
        self._perm = (None, None)
        self._rule = None

    @classmethod
    def from_path(cls, path: Union[str, os.PathLike], *, seq_len: int = 64,
                  batch_size: int = 32, seed: int = 0, max_vocab: int = 20000,
                  min_count: int = 1, max_examples: Optional[int] = None,
                  vocab: Union[Sequence[str], str, os.PathLike, None] = None
                  ) -> "NLIFile":
        """Reads SNLI/MultiNLI JSON lines (fields `sentence1`, `sentence2`, `gold_label`;
        others ignored).

        - `path`: a directory with SNLI's `snli_1.0_{train,dev,test}.jsonl`, or MultiNLI's
          `multinli_1.0_train.jsonl` and `multinli_1.0_dev_matched.jsonl` (MultiNLI's test
          labels are not public, so test = dev_matched, and val = dev_mismatched when that
          file is present, else dev_matched as well), or any directory with one `.jsonl` file
          whose name contains `train`, one with `dev` or `val`, and optionally one with
          `test` (else test = the validation file); a `snli_1.0/` or `multinli_1.0/`
          subdirectory is looked into too. Or a single training file: then 5% of its
          labelled pairs (at least one) become the validation split and another 5% the test
          split, chosen by a fixed permutation that does not depend on `seed`.
        - Pairs labelled `"-"` (no annotator consensus) are dropped and counted in `dropped`.
        - `max_examples`: keep at most this many labelled pairs per split (the first ones).

        The other arguments are `NLIFile`'s.
        """
        if max_examples is not None and max_examples < 1:
            raise ValueError(f"max_examples must be positive or None; got {max_examples}.")
        files, notes = _resolve_nli_files(path)
        if "file" in files:
            f = files["file"]
            recs = _read_records(f)
            labelled = [r for r in recs if r[2] is not None]
            if not recs:
                raise DataFileError(f"{f}: the file is empty (no JSON lines); expected one "
                                    f"JSON object per line with fields {list(_FIELDS)}.")
            if len(labelled) < 3:
                raise DataFileError(f"{f} holds {len(labelled)} labelled pairs; a single file "
                                    f"is split into train/val/test and needs at least 3.")
            k = max(1, len(labelled) // 20)
            perm = np.random.default_rng(0).permutation(len(labelled))
            parts = {"val": np.sort(perm[:k]), "test": np.sort(perm[k : 2 * k]),
                     "train": np.sort(perm[2 * k :])}
            raw = {s: [labelled[i] for i in idx] for s, idx in parts.items()}
            raw["train"] += [r for r in recs if r[2] is None]  # counted as dropped from train
            notes = notes + [(f"val and test carved from {f.name}: {k} pairs each (5% of "
                              f"the labelled pairs; '-' lines counted under train)")]
            source = f.name
        else:
            raw = {s: _read_records(f, max_examples) for s, f in files.items()}
            names = [files[s].name for s in _SPLITS]
            source = " / ".join(dict.fromkeys(names))
        examples, dropped = {}, {}
        for s in _SPLITS:
            kept = [r for r in raw[s] if r[2] is not None]
            dropped[s] = len(raw[s]) - len(kept)
            examples[s] = kept[:max_examples] if max_examples is not None else kept
            if not examples[s]:
                what = ("the file is empty" if not raw[s] else
                        f"{dropped[s]} labelled '-' were dropped")
                where = files.get(s, files.get("file"))
                raise DataFileError(f"{where}: the {s} split has no labelled pairs ({what}).")
        return cls(examples, seq_len=seq_len, batch_size=batch_size, seed=seed,
                   max_vocab=max_vocab, min_count=min_count, vocab=vocab, dropped=dropped,
                   source=source, notes=notes)

    def summary(self) -> str:
        """One line: sizes, dropped and truncated pairs per split, vocabulary, file notes."""
        parts = [f"{s} {self.sizes[s]} (dropped {self.dropped[s]} '-', truncated "
                 f"{self.truncated[s]})" for s in _SPLITS]
        extra = "".join(f"; {n}" for n in self.notes)
        return (f"NLI from {self.source}: " + ", ".join(parts)
                + f"; vocab {self.vocab_size}, seq_len {self.seq_len}{extra}")

    def save_vocab(self, path: Union[str, os.PathLike]) -> pathlib.Path:
        """Writes the vocabulary to `path` as JSON (read it back with `load_vocab`)."""
        return save_vocab(self.vocab, path)

    def save(self, out_dir: Union[str, os.PathLike]) -> pathlib.Path:
        """Writes `vocab.json` into the run directory `out_dir` (the trainer calls this);
        reuse it with `from_path(..., vocab=load_vocab(out_dir / "vocab.json"))`."""
        return save_vocab(self.vocab, pathlib.Path(out_dir) / "vocab.json")

    def _encode(self, text: str) -> list[int]:
        return [self._ids.get(w, UNK) for w in tokenize(text)]

    def _permutation(self, epoch: int) -> np.ndarray:
        if self._perm[0] != epoch:
            n = self.sizes["train"]
            self._perm = (epoch, np.random.default_rng([self.seed, 0, epoch]).permutation(n))
        return self._perm[1]

    def batch(self, index: int, split: str = "train") -> dict[str, np.ndarray]:
        """`{"inputs" (B, 2, T) int32, "targets" (B,) int32, "mask" (B,) float32}`; see the
        class docstring for the order."""
        index, sid = _check_index(index), _split_id(split)
        n, B = self.sizes[split], self.batch_size
        if sid == 0:
            per_epoch = max(1, n // B)
            epoch, j = divmod(index, per_epoch)
            rows = self._permutation(epoch)[(j * B + np.arange(B)) % n]
        else:
            rows = (index * B + np.arange(B)) % n
        return self._rows(split, rows)

    def _rows(self, split: str, rows: np.ndarray) -> dict[str, np.ndarray]:
        lens = self._lens[split][rows]
        inputs = np.stack([self._tokens[split][rows].astype(np.int32),
                           _segments(lens, self.seq_len)], axis=1)
        return {"inputs": inputs, "targets": self._labels[split][rows].copy(),
                "mask": np.ones(len(rows), np.float32)}

    def decode(self, inputs_row: np.ndarray) -> tuple[list[str], list[str]]:
        """`(premise_words, hypothesis_words)` of one example's `inputs (2, T)`."""
        return _decode_row(inputs_row, self.vocab)

    def _overlap_rule(self) -> _OverlapRule:
        if self._rule is None:
            n = self.sizes["train"]
            rows = np.sort(np.random.default_rng(0).permutation(n)[:100_000])
            b = self._rows("train", rows)
            neg = [self._ids[w] for w in NEGATION_WORDS if w in self._ids]
            self._rule = _OverlapRule(neg).fit(b["inputs"], b["targets"])
        return self._rule

    def baselines(self, batch: dict[str, np.ndarray]) -> dict[str, float]:
        """Accuracies on `batch` of shallow references:

        - `chance_accuracy`: 1/3.
        - `majority_accuracy`: always answering the most frequent training label.
        - `overlap_accuracy`: a lookup table fitted on (up to 100,000) training pairs, keyed
          by the share of the hypothesis's distinct words found in the premise (five bins)
          and by whether each sentence holds a negation word (`NEGATION_WORDS`); each key
          answers its most frequent training label. It shows how far word overlap and
          negation cues go.
        """
        return _baselines(batch, self.majority_label, self._overlap_rule())


# --------------------------------------------------------------------------------------------
# The generated task: world, sentences, semantics
# --------------------------------------------------------------------------------------------

# Noun hierarchy: noun -> parent. Tops: "animal", "person".
_PARENT = {
    "dog": "animal", "cat": "animal", "horse": "animal", "cow": "animal", "pig": "animal",
    "goat": "animal", "duck": "animal", "sheep": "animal", "fox": "animal", "rabbit": "animal",
    "man": "adult", "woman": "adult", "boy": "child", "girl": "child",
    "adult": "person", "child": "person",
}
_NOUNS = tuple(sorted(set(_PARENT) | set(_PARENT.values())))
# (third person singular, base form)
_INTRANSITIVE = (("runs", "run"), ("sleeps", "sleep"), ("eats", "eat"), ("walks", "walk"),
                 ("jumps", "jump"), ("sings", "sing"), ("plays", "play"), ("sits", "sit"),
                 ("waits", "wait"), ("swims", "swim"), ("rests", "rest"),
                 ("dances", "dance"))
_TRANSITIVE = (("pushes", "push"), ("pulls", "pull"), ("sees", "see"), ("follows", "follow"),
               ("helps", "help"), ("chases", "chase"), ("calls", "call"),
               ("watches", "watch"), ("greets", "greet"), ("carries", "carry"))
_ADJECTIVES = ("small", "big", "old", "young", "happy", "lazy", "clever", "sleepy", "tired",
               "hungry")
_ADVERBS = ("quickly", "slowly", "quietly", "happily", "loudly", "calmly")
_PLACES = ("in the park", "in the garden", "near the river", "at the school", "on the hill",
           "in the kitchen", "by the lake", "at the station")
# Held out of the training split when held_out=True (see GeneratedNLI).
_HELD = {
    "noun": ("fox", "rabbit"),
    "intransitive": ("swim", "rest", "dance"),
    "transitive": ("greet", "carry"),
    "adjective": ("tired", "hungry"),
    "adverb": ("loudly", "calmly"),
    "place": ("by the lake", "at the station"),
}
HELD_OUT_TEMPLATES = ("some N does not V",)
_DETS = ("a", "some", "every", "no", "the")
_STRUCTURE = ("a", "an", "some", "every", "no", "the", "does", "not")
_THIRD = {b: t for t, b in _INTRANSITIVE + _TRANSITIVE}
_BASE = {t: b for t, b in _INTRANSITIVE + _TRANSITIVE}
_IV = frozenset(b for _, b in _INTRANSITIVE)
_TV = frozenset(b for _, b in _TRANSITIVE)
_PLACE_BY_PREP = {}
for _pl in _PLACES:
    _PLACE_BY_PREP.setdefault(_pl.split()[0], set()).add(_pl)


def _ancestors(noun: str) -> tuple[str, ...]:
    """`noun` and its hypernyms, nearest first."""
    out = [noun]
    while out[-1] in _PARENT:
        out.append(_PARENT[out[-1]])
    return tuple(out)


def _is_a(n1: str, n2: str) -> bool:
    return n2 in _ancestors(n1)


def _disjoint(n1: str, n2: str) -> bool:
    """Nouns neither of which is a hypernym of the other denote disjoint sets."""
    return not _is_a(n1, n2) and not _is_a(n2, n1)


@dataclass(frozen=True)
class Sentence:
    """One generated sentence, parsed.

    - `det`: `"a"` (also "an") or `"some"` (existential), `"every"`, `"no"`, `"the"`.
    - `noun`, `adjs`: the subject noun phrase (adjectives are intersective).
    - `verb`: the verb's base form; `neg`: "does not" (allowed with a/some/the only).
    - `obj`, `obj_adjs`: a definite object "the [adjs] obj" (transitive verbs).
    - `mods`: verb-phrase modifiers (adverbs, place phrases like "in the park"); inside the
      negation.
    """

    det: str
    noun: str
    verb: str
    neg: bool = False
    adjs: tuple = ()
    obj: Optional[str] = None
    obj_adjs: tuple = ()
    mods: tuple = ()

    def words(self) -> list[str]:
        np_ = list(self.adjs) + [self.noun]
        det = self.det
        if det == "a" and np_[0][0] in "aeiou":
            det = "an"
        out = [det, *np_]
        out += ["does", "not", self.verb] if self.neg else [_THIRD[self.verb]]
        if self.obj is not None:
            out += ["the", *self.obj_adjs, self.obj]
        for m in self.mods:
            out += m.split()
        return out

    def __str__(self) -> str:
        return " ".join(self.words())


def parse_sentence(words: Union[str, Sequence[str]]) -> Sentence:
    """Parses a sentence of the generated language (a string or a list of words) into a
    `Sentence`; anything outside the grammar is a `ValueError` saying where."""
    ws = words.split() if isinstance(words, str) else list(words)
    text = " ".join(ws)

    def fail(why):
        raise ValueError(f"cannot parse {text!r}: {why}.")

    def noun_phrase(i):
        adjs = []
        while i < len(ws) and ws[i] in _ADJECTIVES:
            adjs.append(ws[i])
            i += 1
        if i >= len(ws) or ws[i] not in _NOUNS:
            fail(f"expected a noun at word {i}")
        return ws[i], tuple(adjs), i + 1

    if not ws:
        fail("empty sentence")
    det = {"an": "a"}.get(ws[0], ws[0])
    if det not in _DETS:
        fail(f"expected a determiner {list(_DETS)} first")
    noun, adjs, i = noun_phrase(1)
    if det == "a" and ws[0] != ("an" if (list(adjs) + [noun])[0][0] in "aeiou" else "a"):
        fail("wrong article (a/an)")
    neg = i < len(ws) and ws[i] == "does"
    if neg:
        if ws[i + 1 : i + 2] != ["not"] or i + 2 >= len(ws) or ws[i + 2] not in _THIRD:
            fail("expected 'does not' and a verb's base form")
        if det in ("every", "no"):
            fail(f"'{det} ... does not' is outside the language (ambiguous scope)")
        verb, i = ws[i + 2], i + 3
    else:
        if i >= len(ws) or ws[i] not in _BASE:
            fail(f"expected a verb at word {i}")
        verb, i = _BASE[ws[i]], i + 1
    obj, obj_adjs = None, ()
    if verb in _TV:
        if ws[i : i + 1] != ["the"]:
            fail(f"transitive '{verb}' needs a definite object 'the N'")
        obj, obj_adjs, i = noun_phrase(i + 1)
    mods = []
    while i < len(ws):
        if ws[i] in _ADVERBS:
            mods.append(ws[i])
            i += 1
        elif " ".join(ws[i : i + 3]) in _PLACES:
            mods.append(" ".join(ws[i : i + 3]))
            i += 3
        else:
            fail(f"unexpected {ws[i]!r} at word {i}")
    return Sentence(det, noun, verb, neg, adjs, obj, obj_adjs, tuple(mods))


def _np_relation(n1, a1, n2, a2) -> str:
    """How noun phrase 1 relates to noun phrase 2 as sets: eq, sub, sup, disjoint, overlap."""
    if n1 == n2 and set(a1) == set(a2):
        return "eq"
    if _is_a(n1, n2) and set(a2) <= set(a1):
        return "sub"
    if _is_a(n2, n1) and set(a1) <= set(a2):
        return "sup"
    if _disjoint(n1, n2):
        return "disjoint"
    return "overlap"


def _vp_relation(v1, m1, v2, m2) -> str:
    """Verb phrases: a modified VP is a subset of the same verb with fewer modifiers; different
    verbs are unrelated."""
    if v1 != v2:
        return "overlap"
    if set(m1) == set(m2):
        return "eq"
    if set(m2) <= set(m1):
        return "sub"
    if set(m1) <= set(m2):
        return "sup"
    return "overlap"


def _allowed(x: bool, y: bool, rel: str) -> bool:
    return {"eq": x == y, "sub": not (x and not y), "sup": not (y and not x),
            "disjoint": not (x and y), "overlap": True}[rel]


_QUANT = {"a": "exists", "some": "exists", "every": "every", "no": "no", "the": "the"}


@functools.lru_cache(maxsize=None)
def _monadic_label(pform: tuple, hform: tuple, np_rel: str, vp_rel: str) -> int:
    """The label by model enumeration. An individual is a cell `(in NP_p, in NP_h, in VP_p,
    in VP_h)` allowed by the lexical relations; a scene is a multiset of at most 4 cells
    (enough: every formula below is universal except for at most four existential
    requirements, and universal formulas survive passing to a sub-scene, so any scene
    satisfying them contains one of at most four individuals that does too)."""
    cells = [c for c in itertools.product((False, True), repeat=4)
             if _allowed(c[0], c[1], np_rel) and _allowed(c[2], c[3], vp_rel)]

    def presup(form, scene, k):
        n = sum(c[k] for c in scene)
        return {"every": n >= 1, "the": n == 1}.get(form[0], True)

    def holds(form, scene, k):
        q, neg = form
        sat = [c[2 + k] != neg for c in scene if c[k]]
        if q == "exists":
            return any(sat)
        if q == "every":
            return all(sat)
        if q == "no":
            return not any(sat)
        return len(sat) == 1 and sat[0]  # the

    outcomes = set()
    for size in range(5):
        for scene in itertools.combinations_with_replacement(cells, size):
            if presup(pform, scene, 0) and presup(hform, scene, 1) and holds(pform, scene, 0):
                outcomes.add(holds(hform, scene, 1))
    if not outcomes:
        raise ValueError("the premise cannot hold together with what the two sentences take "
                         "for granted; such a pair has no label.")
    return ENTAILMENT if outcomes == {True} else CONTRADICTION if outcomes == {False} else NEUTRAL


def _transitive_label(p: Sentence, h: Sentence) -> int:
    nps = [(p.noun, p.adjs), (p.obj, p.obj_adjs), (h.noun, h.adjs), (h.obj, h.obj_adjs)]
    if p.det != "the" or h.det != "the":
        raise ValueError("the oracle covers transitive sentences with a definite ('the') "
                         "subject and object only.")
    ids: list[int] = []
    reps: list[tuple] = []
    for n, a in nps:
        for j, (rn, ra) in enumerate(reps):
            rel = _np_relation(n, a, rn, ra)
            if rel == "eq":
                ids.append(j)
                break
            if rel != "disjoint":
                raise ValueError("the oracle covers transitive pairs whose noun phrases are "
                                 "identical or disjoint (distinct individuals) only.")
        else:
            ids.append(len(reps))
            reps.append((n, a))
    # Each definite picks out the unique such individual; atoms: VP(subject, object).
    atoms = sorted({((p.verb, p.mods), ids[0], ids[1]), ((h.verb, h.mods), ids[2], ids[3])})

    def consistent(vals):
        for (a, x), (b, y) in itertools.permutations(zip(atoms, vals), 2):
            if a[1:] == b[1:] and not _allowed(x, y, _vp_relation(*a[0], *b[0])):
                return False
        return True

    pa = atoms.index(((p.verb, p.mods), ids[0], ids[1]))
    ha = atoms.index(((h.verb, h.mods), ids[2], ids[3]))
    outcomes = {vals[ha] != h.neg for vals in itertools.product((False, True), repeat=len(atoms))
                if consistent(vals) and vals[pa] != p.neg}
    return ENTAILMENT if outcomes == {True} else CONTRADICTION if outcomes == {False} else NEUTRAL


def oracle(premise: Union[str, Sequence[str], Sentence],
               hypothesis: Union[str, Sequence[str], Sentence]) -> int:
    """The label of a pair of the generated language, computed from the semantics
    `GeneratedNLI` documents by enumerating scenes (not from the generator's table).

    Takes sentences as strings, word lists or `Sentence`s; returns 0, 1 or 2
    (`NLI_LABELS`). Intransitive pairs are decided by enumerating small scenes; transitive
    pairs (definite subject and object) by enumerating the truth of the verb relations
    between the individuals named."""
    p = premise if isinstance(premise, Sentence) else parse_sentence(premise)
    h = hypothesis if isinstance(hypothesis, Sentence) else parse_sentence(hypothesis)
    if (p.obj is None) != (h.obj is None):
        raise ValueError("the oracle covers pairs of two intransitive or two transitive "
                         "sentences.")
    if p.obj is not None:
        return _transitive_label(p, h)
    return _monadic_label((_QUANT[p.det], p.neg), (_QUANT[h.det], h.neg),
                          _np_relation(p.noun, p.adjs, h.noun, h.adjs),
                          _vp_relation(p.verb, p.mods, h.verb, h.mods))


# The generator's label table, written out by hand from the semantics (the tests check every
# row against oracle). Forms: A = a/some, A- = a/some ... does not, THE- = the ... does not.
# Relations: same noun; up = the hypothesis's noun is a hypernym of the premise's; down = the
# reverse; other = disjoint nouns (dog/cat, boy/woman, dog/man).
_E, _N, _C = ENTAILMENT, NEUTRAL, CONTRADICTION
_SCHEMAS = (
    # negation
    ("negation", "A", "NO", "same", _C), ("negation", "NO", "A", "same", _C),
    ("negation", "THE", "THE-", "same", _C), ("negation", "THE-", "THE", "same", _C),
    ("negation", "THE", "NO", "same", _C), ("negation", "NO", "THE", "same", _C),
    ("negation", "THE-", "A", "same", _C), ("negation", "A", "THE-", "same", _C),
    ("negation", "THE-", "NO", "same", _E), ("negation", "NO", "THE-", "same", _E),
    ("negation", "THE-", "A-", "same", _E), ("negation", "A-", "THE-", "same", _E),
    ("negation", "A", "A-", "same", _N), ("negation", "A-", "A", "same", _N),
    ("negation", "A-", "NO", "same", _N), ("negation", "NO", "A-", "same", _N),
    # quantifiers
    ("quantifier", "EVERY", "A", "same", _E), ("quantifier", "EVERY", "THE", "same", _E),
    ("quantifier", "THE", "EVERY", "same", _E),
    ("quantifier", "EVERY", "NO", "same", _C), ("quantifier", "NO", "EVERY", "same", _C),
    ("quantifier", "EVERY", "A-", "same", _C), ("quantifier", "A-", "EVERY", "same", _C),
    ("quantifier", "EVERY", "THE-", "same", _C), ("quantifier", "THE-", "EVERY", "same", _C),
    ("quantifier", "A", "EVERY", "same", _N),
    # lexical entailment through the hypernym hierarchy
    ("lexical", "A", "A", "up", _E), ("lexical", "EVERY", "A", "up", _E),
    ("lexical", "EVERY", "EVERY", "down", _E), ("lexical", "NO", "NO", "down", _E),
    ("lexical", "THE", "A", "up", _E), ("lexical", "A-", "A-", "up", _E),
    ("lexical", "THE-", "A-", "up", _E),
    ("lexical", "NO", "A", "down", _C), ("lexical", "A", "NO", "up", _C),
    ("lexical", "EVERY", "A-", "down", _C), ("lexical", "A-", "EVERY", "up", _C),
    ("lexical", "THE", "NO", "up", _C), ("lexical", "NO", "THE", "down", _C),
    ("lexical", "A", "A", "down", _N), ("lexical", "A", "A", "other", _N),
    ("lexical", "EVERY", "EVERY", "up", _N), ("lexical", "NO", "NO", "up", _N),
    ("lexical", "NO", "A", "up", _N), ("lexical", "A", "NO", "other", _N),
    ("lexical", "EVERY", "A", "down", _N), ("lexical", "A", "NO", "down", _N),
    # word order: "the X [does not] V the Y" against the same or swapped roles
    ("order", "POS", "POS", "same", _E), ("order", "NEG", "NEG", "same", _E),
    ("order", "POS", "NEG", "same", _C), ("order", "NEG", "POS", "same", _C),
    ("order", "POS", "POS", "swap", _N), ("order", "NEG", "NEG", "swap", _N),
    ("order", "POS", "NEG", "swap", _N), ("order", "NEG", "POS", "swap", _N),
)
_FORMS = {"A": ("a", False), "A-": ("a", True), "EVERY": ("every", False),
          "NO": ("no", False), "THE": ("the", False), "THE-": ("the", True),
          "POS": ("the", False), "NEG": ("the", True)}
PHENOMENA = ("negation", "quantifier", "order", "lexical")


def _pick(seq, u: float):
    return seq[int(u * len(seq))]


class GeneratedNLI:
    """A generated NLI task over a small world, where every label follows from the sentences
    by the semantics below (no download).

    **Arguments:**

    - `seq_len`: T (32 suffices for every setting; a smaller T that a pair could exceed is
      refused at construction, saying the length needed).
    - `batch_size`: B; each batch holds `B // 3` pairs of each label, the remaining `B % 3`
      pairs get distinct labels at random.
    - `seed`: batch `i` of split `s` depends only on `(seed, s, i)`.
    - `distractors` (0–3): how many label-irrelevant modifiers each pair carries, of distinct
      kinds drawn at random among: one adjective put before every noun ("a small dog runs" /
      "no small animal runs"), one adverb and one place phrase ("quickly", "in the park")
      after the verb phrase. A modifier is added to both sentences alike, which leaves the
      label unchanged (an intersective adjective on every noun phrase restricts the whole
      scene to small things; a verb-phrase modifier replaces the verb by a narrower one
      throughout); with the same seed the underlying pairs and labels are those of
      `distractors=0`. Difficulty knob: longer inputs with more words to ignore.
    - `phenomena`: which constructions appear, any of `"negation"` (a/the/no with and without
      "does not"), `"quantifier"` (every/a/the/no on one noun), `"order"` (transitive
      sentences with swapped roles) and `"lexical"` (hypernyms with monotone quantifiers);
      each batch draws a phenomenon uniformly per pair.
    - `held_out`: keep some words and a template out of training (below).

    **Semantics.** The two sentences describe one scene. "a/an N V" and "some N V": some N in
    the scene Vs. "every N V": every N does, and (taken for granted) there is at least one N.
    "no N V": no N does. "the N V": the scene holds exactly one N (taken for granted) and it
    Vs. "does not" negates the whole verb phrase, modifiers included; it occurs with
    a/some/the only. What either sentence takes for granted holds in the scene. Nouns form a
    hierarchy (dog, cat, ... ⊂ animal; man, woman ⊂ adult; boy, girl ⊂ child; adult, child ⊂
    person); a hypernym may have members beyond the listed nouns; two nouns neither of which
    is a hypernym of the other are disjoint (nothing is both a dog and a cat; a man is not a
    boy). Verbs are independent. The label is entailment if the hypothesis holds in every scene
    where the premise holds, contradiction if in none, neutral otherwise. So "every dog runs"
    ⇒ "a dog runs"; "a dog runs" / "a dog does not run" is neutral (two dogs) but "the dog
    runs" / "the dog does not run" a contradiction; "a dog runs" ⇒ "an animal runs", the
    reverse is neutral, "a dog runs" / "a cat runs" neutral; "no animal runs" contradicts "a
    dog runs". Word order: "the man pushes the boy" and "the boy pushes the man" are
    independent facts, so swapping the roles gives neutral (whatever the negations), the same
    roles with one "does not" a contradiction. `oracle` decides any pair of the language
    by enumerating scenes; the generator's hand-written table agrees with it.

    **Held out** (`held_out=True`): the training split never contains the nouns fox and
    rabbit, the verbs swim, rest, dance, greet, carry, the adjectives tired, hungry, the
    adverbs loudly, calmly, the place phrases "by the lake", "at the station"
    (`held_out_words`), nor the template "some N does not V" (`HELD_OUT_TEMPLATES`; training
    negates existentials as "a N does not V" only). In val and test every pair uses a
    held-out verb, every distractor is a held-out word, half the single-noun and word-order
    pairs use a held-out noun, and "some" negations appear. Held-out nouns occur only where
    the label does not depend on their place in the hierarchy (the same noun in both
    sentences, or one of two definite roles), since nothing in training could teach it;
    hypernym reasoning in val/test uses the training nouns. The vocabulary is fixed and shared
    by all splits, so held-out words have ids (and embeddings that training never updates):
    a model must rely on the structure words (determiners, "does not", word order), which is
    all the label depends on. `held_out=False`: every split draws from everything.

    `batch(i, split)`, `decode(row)`, `baselines(batch)` as for `NLIFile`; `examples(i,
    split)` gives the same batch as readable dicts with each pair's phenomenon.
    """

    kind = "pair_classification"
    num_classes = 3

    def __init__(self, seq_len: int = 32, batch_size: int = 32, seed: int = 0, *,
                 distractors: int = 0, phenomena: Sequence[str] = PHENOMENA,
                 held_out: bool = True):
        if isinstance(phenomena, str):
            phenomena = (phenomena,)
        phenomena = tuple(phenomena)
        unknown = [p for p in phenomena if p not in PHENOMENA]
        if unknown or not phenomena:
            raise ValueError(f"phenomena must be a non-empty selection of {list(PHENOMENA)}; "
                             f"got {list(phenomena)}.")
        if not isinstance(distractors, (int, np.integer)) or not 0 <= distractors <= 3:
            raise ValueError(f"distractors must be 0, 1, 2 or 3 (an adjective, an adverb, a "
                             f"place phrase); got {distractors!r}.")
        if batch_size < 1:
            raise ValueError(f"batch_size must be positive; got {batch_size}.")
        # Longest pair: [CLS] + 2 sentences + 2 [SEP]; negated intransitive 5 words, negated
        # transitive 7; distractors add 3 (place), 1 per noun phrase (adjective), 1 (adverb).
        need = 0
        for ph in phenomena:
            base, incs = (7, [3, 2, 1]) if ph == "order" else (5, [3, 1, 1])
            need = max(need, 3 + 2 * (base + sum(incs[:distractors])))
        if seq_len < need:
            raise ValueError(f"GeneratedNLI with phenomena {list(phenomena)} and "
                             f"distractors={distractors} makes pairs of up to {need} tokens "
                             f"([CLS] premise [SEP] hypothesis [SEP]); raise seq_len to at "
                             f"least {need} (got {seq_len}).")
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.seed = seed
        self.distractors = int(distractors)
        self.phenomena = phenomena
        self.held_out = bool(held_out)
        words = set(_STRUCTURE) | set(_NOUNS) | set(_ADJECTIVES) | set(_ADVERBS)
        words |= {w for pair in _INTRANSITIVE + _TRANSITIVE for w in pair}
        words |= {w for pl in _PLACES for w in pl.split()}
        self.vocab = list(SPECIAL_TOKENS) + sorted(words)
        self.vocab_size = len(self.vocab)
        self.truncated = {s: 0 for s in _SPLITS}
        self._ids = {w: i for i, w in enumerate(self.vocab)}
        self._by_key = {}
        for row in _SCHEMAS:
            self._by_key.setdefault((row[0], row[4]), []).append(row)
        seen_words = self._words_of(held=False)
        held_words = self._words_of(held=True)
        self.held_out_words = frozenset(held_words - seen_words) if held_out else frozenset()
        self.majority_label = ENTAILMENT  # labels are balanced; ties go to the lowest id
        self._rule = None

    @staticmethod
    def _pools(held: Optional[bool]) -> dict:
        """Word lists: held=False the training words, True the held-out ones, None all."""
        def sel(items, key, get=lambda x: x):
            if held is None:
                return tuple(items)
            return tuple(x for x in items if (get(x) in _HELD[key]) == held)
        nouns = sel(_NOUNS, "noun")
        return {
            "noun": nouns,
            "iv": sel([b for _, b in _INTRANSITIVE], "intransitive"),
            "tv": sel([b for _, b in _TRANSITIVE], "transitive"),
            "adj": sel(_ADJECTIVES, "adjective"),
            "adv": sel(_ADVERBS, "adverb"),
            "place": sel(_PLACES, "place"),
        }

    def _words_of(self, held: bool) -> set:
        pools = self._pools(held)
        out = set(pools["noun"]) | set(pools["adj"]) | set(pools["adv"])
        out |= {w for b in pools["iv"] + pools["tv"] for w in (b, _THIRD[b])}
        out |= {w for pl in pools["place"] for w in pl.split()}
        if not held:
            out |= set(_STRUCTURE)
        return out

    # -- generation -----------------------------------------------------------------------

    def _pair(self, label: int, u: np.ndarray, v: np.ndarray, split: str):
        """One pair: (phenomenon, premise Sentence, hypothesis Sentence). Structure draws use
        `u` only and modifier draws `v` only, so distractors never change the pair."""
        test_like = self.held_out and split != "train"
        train_like = self.held_out and split == "train"
        seen = self._pools(False if self.held_out else None)
        held = self._pools(True)
        phen = _pick(self.phenomena, u[0])
        _, pf, hf, rel, _ = _pick(self._by_key[(phen, label)], u[1])
        (pdet, pneg), (hdet, hneg) = _FORMS[pf], _FORMS[hf]
        if not train_like:  # "some N does not V" only outside training when held out
            if pdet == "a" and pneg and u[8] < 0.5:
                pdet = "some"
            if hdet == "a" and hneg and u[9] < 0.5:
                hdet = "some"
        if pdet == "a" and not pneg and u[8] < 0.5:
            pdet = "some"
        if hdet == "a" and not hneg and u[9] < 0.5:
            hdet = "some"
        all_nouns = seen["noun"] + (held["noun"] if test_like else ())
        if rel in ("same", "swap"):
            pool = held["noun"] if test_like and u[2] < 0.5 else seen["noun"]
            pn = _pick(pool, u[3])
            hn = pn
        elif rel in ("up", "down"):
            lower = _pick([n for n in seen["noun"] if n in _PARENT], u[3])
            upper = _pick(_ancestors(lower)[1:], u[4])
            pn, hn = (lower, upper) if rel == "up" else (upper, lower)
        else:  # other: disjoint nouns, within the same top category three times in four
            pn = _pick(seen["noun"], u[3])
            others = [n for n in seen["noun"] if _disjoint(pn, n)]
            close = [n for n in others if _ancestors(n)[-1] == _ancestors(pn)[-1]]
            hn = _pick(close if close and u[5] < 0.75 else others, u[4])
        verbs = held if test_like else seen
        if phen == "order":
            obj = _pick([n for n in all_nouns if _disjoint(pn, n)], u[5])
            if u[6] < 0.5:
                pn, obj = obj, pn
            verb = _pick(verbs["tv"], u[7])
            hs, ho = (pn, obj) if rel == "same" else (obj, pn)
        else:
            obj = hs = ho = None
            verb = _pick(verbs["iv"], u[7])
            hs = hn
        # distractors: `d` distinct kinds, same modifiers in both sentences
        mods_pool = held if test_like else seen
        kinds = [("adj", "adv", "place")[k] for k in np.argsort(v[:3])[: self.distractors]]
        adjs = (_pick(mods_pool["adj"], v[3]),) if "adj" in kinds else ()
        mods = tuple(_pick(mods_pool[k], v[4 + i]) for i, k in enumerate(("adv", "place"))
                     if k in kinds)
        oadjs = adjs if obj is not None else ()
        p = Sentence(pdet, pn, verb, pneg, adjs, obj, oadjs, mods)
        h = Sentence(hdet, hs, verb, hneg, adjs, ho, oadjs, mods)
        return phen, p, h

    def _generate(self, index: int, split: str):
        index, sid = _check_index(index), _split_id(split)
        B = self.batch_size
        rng = np.random.default_rng([self.seed, sid, index, 0])
        labels = np.concatenate([np.repeat(np.arange(3), B // 3),
                                 rng.permutation(3)[: B % 3]]).astype(np.int32)
        labels = rng.permutation(labels)
        U = rng.random((B, 10))
        V = np.random.default_rng([self.seed, sid, index, 1]).random((B, 6))
        return labels, [self._pair(int(y), U[b], V[b], split) for b, y in enumerate(labels)]

    def batch(self, index: int, split: str = "train") -> dict[str, np.ndarray]:
        """`{"inputs" (B, 2, T) int32, "targets" (B,) int32, "mask" (B,) float32}`."""
        labels, pairs = self._generate(index, split)
        T = self.seq_len
        tokens = np.zeros((len(pairs), T), np.int32)
        lens = np.zeros((len(pairs), 2), np.int32)
        ids = self._ids
        for b, (_, p, h) in enumerate(pairs):
            pw, hw = [ids[w] for w in p.words()], [ids[w] for w in h.words()]
            if len(pw) + len(hw) + 3 > T:
                raise ValueError(f"the pair {str(p)!r} / {str(h)!r} needs "
                                 f"{len(pw) + len(hw) + 3} tokens; raise seq_len.")
            row = [CLS, *pw, SEP, *hw, SEP]
            tokens[b, : len(row)] = row
            lens[b] = len(pw), len(hw)
        inputs = np.stack([tokens, _segments(lens, T)], axis=1)
        return {"inputs": inputs, "targets": labels,
                "mask": np.ones(len(pairs), np.float32)}

    def examples(self, index: int, split: str = "train") -> list[dict]:
        """Batch `index` of `split` as dicts `{"premise", "hypothesis", "label",
        "phenomenon"}` (strings), in batch order."""
        labels, pairs = self._generate(index, split)
        return [{"premise": str(p), "hypothesis": str(h), "label": NLI_LABELS[y],
                 "phenomenon": ph} for y, (ph, p, h) in zip(labels, pairs)]

    def decode(self, inputs_row: np.ndarray) -> tuple[list[str], list[str]]:
        """`(premise_words, hypothesis_words)` of one example's `inputs (2, T)`."""
        return _decode_row(inputs_row, self.vocab)

    def save(self, out_dir: Union[str, os.PathLike]) -> pathlib.Path:
        """Writes `vocab.json` (the fixed vocabulary) into `out_dir`."""
        return save_vocab(self.vocab, pathlib.Path(out_dir) / "vocab.json")

    def _overlap_rule(self) -> _OverlapRule:
        if self._rule is None:
            n = math.ceil(2048 / self.batch_size)
            bs = [self.batch(i, "train") for i in range(n)]
            neg = [self._ids[w] for w in ("no", "not")]
            self._rule = _OverlapRule(neg).fit(np.concatenate([b["inputs"] for b in bs]),
                                               np.concatenate([b["targets"] for b in bs]))
        return self._rule

    def baselines(self, batch: dict[str, np.ndarray]) -> dict[str, float]:
        """Accuracies on `batch` of shallow references: `chance_accuracy` (1/3),
        `majority_accuracy` (always answering entailment, the majority of the balanced
        training labels), and `overlap_accuracy`: a lookup table fitted on 2048 training
        pairs, keyed by the share of the hypothesis's words found in the premise (five bins)
        and by whether each sentence holds "no" or "not"; each key answers its most frequent
        training label."""
        return _baselines(batch, self.majority_label, self._overlap_rule())
