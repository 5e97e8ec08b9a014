"""The IDX file format of MNIST and Fashion-MNIST (Y. LeCun, C. Cortes, C. J. C. Burges,
"The MNIST database of handwritten digits", http://yann.lecun.com/exdb/mnist/, section
"File formats"): `read_idx` and `write_idx`, and the errors of image data files.

A magic number whose first two bytes are zero, whose third byte is the element type (0x08
unsigned byte, 0x09 signed byte, 0x0B int16, 0x0C int32, 0x0D float32, 0x0E float64) and
whose fourth is the number of dimensions; then each dimension's size as a big-endian
uint32; then the elements, big-endian, row-major. MNIST label files have magic 0x00000801
(uint8, 1 dimension), image files 0x00000803 (uint8, 3 dimensions). The page's description
matches the published files exactly (checked in the tests).
"""

from __future__ import annotations

import gzip
import math
import os
import pathlib
import zlib
from typing import Any, Optional, Sequence, Union

import numpy as np

from ._protocol import DataFileError


PathLike = Union[str, os.PathLike]
FASHION_MNIST_PACKAGE = "dataset-fashion-mnist"

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
