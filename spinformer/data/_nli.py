"""Natural language inference: premise/hypothesis pairs labelled entailment / neutral /
contradiction. `GeneratedNLI` makes them from a small logic (no download); `NLIFile` reads
SNLI/MNLI JSON-lines files the user supplies.

Batch format (both): `inputs (B, 2, T) int32` — row 0 the token ids of
`[CLS] premise [SEP] hypothesis [SEP]` then padding (id 0, only at the end), row 1 the segment
ids (1 for [CLS], the premise and its [SEP]; 2 for the hypothesis and its [SEP]; 0 for
padding); `targets (B,) int32` the label id (0 entailment, 1 neutral, 2 contradiction);
`mask (B,) float32` ones. `kind = "pair_classification"` (`spinformer.nn.PairClassifier`).
"""

from __future__ import annotations

import json
import pathlib
import re
import zlib
from collections import Counter
from typing import Optional, Sequence

import numpy as np

NLI_LABELS = ("entailment", "neutral", "contradiction")
PAD, CLS, SEP, UNK = 0, 1, 2, 3
SPECIALS = ("[PAD]", "[CLS]", "[SEP]", "[UNK]")
_SPLITS = {"train": 0, "val": 1, "test": 2}
_NEGATIONS = {"no", "not", "never", "nobody", "nothing", "n't"}


def _split_id(split: str) -> int:
    if split not in _SPLITS:
        raise ValueError(f"unknown split {split!r}; choose one of {sorted(_SPLITS)}.")
    return _SPLITS[split]


def encode_pair(premise: Sequence[int], hypothesis: Sequence[int], seq_len: int
                ) -> tuple[np.ndarray, bool]:
    """`(2, seq_len)` ids and segments of `[CLS] p [SEP] h [SEP]`, and whether it was cut
    (the longer sentence is shortened first; both [SEP]s are always kept)."""
    p, h = list(premise), list(hypothesis)
    room = seq_len - 3
    if room < 2:
        raise ValueError(f"seq_len={seq_len} leaves no room for a sentence pair; use >= 5.")
    cut = len(p) + len(h) > room
    while len(p) + len(h) > room:
        if len(p) >= len(h):
            p.pop()
        else:
            h.pop()
    ids = [CLS] + p + [SEP] + h + [SEP]
    seg = [1] * (len(p) + 2) + [2] * (len(h) + 1)
    out = np.zeros((2, seq_len), np.int32)
    out[0, :len(ids)] = ids
    out[1, :len(seg)] = seg
    return out, cut


class _PairData:
    """What both NLI datasets share: decoding and the shallow baselines."""

    kind = "pair_classification"
    num_classes = 3
    vocab: list[str]

    def decode(self, row: np.ndarray) -> tuple[list[str], list[str]]:
        """The premise and hypothesis words of one `inputs` row `(2, T)`."""
        ids, seg = np.asarray(row[0]), np.asarray(row[1])
        words = [self.vocab[i] for i in ids]
        prem = [w for w, s, i in zip(words, seg, ids) if s == 1 and i not in (CLS, SEP)]
        hyp = [w for w, s, i in zip(words, seg, ids) if s == 2 and i != SEP]
        return prem, hyp

    @staticmethod
    def heuristic_label(premise: Sequence[str], hypothesis: Sequence[str]) -> int:
        """The word-overlap / negation heuristic: contradiction if exactly one sentence holds
        a negation word, else entailment if every hypothesis word occurs in the premise,
        else neutral."""
        neg_p = bool(_NEGATIONS & set(premise))
        neg_h = bool(_NEGATIONS & set(hypothesis))
        if neg_p != neg_h:
            return 2
        return 0 if set(hypothesis) <= set(premise) else 1

    def baselines(self, batch: dict[str, np.ndarray]) -> dict[str, float]:
        """`chance_accuracy` (1/3), `majority_accuracy` (always the most frequent label of the
        batch — an upper bound on any constant guess) and `overlap_accuracy` (the
        `heuristic_label` rule): how far shallow cues go."""
        t = batch["targets"]
        guesses = np.array([self.heuristic_label(*self.decode(row)) for row in batch["inputs"]])
        return {
            "chance_accuracy": 1.0 / 3.0,
            "majority_accuracy": float(np.bincount(t, minlength=3).max() / len(t)),
            "overlap_accuracy": float(np.mean(guesses == t)),
        }


