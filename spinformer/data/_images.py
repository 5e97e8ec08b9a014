"""Image classification: MNIST-format IDX files (Fashion-MNIST and the like), the 8×8 digits
that ship with scikit-learn, and in-memory arrays, all served as deterministic batches of
numpy arrays.

**Batch format** (`kind = "image_classification"`): `batch(index, split)` returns

- `inputs (B, H, W) float32` (`(B, H, W, C)` for images with channels): pixels divided by
  their maximum (255 for IDX files, 16 for the digits) and, with `normalize=True`,
  standardised with one mean and one standard deviation computed once on the training split;
- `targets (B,) int32`: class ids `0 ... num_classes - 1`;
- `mask (B,) float32`: ones for training batches; for validation and test batches, ones
  except at the positions that wrap around past the end of the split (zeros there), so that
  the first `num_batches(split)` batches count every example exactly once.

The files are read by `_idx` (the IDX format) and `_mnist` (Fashion-MNIST directories and
the digits); `spinformer._patchify` cuts images into patch tokens.

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

import math
from typing import Optional, Sequence

import numpy as np

from ._idx import PathLike, _shape_text
from ._mnist import DIGITS_CLASSES, FASHION_MNIST_CLASSES, _digits_arrays, load_mnist

_SPLITS = {"train": 0, "val": 1, "test": 2}


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
        clothing (named in `class_names`).

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


CORRUPTIONS = ("mask", "noise")


class ImageReconstruction:
    """Image reconstruction batches (the `Dataset` protocol, `kind = "reconstruction"`): the
    images of an `ImageDataset`, corrupted, to be restored (the masked-image and denoising
    tasks of F. D'Amico, M. Negri, "Self-attention as an attractor network", arXiv:2409.16112,
    sec. III; the Energy Transformer's masked-image task, B. Hoover et al., arXiv:2302.07253).

    **Arguments:** `images`: the `ImageDataset` whose splits, order and masks are used (its
    pixels are read divided by `pixel_max`, in [0, 1], not standardised); `corrupt`:
    `"mask"` (a random `mask_fraction` of the pixels set to 0, `data.mask_images`) or
    `"noise"` (Gaussian noise of variance `noise_variance`, rescaled and clipped,
    `data.noisy_images`).

    **Batches:** `{"inputs" (B, H, W) float32` the corrupted images, `"targets" (B, H, W)
    float32` the clean ones, `"mask" (B,) float32`} (the mask as `ImageDataset`'s). Batch
    `i` of split `s` is corrupted with a generator seeded by `(seed, s, i)`, so a resumed
    run and every evaluation see the same corruption. The trainer's loss for float targets is
    the mean squared error per pixel (`train.loss_fn`).
    """

    kind = "reconstruction"
    vocab_size = 0
    num_classes = 0

    def __init__(self, images: ImageDataset, corrupt: str = "mask", *,
                 mask_fraction: float = 0.3, noise_variance: float = 0.7):
        if corrupt not in CORRUPTIONS:
            raise ValueError(f"corrupt must be one of {CORRUPTIONS}; got {corrupt!r}.")
        if len(images.image_shape) != 2:
            raise ValueError(f"reconstruction needs grey images (H, W); got "
                             f"{images.image_shape}.")
        if not 0.0 < float(mask_fraction) <= 1.0:
            raise ValueError(f"mask_fraction must be in (0, 1]; got {mask_fraction!r}.")
        if not float(noise_variance) > 0.0:
            raise ValueError(f"noise_variance must be positive; got {noise_variance!r}.")
        self.images = images
        self.corrupt = corrupt
        self.mask_fraction = float(mask_fraction)
        self.noise_variance = float(noise_variance)
        self.image_shape = images.image_shape
        self.seq_len = images.seq_len
        self.batch_size = images.batch_size
        self.seed = images.seed
        self.sizes = images.sizes

    def batch(self, index: int, split: str = "train") -> dict[str, np.ndarray]:
        from ._corrupt import mask_images, noisy_images

        rows, mask = self.images.batch_rows(index, split)
        clean = (np.asarray(self.images.split_arrays(split)[0][rows], np.float32)
                 / np.float32(self.images.pixel_max))
        rng = np.random.default_rng([self.seed, _split_id(split), _check_index(index), 1])
        if self.corrupt == "mask":
            noisy = mask_images(clean, self.mask_fraction, rng=rng)[0]
        else:
            noisy = noisy_images(clean, self.noise_variance, rng=rng)
        return {"inputs": noisy.astype(np.float32), "targets": clean, "mask": mask}

    def num_batches(self, split: str) -> int:
        return self.images.num_batches(split)

    def baselines(self, batch: dict[str, np.ndarray]) -> dict[str, float]:
        """Mean squared errors per pixel of references a model should beat, over the masked
        examples of `batch`: `identity_mse` (returning the corrupted image) and
        `mean_image_mse` (returning the training split's mean image)."""
        m = np.asarray(batch["mask"], np.float64)
        total = max(float(m.sum()), 1.0)
        t = np.asarray(batch["targets"], np.float64)

        def mse(pred):
            return float((((pred - t) ** 2).mean(axis=(1, 2)) * m).sum() / total)

        mean_image = (np.asarray(self.images.split_arrays("train")[0], np.float64).mean(0)
                      / self.images.pixel_max)
        return {"identity_mse": mse(np.asarray(batch["inputs"], np.float64)),
                "mean_image_mse": mse(mean_image[None])}

    def summary(self) -> str:
        what = (f"{self.mask_fraction:.0%} of the pixels masked" if self.corrupt == "mask"
                else f"Gaussian noise of variance {self.noise_variance:g}")
        return f"{self.images.name}, reconstructed from {what}; " + \
            ", ".join(f"{s} {n}" for s, n in self.sizes.items())
