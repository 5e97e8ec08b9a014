"""Image classification: MNIST-format IDX files (Fashion-MNIST and the like), the 8×8 digits
that ship with scikit-learn, and in-memory arrays, all served as deterministic batches of
numpy arrays; plus `patchify` / `unpatchify` to cut images into patch tokens.

**Batch format** (`kind = "image_classification"`): `batch(index, split)` returns

- `inputs (B, H, W) float32` (`(B, H, W, C)` for images with channels): pixels divided by
  their maximum (255 for IDX files, 16 for the digits) and, with `normalize=True`,
  standardised with one mean and one standard deviation computed once on the training split;
- `targets (B,) int32`: class ids `0 ... num_classes - 1`;
- `mask (B,) float32`: ones for training batches; for validation and test batches, ones
  except at the positions that wrap around past the end of the split (zeros there), so that
  the first `num_batches(split)` batches count every example exactly once.

**Files.** The IDX format (Y. LeCun, C. Cortes, C. J. C. Burges, "The MNIST database of
handwritten digits", http://yann.lecun.com/exdb/mnist/, section "File formats"): a magic
number whose first two bytes are zero, whose third byte is the element type (0x08 unsigned
byte, 0x09 signed byte, 0x0B int16, 0x0C int32, 0x0D float32, 0x0E float64) and whose fourth
is the number of dimensions; then each dimension's size as a big-endian uint32; then the
elements, big-endian, row-major. MNIST label files have magic 0x00000801 (uint8, 1 dimension),
image files 0x00000803 (uint8, 3 dimensions).

Fashion-MNIST (H. Xiao, K. Rasul, R. Vollgraf, "Fashion-MNIST: a Novel Image Dataset for
Benchmarking Machine Learning Algorithms", arXiv:1708.07747, 2017,
https://github.com/zalandoresearch/fashion-mnist) keeps MNIST's format and sizes: 60,000
training and 10,000 test images of 28×28 grey pixels, 10 classes (`FASHION_MNIST_CLASSES`),
6,000 training and 1,000 test images per class. The Debian package `dataset-fashion-mnist`
installs the four gzipped files in `/usr/share/datasets/fashion-mnist`.

The digits (`sklearn.datasets.load_digits`: the test part of the UCI "Optical Recognition of
Handwritten Digits" data, E. Alpaydin, C. Kaynak, 1998,
https://archive.ics.uci.edu/dataset/80) are 1,797 images of 8×8 pixels with values 0..16.

Patches as tokens follow A. Dosovitskiy et al., "An Image is Worth 16x16 Words: Transformers
for Image Recognition at Scale", arXiv:2010.11929 (2020).

**What the sources get wrong.** Nothing found: the MNIST page's description of the IDX
header (magic numbers 0x00000801 and 0x00000803, big-endian sizes) and Fashion-MNIST's
stated sizes and class balance (6,000 training and 1,000 test images per class) match the
published files exactly, and the usually quoted Fashion-MNIST pixel statistics (mean 0.2860,
standard deviation 0.3530 over the training images scaled to [0, 1]) are right (checked in
the tests; MNIST's 0.1307 and 0.3081, often reused for Fashion-MNIST, are not its numbers).

**Two pitfalls of the usual batching recipes, avoided here.**

- A stream drawn as "epoch = index·B // n_train, one permutation per (seed, epoch)" covers
  every training example once per epoch only if each *position* of the stream, not each
  batch, takes its epoch: when B does not divide n_train a batch straddles two epochs, and
  drawing the whole batch from the first one's permutation repeats its first examples and
  skips others. Here position `p = index·B + k` takes example `perm_{p // n}[p % n]`.
- Val/test batches that wrap around count the first examples twice in the last partial
  batch; the mask is zero there so that an evaluation over `num_batches(split)` batches is
  exactly the split's mean.
"""

from __future__ import annotations

import functools
import gzip
import math
import os
import pathlib
import zlib
from typing import Any, Optional, Sequence, Union

import numpy as np

from ._protocol import DataFileError

__all__ = [
    "DIGITS_CLASSES",
    "FASHION_MNIST_CLASSES",
    "FASHION_MNIST_DIR",
    "ImageDataError",
    "ImageDataNotFound",
    "ImageDataset",
    "find_mnist_files",
    "load_mnist",
    "patchify",
    "read_idx",
    "unpatchify",
    "write_idx",
]

PathLike = Union[str, os.PathLike]

FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist"
FASHION_MNIST_PACKAGE = "dataset-fashion-mnist"
FASHION_MNIST_CLASSES = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal",
                         "Shirt", "Sneaker", "Bag", "Ankle boot")
DIGITS_CLASSES = tuple(str(d) for d in range(10))

_SPLITS = {"train": 0, "val": 1, "test": 2}

# IDX element types: code -> (big-endian numpy dtype, name)
_IDX_TYPES = {
    0x08: (np.dtype(">u1"), "uint8"),
    0x09: (np.dtype(">i1"), "int8"),
    0x0B: (np.dtype(">i2"), "int16"),
    0x0C: (np.dtype(">i4"), "int32"),
    0x0D: (np.dtype(">f4"), "float32"),
    0x0E: (np.dtype(">f8"), "float64"),
}
_IDX_CODES = {np.dtype(dt.newbyteorder("=")).str[1:]: code for code, (dt, _) in
              _IDX_TYPES.items()}
