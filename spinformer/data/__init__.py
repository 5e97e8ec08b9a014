"""Datasets and generators that produce deterministic batches of numpy arrays.

Every dataset follows the `Dataset` protocol: `vocab_size`, `num_classes`, `seq_len`, `kind`
(`"tagging"`, `"lm"`, `"pair_classification"` or `"image_classification"`),
`batch(index, split) -> {"inputs", "targets", "mask"}`, where batch `index` depends only on
the seed, the split and the index (so a resumed run sees the same data), and
`baselines(batch) -> dict[str, float]`: reference scores on a batch (chance level and the
like; `{}` if none), which the trainer records in each run's summary.

A data file that exists but cannot be used (empty, truncated, not text, not in its format) is
a `DataFileError` (a `ValueError`) whose message names the file, the line for line-based
formats, and what is wrong; image files raise its subclass `ImageDataError`.
"""

from ._brackets import BracketMatching
from ._corrupt import mask_images, noisy_images
from .._patchify import patchify, unpatchify
from ._idx import ImageDataError, ImageDataNotFound, read_idx, write_idx
from ._images import ImageDataset, ImageReconstruction
from ._mnist import FASHION_MNIST_DIR
from ._mnist import find_mnist_files, load_mnist
from ._nli import GeneratedNLI
from ._pairs import NLI_LABELS, load_vocab
from ._snli import NLIFile
from ._protocol import Dataset, DataFileError
from ._text import CharText, fetch

__all__ = [
    "BracketMatching",
    "CharText",
    "DataFileError",
    "Dataset",
    "FASHION_MNIST_DIR",
    "GeneratedNLI",
    "ImageDataError",
    "ImageDataNotFound",
    "ImageDataset",
    "ImageReconstruction",
    "NLIFile",
    "NLI_LABELS",
    "fetch",
    "find_mnist_files",
    "load_mnist",
    "load_vocab",
    "mask_images",
    "noisy_images",
    "patchify",
    "read_idx",
    "unpatchify",
    "write_idx",
]
