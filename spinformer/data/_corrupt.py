"""Corrupted images for reconstruction tasks: masking and additive noise (F. D'Amico, M. Negri,
"Self-attention as an attractor network", arXiv:2409.16112, sec. III).

Both take and return numpy arrays `(B, H, W)` with pixels in [0, 1], and an explicit
`np.random.Generator`, so a batch index and a seed fix the corruption (resumable runs see the
same corrupted batches).
"""

from __future__ import annotations

import numpy as np

__all__ = ["MASK_MODES", "mask_images", "noisy_images"]

MASK_MODES = ("pixels", "tokens")


def _check(name, images):
    a = np.asarray(images)
    if a.ndim != 3:
        raise ValueError(f"{name}: expected images (B, H, W); got shape {a.shape}.")
    if not np.issubdtype(a.dtype, np.floating):
        raise ValueError(f"{name}: pixels must be floats in [0, 1]; got dtype {a.dtype}.")
    if not np.isfinite(a).all():
        raise ValueError(f"{name}: images contain NaN or infinite pixels.")
    return a


def mask_images(images, fraction: float, *, rng: np.random.Generator, mode: str = "pixels",
                patch: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """Sets a random `fraction` of the pixels (`mode="pixels"`, the paper's Fig. 1 caption) or
    of the `patch × patch` tokens (`mode="tokens"`, the paper's text: "setting to zero a
    fraction of tokens") to zero.

    **Returns:** `(corrupted (B, H, W), masked (B, H, W) bool)` — `masked` is True at the
    pixels that were set to zero."""
    a = _check("mask_images", images)
    if not 0.0 <= float(fraction) <= 1.0:
        raise ValueError(f"mask_images: fraction must be in [0, 1]; got {fraction}.")
    if mode not in MASK_MODES:
        raise ValueError(f"mask_images: mode must be one of {MASK_MODES}; got {mode!r}.")
    B, H, W = a.shape
    if mode == "pixels":
        m = rng.random((B, H, W)) < fraction
    else:
        P = int(patch)
        if P < 1 or H % P or W % P:
            raise ValueError(f"mask_images: patch {patch} must divide the image sides {(H, W)}.")
        t = rng.random((B, H // P, W // P)) < fraction
        m = np.repeat(np.repeat(t, P, axis=1), P, axis=2)
    return np.where(m, 0.0, a).astype(a.dtype), m


def noisy_images(images, variance: float, *, rng: np.random.Generator,
                 clip: bool = True) -> np.ndarray:
    """Adds Gaussian noise of the given variance to every pixel, then rescales each image so
    that its pixel variance equals the clean image's (mean kept at the noisy image's mean
    shifted back to the clean mean), as in the paper's denoising task; with `clip` (default)
    the result is clipped to [0, 1], the range the pixel-to-spin embedding accepts (the
    clipping lowers the corrupted images' error a little; it is applied for every model).

    **Returns:** `(B, H, W)`."""
    a = _check("noisy_images", images)
    if float(variance) < 0:
        raise ValueError(f"noisy_images: variance must be >= 0; got {variance}.")
    y = a + rng.normal(0.0, np.sqrt(float(variance)), a.shape).astype(a.dtype)
    mu_x, sd_x = a.mean(axis=(1, 2), keepdims=True), a.std(axis=(1, 2), keepdims=True)
    mu_y, sd_y = y.mean(axis=(1, 2), keepdims=True), y.std(axis=(1, 2), keepdims=True)
    y = (y - mu_y) * (sd_x / np.maximum(sd_y, 1e-12)) + mu_x
    if clip:
        y = np.clip(y, 0.0, 1.0)
    return y.astype(a.dtype)
