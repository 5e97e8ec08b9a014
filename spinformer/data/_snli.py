"""SNLI/MultiNLI-style JSON-lines files the user supplies, served as NLI batches (`NLIFile`)."""

from __future__ import annotations

import json
import os
import pathlib
from typing import Optional, Sequence, Union

import numpy as np

from ._pairs import (NEGATION_WORDS, NLI_LABELS, UNK, _LABEL_ID, _SPLITS, _OverlapRule,
                     _baselines, _check_index, _check_vocab, _decode_row, _pack, _segments,
                     _split_id, build_vocab, load_vocab, save_vocab, tokenize)
from ._protocol import DataFileError

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
      `data._pairs.build_vocab`: at most `max_vocab` entries, special tokens included; rarer
      words and words seen fewer than `min_count` times become `[UNK]`).
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