# ----------------------------------------------------------------------------- generated

_HYPERNYM = {"dog": "animal", "cat": "animal", "horse": "animal", "bird": "animal",
             "man": "person", "woman": "person", "boy": "person", "girl": "person"}
_NOUNS = tuple(_HYPERNYM) + ("animal", "person")
_VERBS = {"runs": "run", "sleeps": "sleep", "eats": "eat", "sits": "sit", "jumps": "jump",
          "swims": "swim"}
_TVERBS = {"chases": "chase", "pushes": "push", "sees": "see", "follows": "follow"}
_FILLERS = ("today", "now", "here", "again", "indeed")
_DETS = ("the", "a", "every", "no")
_WORDS = (("a", "an", "the", "every", "no", "does", "not") + _NOUNS + tuple(_VERBS)
          + tuple(_VERBS.values()) + tuple(_TVERBS) + tuple(_TVERBS.values()) + _FILLERS)


def _isa(x: str, y: str) -> bool:
    """x is a y (x == y or y is x's hypernym)."""
    return x == y or _HYPERNYM.get(x) == y


def oracle(p: tuple, h: tuple) -> int:
    """The label of a premise/hypothesis pair of parsed sentences, by the task's semantics.

    Sentences are `("intr", det, noun, neg, verb)` (det in the/a/every/no; `neg`: "does not")
    or `("tr", subject, neg, verb, object)` (definite: "the S verb the O"). Semantics: one
    scene; "the N"/"a N" name a salient entity of kind N, so a hyponym entails its hypernym
    ("the dog runs" ⇒ "the animal runs") but not conversely; an entity does one intransitive
    activity at a time (different verbs of the same entity contradict); "every N" and "no N"
    quantify over the N of the scene, which exist; word order fixes the roles (swapped roles
    are neutral: both may hold).

    **Returns:** 0 entailment, 1 neutral, 2 contradiction.
    """
    E, N, C = 0, 1, 2
    if p[0] == "tr" or h[0] == "tr":
        if p[0] != h[0]:
            return N
        _, s1, n1, v1, o1 = p
        _, s2, n2, v2, o2 = h
        if v1 == v2 and _isa(s1, s2) and _isa(o1, o2):
            if n1 == n2:
                return E
            if s1 == s2 and o1 == o2:
                return C
        if v1 == v2 and n1 and n2 and s1 == s2 and o1 == o2:
            return E  # pragma: no cover (same sentence, covered above)
        return N
    _, dp, np_, negp, vp = p
    _, dh, nh, negh, vh = h
    pos_h = dh in ("the", "a") and not negh
    neg_h = dh in ("the", "a") and negh
    if dp == "every" and not negp:
        if pos_h:
            return (E if vh == vp else C) if _isa(nh, np_) else N
        if neg_h:
            return C if (_isa(nh, np_) and vh == vp) else N
        if dh == "no":
            return C if ((_isa(np_, nh) or _isa(nh, np_)) and vh == vp) else N
        if dh == "every":
            return E if (_isa(nh, np_) and vh == vp) else N
        return N
    if dp == "no" and not negp:
        if pos_h:
            return C if (_isa(nh, np_) and vh == vp) else N
        if neg_h:
            return E if (_isa(nh, np_) and vh == vp) else N
        if dh == "no":
            return E if (_isa(nh, np_) and vh == vp) else N
        if dh == "every":
            return C if (_isa(nh, np_) and vh == vp) else N
        return N
    if dp in ("the", "a") and not negp:
        if pos_h:
            if _isa(np_, nh) and vh == vp:
                return E
            return C if (nh == np_ and vh != vp) else N
        if neg_h:
            if nh == np_:
                return C if vh == vp else E
            return N
        if dh == "no":
            return C if (_isa(np_, nh) and vh == vp) else N
        return N
    if dp in ("the", "a") and negp:
        if pos_h:
            return C if (nh == np_ and vh == vp) else N
        if neg_h:
            return E if (nh == np_ and vh == vp) else N
        return N
    return N


