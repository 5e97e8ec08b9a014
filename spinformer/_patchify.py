"""Images as patch tokens and back (A. Dosovitskiy et al., "An Image is Worth 16x16 Words:
Transformers for Image Recognition at Scale", arXiv:2010.11929 (2020)). Below both `data`
and `nn`, which both cut images into patches."""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np


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
                         f"{'×'.join(map(str, shape))} image (patch length must be P*P*C with C={C}, "
                         f"P dividing H and W, and N = (H/P)*(W/P)).")
    h, w = H // p, W // p
    x = x.reshape(*lead, h, w, p, p, C)
    axes = tuple(range(b)) + (b, b + 2, b + 1, b + 3, b + 4)
    x = x.transpose(axes)
    return x.reshape(*lead, H, W, C) if len(shape) == 3 else x.reshape(*lead, H, W)
