"""MNIST-format directories (Fashion-MNIST from the Debian package, or any directory of the
four IDX files) and scikit-learn's 8×8 digits, read into arrays.

Fashion-MNIST (H. Xiao, K. Rasul, R. Vollgraf, "Fashion-MNIST: a Novel Image Dataset for
Benchmarking Machine Learning Algorithms", arXiv:1708.07747, 2017,
https://github.com/zalandoresearch/fashion-mnist) keeps MNIST's format and sizes: 60,000
training and 10,000 test images of 28×28 grey pixels, 10 classes (`FASHION_MNIST_CLASSES`),
6,000 training and 1,000 test images per class. The Debian package `dataset-fashion-mnist`
installs the four gzipped files in `/usr/share/datasets/fashion-mnist`.

The digits (`sklearn.datasets.load_digits`: the test part of the UCI "Optical Recognition of
Handwritten Digits" data, E. Alpaydin, C. Kaynak, 1998,
https://archive.ics.uci.edu/dataset/80) are 1,797 images of 8×8 pixels with values 0..16.
"""

from __future__ import annotations

import functools
import pathlib
from typing import Optional

import numpy as np

from ._idx import (_REDOWNLOAD, FASHION_MNIST_PACKAGE, ImageDataError, ImageDataNotFound,
                   PathLike, _shape_text, read_idx)


FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist"
FASHION_MNIST_CLASSES = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal",
                         "Shirt", "Sneaker", "Bag", "Ankle boot")
DIGITS_CLASSES = tuple(str(d) for d in range(10))

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