def render(s: tuple) -> list[str]:
    """The words of a parsed sentence (see `oracle`)."""
    if s[0] == "tr":
        _, subj, neg, verb, obj = s
        mid = ["does", "not", _TVERBS[verb]] if neg else [verb]
        return ["the", subj] + mid + ["the", obj]
    _, det, noun, neg, verb = s
    if det == "a" and noun == "animal":
        det = "an"
    return [det, noun] + (["does", "not", _VERBS[verb]] if neg else [verb])


def _held_out(noun: str, verb: str) -> bool:
    """(noun, verb) combinations reserved for validation and test (about one in four)."""
    return zlib.crc32(f"{noun}|{verb}".encode()) % 4 == 0


_PHENOMENA = ("negation", "quantifier", "order", "lexical")


class GeneratedNLI(_PairData):
    """Generated NLI whose labels follow from a small logic (`oracle`): negation,
    quantifiers (every / no), word order (transitive sentences with swapped roles) and
    lexical entailment through hypernyms (dog → animal, boy → person).

    **Arguments:**

    - `seq_len`: T, the padded pair length (32 fits every pair with `distractors <= 3`).
    - `batch_size`: pairs per batch; labels are exactly balanced (index b has label b mod 3
      before a shuffle).
    - `seed`: batch i of split s depends only on (seed, s, i).
    - `distractors`: filler words (today, now, here, again, indeed) appended to each
      sentence, 0..`distractors` each; they do not change the label (difficulty knob).
    - `phenomena`: which constructions the hypotheses are made by (a subset of
      `("negation", "quantifier", "order", "lexical")`).
    - `held_out`: about a quarter of the (noun, verb) combinations never occur in training;
      validation and test premises always use one of them, so memorising sentences does not
      solve the test (every word still occurs in training, in other combinations).

    `vocab` is fixed (built from the word lists), shared by the splits.
    """

    def __init__(self, seq_len: int = 32, batch_size: int = 32, seed: int = 0, *,
                 distractors: int = 0, phenomena: Sequence[str] = _PHENOMENA,
                 held_out: bool = True):
        bad = set(phenomena) - set(_PHENOMENA)
        if bad or not phenomena:
            raise ValueError(f"GeneratedNLI: phenomena must be a non-empty subset of "
                             f"{_PHENOMENA}; got {tuple(phenomena)}.")
        if distractors < 0:
            raise ValueError(f"GeneratedNLI: distractors={distractors} must be >= 0.")
        self.vocab = list(SPECIALS) + list(dict.fromkeys(_WORDS))
        self._ids = {w: i for i, w in enumerate(self.vocab)}
        self.vocab_size = len(self.vocab)
        longest = 2 * (7 + distractors) + 3
        if seq_len < longest:
            raise ValueError(f"GeneratedNLI: seq_len={seq_len} is too short for pairs with "
                             f"distractors={distractors}; use seq_len >= {longest}.")
        self.seq_len, self.batch_size, self.seed = seq_len, batch_size, seed
        self.distractors, self.phenomena, self.held_out = distractors, tuple(phenomena), held_out

    # sentence pairs ----------------------------------------------------------------------

    def _premise(self, rng, split):
        for _ in range(1000):
            if "order" in self.phenomena and rng.random() < 0.25:
                subj, obj = rng.choice(_NOUNS[:8], 2, replace=False)
                s = ("tr", str(subj), False, str(rng.choice(list(_TVERBS))), str(obj))
                key = (s[1], s[3])
            else:
                det = str(rng.choice(_DETS)) if "quantifier" in self.phenomena else "the"
                neg = det in ("the", "a") and "negation" in self.phenomena and rng.random() < 0.3
                s = ("intr", det, str(rng.choice(_NOUNS)), neg, str(rng.choice(list(_VERBS))))
                key = (s[2], s[4])
            if not self.held_out or _held_out(*key) == (split != "train"):
                return s
        raise RuntimeError("GeneratedNLI: no premise found")  # pragma: no cover

    def _hypothesis(self, rng, p):
        """A random edit of the premise by one of the phenomena."""
        if p[0] == "tr":
            _, s, neg, v, o = p
            r = rng.random()
            if r < 0.35:
                return ("tr", o, neg, v, s)  # swapped roles
            if r < 0.6 and "negation" in self.phenomena:
                return ("tr", s, not neg, v, o)
            if r < 0.8 and "lexical" in self.phenomena:
                return ("tr", _HYPERNYM.get(s, s), neg, v, _HYPERNYM.get(o, o))
            return ("tr", s, neg, str(rng.choice(list(_TVERBS))), o)
        _, d, n, neg, v = p
        edits = ["verb", "noun"] + [ph for ph in self.phenomena if ph != "order"]
        edit = edits[rng.integers(len(edits))]
        if edit == "negation":
            return ("intr", "the" if d in ("every", "no") else d, n, not neg, v)
        if edit == "quantifier":
            return ("intr", str(rng.choice(_DETS)), n, False, v)
        if edit == "lexical":
            if n in _HYPERNYM and rng.random() < 0.6:
                return ("intr", d, _HYPERNYM[n], neg, v)
            hypos = [k for k, hv in _HYPERNYM.items() if hv == n] or [n]
            return ("intr", "the" if d == "no" else d, str(rng.choice(hypos)), neg, v)
        if edit == "verb":
            return ("intr", d, n, neg, str(rng.choice(list(_VERBS))))
        return ("intr", d, str(rng.choice(_NOUNS)), neg, v)

    def _words(self, rng, s):
        words = render(s)
        k = int(rng.integers(0, self.distractors + 1)) if self.distractors else 0
        return words + [str(w) for w in rng.choice(_FILLERS, k)]

    def sample(self, rng: np.random.Generator, label: int, split: str = "train"):
        """One pair with the given label: `(premise, hypothesis)` parsed sentences."""
        for _ in range(5000):
            p = self._premise(rng, split)
            h = self._hypothesis(rng, p)
            if h[0] == "intr" and self.held_out and split == "train" and _held_out(h[2], h[4]):
                continue
            if h[0] == "tr" and self.held_out and split == "train" and _held_out(h[1], h[3]):
                continue
            if oracle(p, h) == label:
                return p, h
        raise RuntimeError(f"GeneratedNLI: could not generate label {label} with phenomena "
                           f"{self.phenomena}; add phenomena.")

    def batch(self, index: int, split: str = "train") -> dict[str, np.ndarray]:
        rng = np.random.default_rng([self.seed, _split_id(split), index])
        labels = np.arange(self.batch_size) % 3
        rng.shuffle(labels)
        inputs = np.zeros((self.batch_size, 2, self.seq_len), np.int32)
        for b, label in enumerate(labels):
            p, h = self.sample(rng, int(label), split)
            ids = [[self._ids[w] for w in self._words(rng, s)] for s in (p, h)]
            inputs[b], cut = encode_pair(ids[0], ids[1], self.seq_len)
            assert not cut  # seq_len was checked against the longest pair
        return {"inputs": inputs, "targets": labels.astype(np.int32),
                "mask": np.ones(self.batch_size, np.float32)}