_GZIP_MAGIC = b"\x1f\x8b"
_PREALLOCATE = 1 << 28  # payloads up to 256 MiB are read into a preallocated buffer
_CHUNK = 1 << 24
_REDOWNLOAD = ("re-download the file, or reinstall the package that provides it (Fashion-MNIST: "
               f"`apt-get install --reinstall {FASHION_MNIST_PACKAGE}`)")


class ImageDataError(DataFileError):
    """An image data file or directory is unreadable: a truncated, corrupt or mismatched IDX
    file, files that do not belong together, or a file the system will not let us read. The
    message names the file and the problem. A `DataFileError`, so a `ValueError`."""


class ImageDataNotFound(ImageDataError, FileNotFoundError):
    """Image data is missing: no such directory, or some of the four MNIST-format files are
    absent. Both an `ImageDataError` (a `ValueError`) and a `FileNotFoundError`, so the
    command line reports it in one line; the message says how to install the data or where to
    point `data.path`."""


# --------------------------------------------------------------------------------------------
# IDX files
# --------------------------------------------------------------------------------------------


def _shape_text(dims: Sequence[int]) -> str:
    return "×".join(str(d) for d in dims)


def write_idx(path: PathLike, array: Any) -> pathlib.Path:
    """Writes `array` as an IDX file (gzip-compressed when `path` ends in `.gz`).

    **Arguments:**

    - `path`: the file to write (its directory must exist).
    - `array`: at least one dimension, at most 255, each below 2³²; dtype uint8, int8, int16,
      int32, float32 or float64 (MNIST uses uint8: labels `(N,)`, images `(N, H, W)`).

    **Returns:** the path written. `read_idx(path)` gives `array` back.
    """
    a = np.asarray(array)
    key = a.dtype.str[1:] if a.dtype.kind in "uif" else None
    if key not in _IDX_CODES:
        raise ValueError(f"write_idx: IDX stores uint8, int8, int16, int32, float32 or float64; "
                         f"got dtype {a.dtype}. Convert the array first, e.g. "
                         f"array.astype(np.uint8).")
    if not 1 <= a.ndim <= 255:
        raise ValueError(f"write_idx: IDX arrays have 1 to 255 dimensions; got shape {a.shape}.")
    if any(d >= 2**32 for d in a.shape):
        raise ValueError(f"write_idx: each dimension must be below 2**32; got shape {a.shape}.")
    code = _IDX_CODES[key]
    header = bytes([0, 0, code, a.ndim]) + np.asarray(a.shape, ">u4").tobytes()
    payload = np.ascontiguousarray(a, dtype=_IDX_TYPES[code][0]).tobytes()
    path = pathlib.Path(path)
    if path.name.endswith(".gz"):
        with open(path, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as f:
            f.write(header)
            f.write(payload)
    else:
        with open(path, "wb") as f:
            f.write(header)
            f.write(payload)
    return path


def _read_exactly(f, n: int) -> bytes:
    chunks, got = [], 0
    while got < n:
        chunk = f.read(n - got)
        if not chunk:
            break
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _count_rest(f) -> int:
    extra = 0
    while True:
        chunk = f.read(1 << 20)
        if not chunk:
            return extra
        extra += len(chunk)


def _size_message(said: str, nbytes: int, have: int) -> str:
    if have < nbytes:
        return f"{said}, the file has {have} (truncated? {_REDOWNLOAD})."
    return (f"{said}, the file has {have} ({have - nbytes} bytes too many): the header does "
            f"not match the data; {_REDOWNLOAD}.")


def _read_payload(f, nbytes: int) -> tuple[np.ndarray, int]:
    """Up to `nbytes` bytes of `f` as a uint8 array, and how many were read. Small payloads
    are read into a preallocated buffer; large ones in chunks, so that a corrupt header
    announcing terabytes fails on the short file instead of on the allocation."""
    if nbytes <= _PREALLOCATE:
        buf = np.empty(nbytes, np.uint8)
        view, got = memoryview(buf), 0
        while got < nbytes:  # readinto may stop short of a full buffer
            more = f.readinto(view[got:])
            if not more:
                break
            got += more
        return buf, got
    grown = bytearray()
    while len(grown) < nbytes:
        chunk = f.read(min(_CHUNK, nbytes - len(grown)))
        if not chunk:
            break
        grown += chunk
    return np.frombuffer(grown, np.uint8), len(grown)


def _parse_idx(f, name: str, gz: bool, ndim: Optional[int],
               file_size: Optional[int] = None) -> np.ndarray:
    head = _read_exactly(f, 4)
    if len(head) < 4:
        raise ImageDataError(f"{name}: {len(head)} bytes, too short for an IDX header (4 bytes "
                             f"of magic number); the file is empty or truncated: {_REDOWNLOAD}.")
    if head[:2] != b"\0\0" or head[2] not in _IDX_TYPES:
        hint = (" The name ends in .gz but the file is not gzip-compressed either."
                if name.endswith(".gz") and not gz else "")
        raise ImageDataError(
            f"{name}: magic number 0x{head.hex()} is not an IDX header (expected 0x0000TTDD: two "
            f"zero bytes, an element type TT in {{08, 09, 0B, 0C, 0D, 0E}} and the number of "
            f"dimensions DD; MNIST labels are 0x00000801, images 0x00000803).{hint} Is this "
            f"an MNIST-format file? If so it is corrupt: {_REDOWNLOAD}."
        )
    dtype, type_name = _IDX_TYPES[head[2]]
    nd = head[3]
    if nd == 0:
        raise ImageDataError(f"{name}: the header declares 0 dimensions; an IDX array has at "
                             f"least one. The file is corrupt: {_REDOWNLOAD}.")
    if ndim is not None and nd != ndim:
        raise ImageDataError(
            f"{name}: expected {ndim} dimension(s), the header (magic 0x{head.hex()}) declares "
            f"{nd} (MNIST labels have 1, magic 0x00000801; images 3, magic 0x00000803). Are "
            f"label and image files swapped?"
        )
    dims_raw = _read_exactly(f, 4 * nd)
    if len(dims_raw) < 4 * nd:
        raise ImageDataError(f"{name}: the header declares {nd} dimensions ({4 * nd} bytes of "
                             f"sizes) but only {len(dims_raw)} of those bytes are there "
                             f"(truncated? {_REDOWNLOAD}).")
    dims = tuple(int(d) for d in np.frombuffer(dims_raw, ">u4"))
    nbytes = math.prod(dims) * dtype.itemsize
    said = f"{name}: header says {_shape_text(dims)} {type_name} = {nbytes} bytes of data"
    if file_size is not None:  # a raw file: compare sizes before reading anything
        have = file_size - 4 - 4 * nd
        if have != nbytes:
            raise ImageDataError(_size_message(said, nbytes, have))
    buf, got = _read_payload(f, nbytes)
    if got < nbytes:
        raise ImageDataError(_size_message(said, nbytes, got))
    extra = _count_rest(f)
    if extra:
        raise ImageDataError(_size_message(said, nbytes, nbytes + extra))
    return buf.view(dtype).reshape(dims).astype(dtype.newbyteorder("="), copy=False)


def read_idx(path: PathLike, *, ndim: Optional[int] = None) -> np.ndarray:
    """Reads an IDX file (the MNIST format), gzip-compressed or raw.

    Compression is recognised by the file's first bytes (the gzip magic 1f 8b), not by its
    name. The header is checked: two zero bytes, a known element type (0x08 uint8, 0x09 int8,
    0x0B int16, 0x0C int32, 0x0D float32, 0x0E float64), at least one dimension (`ndim` of
    them when given), and a payload of exactly the size the header announces.

    **Arguments:**

    - `path`: the file.
    - `ndim`: the number of dimensions expected (MNIST: 1 for labels, 3 for images), or None.

    **Returns:** a numpy array of the header's shape, in native byte order (uint8 for MNIST).

    **Raises:** `ImageDataNotFound` if the file does not exist; `ImageDataError` (a
    `ValueError`) naming the file and the problem for a truncated or oversized payload, a
    wrong magic number or dimension count, a corrupt gzip stream, or a file that is a
    directory or cannot be opened (permissions).
    """
    path = pathlib.Path(path)
    name = str(path)
    if not path.exists():
        raise ImageDataNotFound(f"{name}: no such file.")
    if not path.is_file():
        raise ImageDataError(f"{name}: not a file (a directory?); expected an IDX file.")
    try:
        raw = open(path, "rb")
    except OSError as e:
        raise ImageDataError(f"{name}: cannot be read ({e.strerror or e}).") from None
    with raw:
        gz = raw.read(2) == _GZIP_MAGIC
        raw.seek(0)
        if not gz:
            return _parse_idx(raw, name, False, ndim, file_size=os.fstat(raw.fileno()).st_size)
        try:
            with gzip.GzipFile(fileobj=raw, mode="rb") as f:
                return _parse_idx(f, name, True, ndim)
        except (OSError, EOFError, zlib.error) as e:
            raise ImageDataError(
                f"{name}: not a valid gzip file ({type(e).__name__}: {e}); the download is "
                f"truncated or corrupt: {_REDOWNLOAD}."
            ) from None


# --------------------------------------------------------------------------------------------
# MNIST-format directories
# --------------------------------------------------------------------------------------------

_MNIST_FILES = {
    "train_images": ("train-images", "idx3"),
    "train_labels": ("train-labels", "idx1"),
    "test_images": ("t10k-images", "idx3"),
    "test_labels": ("t10k-labels", "idx1"),
}


def _canonical(role: str) -> str:
    stem, idx = _MNIST_FILES[role]
    return f"{stem}-{idx}-ubyte"


def _install_hint() -> str:
    names = ", ".join(f"{_canonical(r)}[.gz]" for r in _MNIST_FILES)
    return (f"install Fashion-MNIST with `apt-get install {FASHION_MNIST_PACKAGE}` (it goes to "
            f"{FASHION_MNIST_DIR}) or set data.path to a directory holding the MNIST-format IDX "
            f"files ({names})")


def find_mnist_files(path: Optional[PathLike] = None) -> dict[str, pathlib.Path]:
    """Locates the four files of an MNIST-format dataset in a directory.

    Each of `train-images-idx3-ubyte`, `train-labels-idx1-ubyte`, `t10k-images-idx3-ubyte`,
    `t10k-labels-idx1-ubyte` may end in `.gz`, and may be spelt with a dot before `idx`
    (`t10k-images.idx3-ubyte`, as some mirrors have it); the raw file is preferred when both
    exist. The directory itself is searched, then its `raw/` subdirectory (torchvision's
    layout).

    **Arguments:**

    - `path`: the directory; None means Fashion-MNIST's `FASHION_MNIST_DIR`
      (`/usr/share/datasets/fashion-mnist`, from `apt-get install dataset-fashion-mnist`).

    **Returns:** `{"train_images", "train_labels", "test_images", "test_labels"}` → path.

    **Raises:** `ImageDataNotFound` (a `FileNotFoundError` and a `ValueError`) when the
    directory does not exist or lacks some of the files; the message names the missing files,
    the package and its install command, and the `data.path` setting.
    """
    default = path is None
    where = pathlib.Path(FASHION_MNIST_DIR if default else path).expanduser()
    what = "Fashion-MNIST" if default else "MNIST-format data"
    if not where.exists():
        raise ImageDataNotFound(f"{what} not found in {where} (no such directory): "
                                f"{_install_hint()}.")
    if not where.is_dir():
        raise ImageDataNotFound(f"{what}: {where} is a file, not a directory: "
                                f"{_install_hint()}.")
    best: Optional[dict] = None
    for d in (where, where / "raw"):
        if not d.is_dir():
            continue
        found = {}
        for role, (stem, idx) in _MNIST_FILES.items():
            for sep in ("-", "."):
                for suffix in ("", ".gz"):
                    f = d / f"{stem}{sep}{idx}-ubyte{suffix}"
                    if role not in found and f.is_file():
                        found[role] = f
        if len(found) == len(_MNIST_FILES):
            return found
        if best is None or len(found) > len(best[1]):
            best = (d, found)
    d, found = best
    if not found:
        raise ImageDataNotFound(f"{what} not found in {where} (the directory holds none of the "
                                f"four MNIST-format files): {_install_hint()}.")
    missing = [_canonical(r) + "[.gz]" for r in _MNIST_FILES if r not in found]
    have = ", ".join(sorted(f.name for f in found.values()))
    raise ImageDataNotFound(f"{what} in {d} is incomplete: missing {', '.join(missing)} "
                            f"(found {have}); {_install_hint()}.")


def _stat_key(files: dict[str, pathlib.Path]) -> tuple:
    out = []
    for role in _MNIST_FILES:
        st = files[role].stat()
        out.append((role, str(files[role].resolve()), st.st_mtime_ns, st.st_size))
    return tuple(out)


@functools.lru_cache(maxsize=4)
def _load_mnist_cached(key: tuple) -> dict[str, np.ndarray]:
    files = {role: pathlib.Path(p) for role, p, _, _ in key}
    out = {}
    for part in ("train", "test"):
        fi, fl = files[f"{part}_images"], files[f"{part}_labels"]
        x = read_idx(fi, ndim=3)
        y = read_idx(fl, ndim=1)
        for f, a, kind in ((fi, x, "images"), (fl, y, "labels")):
            if a.dtype != np.uint8:
                raise ImageDataError(f"{f}: MNIST {kind} are uint8 (type code 0x08); this file "
                                     f"holds {a.dtype}.")
        if len(x) != len(y):
            raise ImageDataError(f"{fl.name} holds {len(y)} labels but {fi.name} holds {len(x)} "
                                 f"images ({fl.parent}): the files do not belong together; "
                                 f"{_REDOWNLOAD}.")
        if len(x) == 0:
            raise ImageDataError(f"{fi}: holds no images.")
        x.setflags(write=False)
        y.setflags(write=False)
        out[f"{part}_images"], out[f"{part}_labels"] = x, y
    if out["train_images"].shape[1:] != out["test_images"].shape[1:]:
        raise ImageDataError(
            f"{files['train_images'].name} holds {_shape_text(out['train_images'].shape[1:])} "
            f"images but {files['test_images'].name} "
            f"{_shape_text(out['test_images'].shape[1:])} ({files['test_images'].parent}): the "
            f"files do not belong together."
        )
    return out


def load_mnist(path: Optional[PathLike] = None) -> dict[str, np.ndarray]:
    """The four arrays of an MNIST-format directory (see `find_mnist_files`):
    `train_images (N, H, W) uint8`, `train_labels (N,) uint8`, `test_images`, `test_labels`.

    The decoded arrays are cached per directory (and the files' sizes and modification
    times) for the life of the process, so building several datasets reads the files once;
    they are read-only (copy them to modify).
    """
    return dict(_load_mnist_cached(_stat_key(find_mnist_files(path))))


@functools.lru_cache(maxsize=1)
def _digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise ImportError("the digits dataset comes with scikit-learn, which is not "
                          "installed: `pip install scikit-learn`.") from None
    d = load_digits()
    x = np.rint(d.images).astype(np.uint8)  # values 0..16
    y = d.target.astype(np.uint8)
    x.setflags(write=False)
    y.setflags(write=False)
    return x, y


# --------------------------------------------------------------------------------------------
# The dataset
# --------------------------------------------------------------------------------------------


def _check_index(index) -> int:
    if isinstance(index, bool) or not isinstance(index, (int, np.integer)) or index < 0:
        raise ValueError(f"batch index must be a non-negative integer; got {index!r}.")
    return int(index)


def _split_id(split: str) -> int:
    if split not in _SPLITS:
        raise ValueError(f"unknown split {split!r}; choose one of {sorted(_SPLITS)}.")
    return _SPLITS[split]


def _pixel_stats(x: np.ndarray, pixel_max: float) -> tuple[float, float]:
    """Mean and standard deviation (population, in float64) of all pixels of `x / pixel_max`."""
    if x.dtype == np.uint8:  # exact and fast: a histogram of the 256 values
        counts = np.bincount(x.reshape(-1), minlength=256).astype(np.float64)
        v = np.arange(256, dtype=np.float64) / pixel_max
        n = counts.sum()
        mean = float((counts * v).sum() / n)
        var = float((counts * (v - mean) ** 2).sum() / n)
    else:
        f = x.astype(np.float64) / pixel_max
        mean, var = float(f.mean()), float(f.var())
    return mean, math.sqrt(var)


class ImageDataset:
    """Image classification batches (the `Dataset` protocol, `kind = "image_classification"`).

    Build it with `ImageDataset.fashion_mnist(...)`, `ImageDataset.from_mnist_dir(path, ...)`,
    `ImageDataset.digits(...)`, or directly from arrays.

    **Arguments:**

    - `train`, `val`, `test`: `(images, labels)` pairs; images `(N, H, W)` or `(N, H, W, C)`
      (uint8 or any real dtype), labels `(N,)` non-negative integers; each split non-empty,
      all with the same image shape.
    - `batch_size`: B.
    - `seed`: the training order (a non-negative integer); batch `i` of split `s` depends only
      on `(seed, s, i)`.
    - `num_classes`: the number of classes (None: the largest label + 1).
    - `pixel_max`: pixels are divided by this (255 for 8-bit images).
    - `normalize`: standardise the scaled pixels with the training split's mean and standard
      deviation (one scalar each, over all its pixels); False keeps `pixels / pixel_max`.
    - `name`, `class_names`: shown by `summary()`; `class_names` has `num_classes` entries.

    **Attributes:** `kind = "image_classification"`, `vocab_size = 0` (inputs are pixels, not
    tokens), `num_classes`, `image_shape` (one image's shape: `(H, W)` or `(H, W, C)`),
    `seq_len = H * W` (pixel positions; a patch model has `H*W / patch²` tokens instead, see
    `patchify`), `batch_size`, `seed`, `sizes` (`{split: count}`), `mean`, `std` (the
    training pixels' statistics, after dividing by `pixel_max`), `majority_label`.

    **Batches:** training position `p = i*B + k` of batch `i` holds training example
    `perm_e[p mod n]` with `e = p // n` (the epoch) and `perm_e` a permutation of the `n`
    training examples drawn from `(seed, e)`: every epoch shows each example exactly once,
    and a resumed run sees the same stream. Validation and test batch `i` holds examples
    `i*B ... i*B + B - 1` in order, wrapping around past the end with mask 0 there, so the
    first `num_batches(split)` batches count each example once.
    """

    kind = "image_classification"
    vocab_size = 0

    def __init__(self, train: tuple, val: tuple, test: tuple, *, batch_size: int = 32,
                 seed: int = 0, num_classes: Optional[int] = None, pixel_max: float = 255.0,
                 normalize: bool = True, name: str = "images",
                 class_names: Optional[Sequence[str]] = None):
        if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) \
                or batch_size < 1:
            raise ValueError(f"batch_size must be a positive integer; got {batch_size!r}.")
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
            raise ValueError(f"seed must be a non-negative integer; got {seed!r}.")
        if not pixel_max > 0:
            raise ValueError(f"pixel_max must be positive; got {pixel_max!r}.")
        self._images, self._labels = {}, {}
        for split, pair in zip(_SPLITS, (train, val, test)):
            if not isinstance(pair, (tuple, list)) or len(pair) != 2:
                raise ValueError(f"{split}: expected an (images, labels) pair; got "
                                 f"{type(pair).__name__}.")
            x, y = np.asarray(pair[0]), np.asarray(pair[1])
            if x.ndim not in (3, 4) or x.dtype.kind not in "uif":
                raise ValueError(f"{split} images must be a real array of shape (N, H, W) or "
                                 f"(N, H, W, C); got shape {x.shape}, dtype {x.dtype}.")
            if y.ndim != 1 or y.dtype.kind not in "ui":
                raise ValueError(f"{split} labels must be a 1-d integer array; got shape "
                                 f"{y.shape}, dtype {y.dtype}.")
            if len(x) != len(y):
                raise ValueError(f"{split}: {len(x)} images but {len(y)} labels.")
            if len(x) == 0:
                raise ValueError(f"the {split} split is empty; each split needs at least one "
                                 f"image.")
            if y.min() < 0:
                raise ValueError(f"{split} labels must be non-negative; found {int(y.min())}.")
            self._images[split], self._labels[split] = x, y.astype(np.int32)
        shapes = {s: self._images[s].shape[1:] for s in _SPLITS}
        if len(set(shapes.values())) != 1:
            raise ValueError(f"all splits need images of one shape; got {shapes}.")
        top = max(int(self._labels[s].max()) for s in _SPLITS) + 1
        if num_classes is None:
            num_classes = top
        elif num_classes < top:
            raise ValueError(f"num_classes={num_classes}, but a label {top - 1} occurs; "
                             f"labels must be below num_classes.")
        if class_names is not None and len(class_names) != num_classes:
            raise ValueError(f"class_names has {len(class_names)} entries for {num_classes} "
                             f"classes.")
        self.num_classes = int(num_classes)
        self.class_names = tuple(class_names) if class_names is not None else None
        self.image_shape = tuple(int(d) for d in shapes["train"])
        self.seq_len = self.image_shape[0] * self.image_shape[1]
        self.batch_size = int(batch_size)
        self.seed = int(seed)
        self.pixel_max = float(pixel_max)
        self.normalize = bool(normalize)
        self.name = name
        self.sizes = {s: len(self._labels[s]) for s in _SPLITS}
        self.mean, self.std = _pixel_stats(self._images["train"], self.pixel_max)
        if self.normalize and not self.std > 0:
            raise ValueError("the training images are all one value (standard deviation 0); "
                             "they cannot be standardised: pass normalize=False.")
        counts = np.bincount(self._labels["train"], minlength=self.num_classes)
        self.majority_label = int(np.argmax(counts))
        self._perms: dict[int, np.ndarray] = {}

    # ---------------------------------------------------------------- constructors

    @classmethod
    def from_mnist_dir(cls, path: Optional[PathLike] = None, *, batch_size: int = 32,
                       seed: int = 0, val_size: int = 5000, max_train: Optional[int] = None,
                       normalize: bool = True, name: Optional[str] = None,
                       class_names: Optional[Sequence[str]] = None) -> "ImageDataset":
        """A dataset from an MNIST-format directory (see `find_mnist_files`; None:
        Fashion-MNIST's `FASHION_MNIST_DIR`).

        - "train": the training file's images except the last `val_size`; with `max_train`,
          only the first `max_train` of those (for quick runs; the validation split stays
          the same).
        - "val": the last `val_size` images of the training file.
        - "test": the `t10k` file.

        Pixels are divided by 255; `num_classes` is the largest label + 1; the decoded files
        are cached per directory for the life of the process.
        """
        arrays = load_mnist(path)
        x, y = arrays["train_images"], arrays["train_labels"]
        if isinstance(val_size, bool) or not isinstance(val_size, (int, np.integer)) \
                or not 1 <= val_size < len(x):
            raise ValueError(f"val_size must be an integer in 1 ... {len(x) - 1} (the training "
                             f"file holds {len(x)} images); got {val_size!r}.")
        n_train = len(x) - val_size
        if max_train is not None:
            if isinstance(max_train, bool) or not isinstance(max_train, (int, np.integer)) \
                    or max_train < 1:
                raise ValueError(f"max_train must be a positive integer or None; got "
                                 f"{max_train!r}.")
            n_train = min(n_train, int(max_train))
        return cls((x[:n_train], y[:n_train]), (x[len(x) - val_size:], y[len(x) - val_size:]),
                   (arrays["test_images"], arrays["test_labels"]), batch_size=batch_size,
                   seed=seed, pixel_max=255.0, normalize=normalize,
                   name=name or ("Fashion-MNIST" if path is None else
                                 f"MNIST-format data in {path}"),
                   class_names=class_names)

    @classmethod
    def fashion_mnist(cls, path: Optional[PathLike] = None, *, batch_size: int = 32,
                      seed: int = 0, val_size: int = 5000, max_train: Optional[int] = None,
                      normalize: bool = True) -> "ImageDataset":
        """Fashion-MNIST (Xiao, Rasul & Vollgraf 2017): 28×28 grey images of 10 kinds of
        clothing (`FASHION_MNIST_CLASSES`).

        `path`: a directory with the four MNIST-format files; None reads
        `/usr/share/datasets/fashion-mnist` (`apt-get install dataset-fashion-mnist`).
        Splits and arguments as in `from_mnist_dir`: by default 55,000 training, 5,000
        validation and 10,000 test images. With the default split the training pixels
        (divided by 255) have mean 0.285817 and standard deviation 0.352937 (over all 60,000
        training images: 0.286041 and 0.353024, the figures usually quoted).
        """
        return cls.from_mnist_dir(path, batch_size=batch_size, seed=seed, val_size=val_size,
                                  max_train=max_train, normalize=normalize,
                                  name="Fashion-MNIST", class_names=FASHION_MNIST_CLASSES)

    @classmethod
    def digits(cls, *, batch_size: int = 32, seed: int = 0, val_size: int = 270,
               test_size: int = 270, normalize: bool = True) -> "ImageDataset":
        """The 8×8 handwritten digits that ship with scikit-learn (1,797 images, pixel values
        0..16, divided by 16; no download), a CI-sized real image set.

        The images are split by a fixed permutation (seed 0, independent of `seed`): the
        first `test_size` go to "test", the next `val_size` to "val", the rest (1,257 by
        default) to "train". Needs scikit-learn (`pip install scikit-learn`).
        """
        x, y = _digits_arrays()
        n = len(x)
        for k, v in (("val_size", val_size), ("test_size", test_size)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"{k} must be a positive integer; got {v!r}.")
        if val_size + test_size >= n:
            raise ValueError(f"val_size + test_size = {val_size + test_size} leaves no "
                             f"training images out of {n}.")
        perm = np.random.default_rng(0).permutation(n)
        te, va, tr = (perm[:test_size], perm[test_size:test_size + val_size],
                      perm[test_size + val_size:])
        return cls((x[tr], y[tr]), (x[va], y[va]), (x[te], y[te]), batch_size=batch_size,
                   seed=seed, num_classes=10, pixel_max=16.0, normalize=normalize,
                   name="digits (scikit-learn, 8×8)", class_names=DIGITS_CLASSES)

    # ---------------------------------------------------------------- batches

    def preprocess(self, images: np.ndarray) -> np.ndarray:
        """Raw pixels `(..., H, W[, C])` → the float32 inputs batches hold: divided by
        `pixel_max`, then standardised with the training `mean` and `std` if `normalize`."""
        x = np.asarray(images, np.float32) / np.float32(self.pixel_max)
        if self.normalize:
            x = (x - np.float32(self.mean)) / np.float32(self.std)
        return x.astype(np.float32, copy=False)

    def split_arrays(self, split: str) -> tuple[np.ndarray, np.ndarray]:
        """`(images, labels)` of a split as stored: raw pixels and int32 labels (read-only
        views when the dataset came from cached files; do not modify)."""
        _split_id(split)
        return self._images[split], self._labels[split]

    def _permutation(self, epoch: int) -> np.ndarray:
        perm = self._perms.get(epoch)
        if perm is None:
            perm = np.random.default_rng([self.seed, 0, epoch]).permutation(self.sizes["train"])
            if len(self._perms) >= 2:
                self._perms.pop(next(iter(self._perms)))
            self._perms[epoch] = perm
        return perm

    def batch_rows(self, index: int, split: str = "train") -> tuple[np.ndarray, np.ndarray]:
        """`(rows, mask)`: which examples of `split` batch `index` holds (indices into
        `split_arrays(split)`) and its mask; see the class docstring for the order."""
        index, sid = _check_index(index), _split_id(split)
        n, B = self.sizes[split], self.batch_size
        pos = index * B + np.arange(B, dtype=np.int64)
        if sid == 0:
            epochs, offsets = np.divmod(pos, n)
            rows = np.empty(B, np.int64)
            for e in np.unique(epochs):
                sel = epochs == e
                rows[sel] = self._permutation(int(e))[offsets[sel]]
            return rows, np.ones(B, np.float32)
        return pos % n, (pos < n).astype(np.float32)

    def batch(self, index: int, split: str = "train") -> dict[str, np.ndarray]:
        """`{"inputs" (B, H, W[, C]) float32, "targets" (B,) int32, "mask" (B,) float32}`
        for batch `index` of `split` ("train", "val" or "test")."""
        rows, mask = self.batch_rows(index, split)
        return {"inputs": self.preprocess(self._images[split][rows]),
                "targets": self._labels[split][rows].copy(), "mask": mask}

    def num_batches(self, split: str) -> int:
        """`ceil(n / B)`: the batches that cover `split` once (for "train", one epoch)."""
        _split_id(split)
        return -(-self.sizes[split] // self.batch_size)

    def baselines(self, batch: dict[str, np.ndarray]) -> dict[str, float]:
        """Accuracies on `batch` of references a model should beat: `chance_accuracy`
        (`1 / num_classes`) and `majority_accuracy` (always answering the most frequent
        training label), over the masked examples."""
        t = np.asarray(batch["targets"])
        m = np.asarray(batch["mask"], np.float64)
        total = max(float(m.sum()), 1.0)
        return {"chance_accuracy": 1.0 / self.num_classes,
                "majority_accuracy": float(((t == self.majority_label) * m).sum() / total)}

    def summary(self) -> str:
        """One line: the splits' sizes, the image shape, the classes and the normalisation."""
        sizes = ", ".join(f"{s} {self.sizes[s]}" for s in _SPLITS)
        norm = (f"pixels/{self.pixel_max:g} standardised with mean {self.mean:.6f}, std "
                f"{self.std:.6f}" if self.normalize else f"pixels/{self.pixel_max:g}")
        return (f"{self.name}: {sizes} images of {_shape_text(self.image_shape)}, "
                f"{self.num_classes} classes; {norm}")


# --------------------------------------------------------------------------------------------
# Patches
# --------------------------------------------------------------------------------------------


def _as_array(x):
    return x if hasattr(x, "reshape") and hasattr(x, "shape") and hasattr(x, "transpose") \
        else np.asarray(x)


def _check_batch_dims(batch_dims, what: str) -> int:
    if isinstance(batch_dims, bool) or not isinstance(batch_dims, int) or batch_dims < 0:
        raise ValueError(f"{what}: batch_dims must be a non-negative integer; got "
                         f"{batch_dims!r}.")
    return batch_dims


def _divisors_hint(H: int, W: int) -> str:
    common = [d for d in range(1, min(H, W) + 1) if H % d == 0 and W % d == 0]
    return f"patch sizes that divide both: {common}"


def patchify(images, patch: int, *, batch_dims: int = 0):
    """Cuts images into non-overlapping `patch × patch` squares, as tokens (Dosovitskiy et
    al. 2020).

    Works on numpy and JAX arrays (under `jit` and `vmap` too): it only reshapes and
    transposes.

    **Arguments:**

    - `images`: one image `(H, W)` or `(H, W, C)`; with `batch_dims = k`, `k` leading batch
      axes before those.
    - `patch`: the side P of a patch; it must divide H and W.
    - `batch_dims`: the number of leading batch axes (0: a single image, the project's
      convention; vmap for batches, or pass `batch_dims=1` for a `(B, H, W)` numpy batch).

    **Returns:** `(..., (H/P)·(W/P), P·P·C)` (C = 1 for `(H, W)` images): patches in
    row-major order (left to right, then top to bottom), each flattened row-major over
    `(row in patch, column in patch, channel)`. `unpatchify` inverts it.
    """
    x = _as_array(images)
    b = _check_batch_dims(batch_dims, "patchify")
    lead, img = tuple(x.shape[:b]), tuple(x.shape[b:])
    if len(img) not in (2, 3):
        raise ValueError(f"patchify: expected an image (H, W) or (H, W, C) after {b} batch "
                         f"axes; got shape {tuple(x.shape)} (batch_dims={b}).")
    H, W = img[:2]
    C = img[2] if len(img) == 3 else 1
    if isinstance(patch, bool) or not isinstance(patch, (int, np.integer)) or patch < 1:
        raise ValueError(f"patchify: patch must be a positive integer; got {patch!r}.")
    p = int(patch)
    if H % p or W % p:
        raise ValueError(f"patchify: a {H}×{W} image cannot be cut into {p}×{p} patches ("
                         f"{p} does not divide {'H' if H % p else 'W'}="
                         f"{H if H % p else W}); {_divisors_hint(H, W)}.")
    h, w = H // p, W // p
    x = x.reshape(*lead, h, p, w, p, C)
    axes = tuple(range(b)) + (b, b + 2, b + 1, b + 3, b + 4)
    return x.transpose(axes).reshape(*lead, h * w, p * p * C)


def unpatchify(patches, image_shape: Sequence[int], *, batch_dims: int = 0):
    """The inverse of `patchify`: patches `(..., N, P·P·C)` back to images
    `(..., H, W)` or `(..., H, W, C)`.

    **Arguments:**

    - `patches`: `(N, P·P·C)` after `batch_dims` leading batch axes.
    - `image_shape`: `(H, W)` (then C = 1 and the result has no channel axis) or `(H, W, C)`.
    - `batch_dims`: the number of leading batch axes.

    P is read off the patch length; the shapes must agree (`N = (H/P)·(W/P)`).
    """
    x = _as_array(patches)
    b = _check_batch_dims(batch_dims, "unpatchify")
    shape = tuple(int(d) for d in image_shape)
    if len(shape) not in (2, 3) or min(shape) < 1:
        raise ValueError(f"unpatchify: image_shape must be (H, W) or (H, W, C) with positive "
                         f"sizes; got {image_shape!r}.")
    if len(x.shape) != b + 2:
        raise ValueError(f"unpatchify: expected patches (N, P*P*C) after {b} batch axes; got "
                         f"shape {tuple(x.shape)}.")
    lead, (N, D) = tuple(x.shape[:b]), tuple(x.shape[b:])
    H, W = shape[:2]
    C = shape[2] if len(shape) == 3 else 1
    p = math.isqrt(D // C) if D % C == 0 else 0
    if p < 1 or p * p * C != D or H % p or W % p or (H // p) * (W // p) != N:
        raise ValueError(f"unpatchify: {N} patches of length {D} do not tile a "
                         f"{_shape_text(shape)} image (patch length must be P*P*C with C={C}, "
                         f"P dividing H and W, and N = (H/P)*(W/P)).")
    h, w = H // p, W // p
    x = x.reshape(*lead, h, w, p, p, C)
    axes = tuple(range(b)) + (b, b + 2, b + 1, b + 3, b + 4)
    x = x.transpose(axes)
    return x.reshape(*lead, H, W, C) if len(shape) == 3 else x.reshape(*lead, H, W)
