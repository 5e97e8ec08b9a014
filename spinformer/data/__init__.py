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

from ._brackets import VOCAB_SIZE as BRACKET_VOCAB_SIZE
from ._brackets import BracketMatching, sample_brackets
from ._corrupt import MASK_MODES, mask_images, noisy_images
from .._patches import patchify, unpatchify
from ._idx import ImageDataError, ImageDataNotFound, read_idx, write_idx
from ._images import CORRUPTIONS, ImageDataset, ImageReconstruction
from ._mnist import DIGITS_CLASSES, FASHION_MNIST_CLASSES, FASHION_MNIST_DIR
from ._mnist import find_mnist_files, load_mnist
from ._logic import Sentence, oracle, parse_sentence
from ._nli import GeneratedNLI
from ._pairs import NLI_LABELS, build_vocab, load_vocab, save_vocab, tokenize
from ._snli import NLIFile, read_jsonl
from ._protocol import Dataset, DataFileError
from ._text import FETCHABLE, CharText, cache_dir, dataset_path, fetch, read_text_file
from ._text import resolve_text_path

__all__ = [
    "BRACKET_VOCAB_SIZE",
    "BracketMatching",
    "CharText",
    "DIGITS_CLASSES",
    "DataFileError",
    "Dataset",
    "MASK_MODES",
    "FASHION_MNIST_CLASSES",
    "FASHION_MNIST_DIR",
    "FETCHABLE",
    "GeneratedNLI",
    "ImageDataError",
    "ImageDataNotFound",
    "ImageDataset",
    "ImageReconstruction",
    "CORRUPTIONS",
    "NLIFile",
    "NLI_LABELS",
    "Sentence",
    "cache_dir",
    "dataset_path",
    "build_vocab",
    "fetch",
    "find_mnist_files",
    "load_mnist",
    "load_vocab",
    "mask_images",
    "noisy_images",
    "oracle",
    "parse_sentence",
    "patchify",
    "read_idx",
    "read_jsonl",
    "read_text_file",
    "resolve_text_path",
    "sample_brackets",
    "save_vocab",
    "tokenize",
    "unpatchify",
    "write_idx",
]