# ----------------------------------------------------------------------------- files

_TOKEN = re.compile(r"[a-z0-9]+(?:'[a-z]+)?|[^\sa-z0-9]")
_FIELDS = ("sentence1", "sentence2", "gold_label")


def tokenize(text: str) -> list[str]:
    """Lower-case words, punctuation split off ("A man's dog." → a, man's, dog, .)."""
    return _TOKEN.findall(text.lower())


def read_jsonl(path) -> tuple[list[tuple[str, str, int]], int]:
    """`(examples, dropped)`: (premise, hypothesis, label id) per line with a gold label; the
    number of lines with gold_label "-" (no annotator majority), which are dropped."""
    path = pathlib.Path(path)
    out, dropped = [], 0
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path.name}, line {lineno}: not JSON ({e.msg}); each line "
                                 f"must be an object with fields {list(_FIELDS)}.") from None
            missing = [k for k in _FIELDS if not isinstance(rec, dict) or k not in rec]
            if missing:
                found = sorted(rec) if isinstance(rec, dict) else type(rec).__name__
                raise ValueError(f"{path.name}, line {lineno}: missing field(s) {missing}; "
                                 f"expected {list(_FIELDS)}, found {found}.")
            label = rec["gold_label"]
            if label == "-":
                dropped += 1
                continue
            if label not in NLI_LABELS:
                raise ValueError(f"{path.name}, line {lineno}: gold_label {label!r} is not one "
                                 f"of {list(NLI_LABELS)} or '-'.")
            out.append((str(rec["sentence1"]), str(rec["sentence2"]), NLI_LABELS.index(label)))
    return out, dropped


def _find_files(path: pathlib.Path) -> dict[str, Optional[pathlib.Path]]:
    if path.is_file():
        return {"train": path, "val": None, "test": None}
    if not path.is_dir():
        raise FileNotFoundError(
            f"NLI data not found at {path}: give the directory holding the SNLI/MNLI JSON-lines "
            "files (e.g. snli_1.0_train.jsonl, snli_1.0_dev.jsonl, snli_1.0_test.jsonl) or one "
            "training .jsonl file.")
    files = sorted(path.glob("*.jsonl"))

    def pick(*keys):
        for k in keys:
            got = [f for f in files if k in f.name]
            if got:
                return got[0]
        return None

    found = {"train": pick("train"), "val": pick("dev_matched", "dev", "val"),
             "test": pick("test", "dev_matched")}
    if found["train"] is None:
        raise FileNotFoundError(f"no training file (a .jsonl whose name contains 'train') in "
                                f"{path}; found {[f.name for f in files]}.")
    return found


class NLIFile(_PairData):
    """SNLI/MNLI JSON-lines files (fields sentence1, sentence2, gold_label), word-tokenised
    with a vocabulary built on the training split. Build with `NLIFile.from_path`.

    Splits: the files of `from_path`; without a validation (test) file, the last 5% of the
    training pairs (after a seeded shuffle) become validation (and the 5% before them test).
    MNLI has no public test labels: its test split is dev_matched. `dropped` counts the "-"
    labels dropped per split, `truncated` the pairs cut to `seq_len`; `summary()` says both.
    Batch i of train is drawn from a permutation fixed by (seed, epoch); val/test walk their
    split in order and wrap around.
    """

    def __init__(self, splits, dropped, vocab, *, seq_len, batch_size, seed):
        self.vocab = list(vocab)
        self._ids = {w: i for i, w in enumerate(self.vocab)}
        self.vocab_size = len(self.vocab)
        self.seq_len, self.batch_size, self.seed = seq_len, batch_size, seed
        self.dropped = dict(dropped)
        self.truncated = {}
        self._data = {}
        for name, examples in splits.items():
            if not examples:
                raise ValueError(f"NLIFile: the {name} split is empty.")
            enc = [encode_pair(self._encode(p), self._encode(h), seq_len) for p, h, _ in examples]
            self._data[name] = (np.stack([e for e, _ in enc]),
                                np.array([y for _, _, y in examples], np.int32))
            self.truncated[name] = int(sum(c for _, c in enc))

    @classmethod
    def from_path(cls, path, *, seq_len: int = 64, batch_size: int = 32, seed: int = 0,
                  max_vocab: int = 20000, min_count: int = 1,
                  max_examples: Optional[int] = None, vocab: Optional[list[str]] = None):
        """Read the files at `path` (a directory or one training file; see the class).

        **Arguments:** `seq_len`, `batch_size`, `seed` as the other datasets; `max_vocab`,
        `min_count`: the training words kept (others are [UNK]); `max_examples`: use only
        the first training pairs; `vocab`: a saved vocabulary (`load_vocab`) instead.
        """
        files = _find_files(pathlib.Path(path))
        train, dropped_train = read_jsonl(files["train"])
        if max_examples is not None:
            train = train[:max_examples]
        dropped = {"train": dropped_train}
        splits = {}
        if files["val"] is None or files["test"] is None:
            order = np.random.default_rng(seed).permutation(len(train))
            k = max(1, len(train) // 20)
            if files["val"] is None:
                splits["val"] = [train[i] for i in order[-k:]]
                order = order[:-k]
            if files["test"] is None:
                splits["test"] = [train[i] for i in order[-k:]]
                order = order[:-k]
            train = [train[i] for i in sorted(order)]
        for name in ("val", "test"):
            if files[name] is not None:
                splits[name], dropped[name] = read_jsonl(files[name])
        splits["train"] = train
        if vocab is None:
            counts = Counter(w for p, h, _ in train for w in tokenize(p) + tokenize(h))
            words = [w for w, c in counts.most_common(max_vocab) if c >= min_count]
            vocab = list(SPECIALS) + [w for w in words if w not in SPECIALS]
        return cls(splits, dropped, vocab, seq_len=seq_len, batch_size=batch_size, seed=seed)

    def _encode(self, text: str) -> list[int]:
        return [self._ids.get(w, UNK) for w in tokenize(text)]

    def summary(self) -> str:
        sizes = ", ".join(f"{k} {len(v[1])}" for k, v in self._data.items())
        return (f"NLI pairs: {sizes}; dropped '-' labels: {self.dropped}; truncated to "
                f"{self.seq_len} tokens: {self.truncated}; vocabulary {self.vocab_size} words.")

    def batch(self, index: int, split: str = "train") -> dict[str, np.ndarray]:
        inputs, targets = self._data[{"val": "val", "test": "test"}.get(split, split)] \
            if split in self._data else (None, None)
        if inputs is None:
            _split_id(split)
            raise ValueError(f"NLIFile: no {split} split.")
        n, B = len(targets), self.batch_size
        if split == "train":
            per_epoch = max(1, n // B)
            epoch, i = divmod(index, per_epoch)
            perm = np.random.default_rng([self.seed, epoch]).permutation(n)
            idx = perm[(i * B + np.arange(B)) % n]
        else:
            idx = (index * B + np.arange(B)) % n
        return {"inputs": inputs[idx], "targets": targets[idx],
                "mask": np.ones(B, np.float32)}

    def save_vocab(self, path) -> None:
        pathlib.Path(path).write_text(json.dumps(self.vocab))

    def save(self, out_dir) -> None:
        """Write the vocabulary to `out_dir/vocab.json` (the trainer calls this)."""
        self.save_vocab(pathlib.Path(out_dir) / "vocab.json")


def load_vocab(path) -> list[str]:
    """A vocabulary saved by `NLIFile.save_vocab` (a JSON list of words by id)."""
    vocab = json.loads(pathlib.Path(path).read_text())
    if not (isinstance(vocab, list) and vocab[:4] == list(SPECIALS)):
        raise ValueError(f"{path}: not a saved NLI vocabulary (a JSON list starting with "
                         f"{list(SPECIALS)}).")
    return vocab
