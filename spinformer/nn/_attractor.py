r"""Self-attention as an attractor network (F. D'Amico, M. Negri, "Self-attention as an attractor
network: transient memories without backpropagation", arXiv:2409.16112): a fixed pixel-to-spin
embedding, the bare self-attention dynamics with position-dependent couplings, and its training
by stochastic gradient descent on the local energies of the training images — no
backpropagation through the dynamics (the physics is in `spinformer.spins.attractor`).

```python
net = AttractorNetwork((28, 28), patch=2, dim=8, key=jax.random.key(0))
net, metrics = attractor_sgd_step(net, images_BxHxW, lr=0.5, clip=1.0)   # one training step
frames = net.reconstruct(corrupted_HxW, steps=30)                        # (31, 28, 28)
```
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal, Optional, Sequence, Union

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Float, PRNGKeyArray

from .._schema import Choice, choice, register_choice
from .._patchify import patchify, unpatchify
from ..spins import attractor as _phys
from ._attention_diagnostics import Diagnostics
from ._literal import check_literal

__all__ = [
    "AttractorNetwork",
    "AttractorObjective",
    "EnergyObjective",
    "PixelSpinEmbedding",
    "PseudoLikelihoodObjective",
    "attractor_sgd_step",
]


# --- the options: which norm is held fixed, and what training minimises ---------------------

#: Which norm of the couplings `AttractorNetwork` holds fixed (`constraint=`): `"global"`,
#: the Frobenius norm of the whole tensor `(N, N, d, d)`, held at its initial value; or
#: `"block"`, the Frobenius norm of every block 𝕁_ij (i ≠ j), held at the expected block
#: norm of the initialisation, d·(1/(2d))/√3 = 1/(2√3). The diagonal blocks 𝕁_ii are zero
#: under both.
Constraint = Literal["global", "block"]


def _project_global(J: Float[Array, "N N d d"], norm_value: float) -> Array:
    """`J` with zero diagonal blocks, scaled to the whole tensor's norm `norm_value`."""
    J = _phys.zero_diagonal(J)
    return J * (norm_value / jnp.sqrt(jnp.sum(J * J)))


def _project_block(J: Float[Array, "N N d d"], norm_value: float) -> Array:
    """`J` with zero diagonal blocks, every other block 𝕁_ij scaled to the norm
    `norm_value`."""
    J = _phys.zero_diagonal(J)
    n = jnp.sqrt(jnp.sum(J * J, axis=(2, 3), keepdims=True))
    N = J.shape[0]
    eye = jnp.eye(N, dtype=bool)[:, :, None, None]
    return jnp.where(eye, 0.0, J * (norm_value / jnp.where(eye, 1.0, n)))


# `J (N, N, d, d)` and the norm held fixed -> `J` put back on the constraint
_PROJECT = {"global": _project_global, "block": _project_block}
# `J` -> the constrained norm: a scalar (`"global"`) or `(N, N)`, zero on the diagonal
_MEASURE = {"global": lambda J: jnp.sqrt(jnp.sum(J * J)),
            "block": lambda J: jnp.sqrt(jnp.sum(J * J, axis=(2, 3)))}


class AttractorObjective(Choice):
    """What `attractor_sgd_step` minimises per image (the option `objective`, kind
    `"attractor.objective"`): `EnergyObjective` (`"energy"`) or `PseudoLikelihoodObjective`
    (`"pseudo_likelihood"`)."""

    def loss(self, x: Float[Array, "N d"], J: Float[Array, "N N d d"], lam: float) -> Array:
        """The loss of one embedded image `x` under couplings `J` at strength `lam`."""
        raise NotImplementedError


@register_choice("attractor.objective", "energy")
@dataclasses.dataclass(frozen=True)
class EnergyObjective(AttractorObjective):
    """The paper's energy E(ξ) = Σ_i e_i(ξ) (`spins.attractor.energy`)."""

    def loss(self, x, J, lam):
        return _phys.energy(x, J, lam=lam)


@register_choice("attractor.objective", "pseudo_likelihood")
@dataclasses.dataclass(frozen=True)
class PseudoLikelihoodObjective(AttractorObjective):
    """The exact negative log pseudo-likelihood on the sphere, summed over the tokens
    (`spins.attractor.pseudo_likelihood`)."""

    def loss(self, x, J, lam):
        return jnp.sum(_phys.pseudo_likelihood(x, J, lam=lam))


def _check_images(name: str, images, image_shape, batch: bool):
    """Shape and (when concrete) value checks with a message that says how to fix the input."""
    shape = tuple(np.shape(images))
    want = ("B",) + tuple(image_shape) if batch else tuple(image_shape)
    if len(shape) != len(want) or shape[len(shape) - 2:] != tuple(image_shape):
        raise ValueError(f"{name}: expected images of shape {want}; got {shape}.")
    if isinstance(images, jax.core.Tracer):
        return
    a = np.asarray(images)
    if not np.issubdtype(a.dtype, np.floating):
        raise ValueError(f"{name}: pixels must be floats in [0, 1] (divide uint8 images by "
                         f"255); got dtype {a.dtype}.")
    bad = ~np.isfinite(a)
    if bad.any():
        raise ValueError(f"{name}: {int(bad.sum())} pixel(s) are NaN or infinite; nothing "
                         f"was changed. Clean or drop those images first.")
    lo, hi = float(a.min()), float(a.max())
    if lo < -1e-6 or hi > 1 + 1e-6:
        raise ValueError(f"{name}: pixels must lie in [0, 1] (the pixel-to-spin map is only "
                         f"invertible there); got values in [{lo:.3g}, {hi:.3g}]. Rescale, or "
                         f"clip with np.clip(images, 0, 1).")


class PixelSpinEmbedding(eqx.Module):
    """The paper's fixed (untrained) embedding of an image's patches as unit vectors (sec. V-A).

    A pixel p ∈ [0, 1] becomes the unit vector (p, 1 − p)/√(p² + (1 − p)²); the a pixels of a
    patch give s ∈ R^{2a} (pairs concatenated in the patch's row-major order, ‖s‖ = √a), and
    the token is x = F s with F ∈ R^{d × 2a} a random matrix with orthonormal columns scaled by
    1/√a, so ‖x‖ = 1. Requires d ≥ 2a.

    **Decoding** (`decode`): the left inverse F⁺ = a Fᵀ (the paper writes F⁻¹, but F is d × 2a,
    not square, for d > 2a), then each pair (u, w) back to a pixel.
    Embedded pixels fill only the quarter circle between (0, 1) (p = 0) and (1, 0) (p = 1), at
    angle θ = atan2(w, u) ∈ [0, π/2], with p = cos θ/(cos θ + sin θ) = u/(u + w). Off the image
    — states reached by the dynamics are not images — the map is not invertible: `decode` uses
    only the direction of each pair (its length is discarded), maps angles inside the quarter
    circle as above and angles outside it to the nearer end (p = 0 beyond (0, 1), p = 1 beyond
    (1, 0); the dividing line is the direction opposite the quarter's middle), and ignores the
    part of x outside F's column space. Decoding an embedded image returns it exactly (up to
    float rounding).

    **Arguments:** `image_shape (H, W)`, `patch` (side P, divides H and W), `dim` d, `key`.
    """

    F: Float[Array, "d two_a"]
    image_shape: tuple = eqx.field(static=True)
    patch: int = eqx.field(static=True)
    dim: int = eqx.field(static=True)

    def __init__(self, image_shape: Sequence[int], patch: int, dim: int, *, key: PRNGKeyArray):
        H, W = (int(s) for s in image_shape)
        P = int(patch)
        if P < 1 or H % P or W % P:
            raise ValueError(f"PixelSpinEmbedding: patch {patch} must divide the image sides "
                             f"{(H, W)}.")
        a = P * P
        if int(dim) < 2 * a:
            raise ValueError(f"PixelSpinEmbedding: dim must be >= 2·(pixels per patch) = "
                             f"{2 * a} for patch {P} (the embedding must be invertible); got "
                             f"dim = {dim}.")
        q, r = jnp.linalg.qr(jax.random.normal(key, (int(dim), 2 * a)))
        q = q * jnp.sign(jnp.diagonal(r))[None, :]  # a Haar-random orthonormal frame
        self.F = q / math.sqrt(a)
        self.image_shape, self.patch, self.dim = (H, W), P, int(dim)

    @property
    def num_tokens(self) -> int:
        H, W = self.image_shape
        return (H // self.patch) * (W // self.patch)

    def spins(self, image: Float[ArrayLike, "H W"]) -> Float[Array, "N two_a"]:
        """The concatenated pixel vectors s of every patch (before F): `(N, 2a)`."""
        p = jnp.asarray(patchify(jnp.asarray(image, jnp.float32), self.patch))  # (N, a)
        pair = jnp.stack([p, 1.0 - p], axis=-1)
        pair = pair / jnp.sqrt(jnp.sum(pair * pair, axis=-1, keepdims=True))
        return pair.reshape(p.shape[0], -1)

    def embed(self, image: Float[ArrayLike, "H W"]) -> Float[Array, "N d"]:
        """One image `(H, W)` with pixels in [0, 1] → tokens `(N, d)` on the unit sphere."""
        return self.spins(image) @ self.F.T

    def decode(self, x: Float[ArrayLike, "N d"]) -> Float[Array, "H W"]:
        """Tokens `(N, d)` → an image `(H, W)` in [0, 1] (see the class docstring)."""
        a = self.patch * self.patch
        s = a * (jnp.asarray(x) @ self.F)  # (N, 2a)
        pair = s.reshape(s.shape[0], a, 2)
        u, w = pair[..., 0], pair[..., 1]
        theta = jnp.arctan2(w, u)  # (−π, π]
        half = 0.5 * jnp.pi
        # outside [0, π/2]: to the nearer end; the antipode of π/4 is −3π/4
        theta = jnp.where(theta > half, half, theta)
        theta = jnp.where(theta < -0.75 * jnp.pi, half, theta)
        theta = jnp.where(theta < 0.0, 0.0, theta)
        c, sn = jnp.cos(theta), jnp.sin(theta)
        p = jnp.clip(c / (c + sn), 0.0, 1.0)  # rounding can leave [0, 1] by an ulp
        return unpatchify(p, self.image_shape)


class AttractorNetwork(eqx.Module):
    """Bare self-attention as a recurrent network of vector spins (the paper's eqs. 1–4).

    Fields: `couplings (N, N, d, d)` — the only trained array; `embedding` (fixed
    `PixelSpinEmbedding`); `norm_value`, the Frobenius norm the couplings are held at (of the
    whole tensor with `constraint="global"`, of every block 𝕁_ij with `"block"`);
    `constraint`, which of the two.

    **Arguments:**

    - `image_shape (H, W)`, `patch` P (tokens are P × P patches, N = HW/P²), `dim` d ≥ 2P².
    - `lam_train`, `lam_test`: the coupling strength λ in training (paper: 5) and in the
      dynamics at test time (paper: 1).
    - `gamma`: self-coupling γ in x_i ← Σ_j α 𝕁 x_j + γ x_i (paper: 1).
    - `norm`: `"sphere"` (default) or `"layernorm"` after every step (`spins.attractor.normalize`).
    - `constraint`: `"block"` (default) or `"global"` — which norm is held fixed, see
      above. The paper says "the L2 norm of the matrix is kept fixed", and calls each 𝕁_ij
      "a d × d matrix"; holding every block's norm is also what reproduces its transient memories
      (with the whole tensor's norm fixed, training concentrates the couplings on a few pairs
      and the masked-prediction optimum moves to much later times, with a smaller gain;
      experiments/results/attractor/findings.md).
    - `key`: couplings uniform in [−1/(2d), 1/(2d)] (paper sec. V-B), 𝕁_ii = 0; the embedding.

    Calling the module, `net(x)`, is one step of the dynamics at `lam_test` (the attention
    signature; `context` and `mask` are not supported by this model).
    """

    couplings: Float[Array, "N N d d"]
    embedding: PixelSpinEmbedding
    norm_value: float = eqx.field(static=True)
    lam_train: float = eqx.field(static=True)
    lam_test: float = eqx.field(static=True)
    gamma: float = eqx.field(static=True)
    norm: str = eqx.field(static=True)
    constraint: Constraint = eqx.field(static=True)

    def __init__(self, image_shape: Sequence[int], patch: int, dim: int, *,
                 lam_train: float = 5.0, lam_test: float = 1.0, gamma: float = 1.0,
                 norm: str = "sphere",
                 constraint: Constraint = "block",
                 key: PRNGKeyArray):
        if norm not in _phys.NORMS:
            raise ValueError(f"AttractorNetwork: norm must be one of {_phys.NORMS}; got "
                             f"{norm!r}.")
        constraint = check_literal("AttractorNetwork", "constraint", constraint, Constraint)
        ke, kj = jax.random.split(key)
        self.embedding = PixelSpinEmbedding(image_shape, patch, dim, key=ke)
        N, d = self.embedding.num_tokens, int(dim)
        J = jax.random.uniform(kj, (N, N, d, d), minval=-0.5 / d, maxval=0.5 / d)
        J = _phys.zero_diagonal(J)
        if constraint == "global":
            self.couplings, self.norm_value = J, float(jnp.sqrt(jnp.sum(J * J)))
        else:
            # the expected block norm, d·(1/(2d))/√3, the same for every block
            self.norm_value = float(0.5 / math.sqrt(3.0))
            self.couplings = _project_block(J, self.norm_value)
        self.lam_train, self.lam_test, self.gamma = float(lam_train), float(lam_test), float(gamma)
        self.norm, self.constraint = norm, constraint

    # --- physics on tokens -----------------------------------------------------------------
    def local_energies(self, x: Float[ArrayLike, "N d"], *,
                       lam: Optional[float] = None) -> Float[Array, " N"]:
        """e_i(x) at strength `lam` (default `lam_train`): `(N,)`."""
        return _phys.local_energies(x, self.couplings, lam=self.lam_train if lam is None else lam)

    def energy(self, x: Float[ArrayLike, "N d"], *, lam: Optional[float] = None) -> Array:
        """E(x) = Σ_i e_i at `lam` (default `lam_train`): the training loss of one example."""
        return jnp.sum(self.local_energies(x, lam=lam))

    def step(self, x: Float[ArrayLike, "N d"], *, lam: Optional[float] = None,
             norm: Optional[str] = None) -> Array:
        """One step of the dynamics at `lam` (default `lam_test`), normalised by `norm`
        (default the network's): `(N, d)`."""
        return _phys.step(x, self.couplings, lam=self.lam_test if lam is None else lam,
                          gamma=self.gamma, norm=norm or self.norm)

    def run(self, x0: Float[ArrayLike, "N d"], steps: int, *, lam: Optional[float] = None,
            norm: Optional[str] = None) -> Float[Array, "T N d"]:
        """The trajectory from `x0 (N, d)`: `(steps + 1, N, d)`, `x0` first (`lax.scan`);
        `lam` and `norm` override the test strength and the normalisation."""
        return _phys.trajectory(x0, self.couplings, steps,
                                lam=self.lam_test if lam is None else lam, gamma=self.gamma,
                                norm=norm or self.norm)

    def __call__(self, x: Float[Array, "N d"], *, context=None, mask=None, state=None,
                 key: Optional[PRNGKeyArray] = None, return_diagnostics: bool = False):
        """One step of the dynamics (the attention signature). **Returns:** `(N, d)`, or
        `((N, d), Diagnostics(weights=(1, N, N)))`."""
        del state, key
        if context is not None or mask is not None:
            raise ValueError("AttractorNetwork: context and mask are not supported (the "
                             "couplings are tied to the N positions of one image).")
        out = self.step(x)
        if return_diagnostics:
            w = _phys.attention_weights(x, self.couplings, lam=self.lam_test)
            return out, Diagnostics(weights=w[None])
        return out

    # --- images ----------------------------------------------------------------------------
    def reconstruct(self, image: Float[ArrayLike, "H W"], steps: int, *,
                    lam: Optional[float] = None, norm: Optional[str] = None
                    ) -> Float[Array, "T H W"]:
        """Embeds one image, runs `steps` steps, decodes every state: `(steps + 1, H, W)`
        (index 0 is the decoded input, i.e. the input itself)."""
        _check_images("AttractorNetwork.reconstruct", image, self.embedding.image_shape, False)
        xs = self.run(self.embedding.embed(image), steps, lam=lam, norm=norm)
        return jax.vmap(self.embedding.decode)(xs)

    def constrained(self) -> "AttractorNetwork":
        """The same network with the couplings put back on the constraint (norm, 𝕁_ii = 0)."""
        return eqx.tree_at(lambda m: m.couplings, self,
                           _PROJECT[self.constraint](self.couplings, self.norm_value))

    def coupling_norm(self) -> Array:
        """The constrained norm: of the whole tensor (`constraint="global"`, a scalar) or of
        every block 𝕁_ij (`"block"`, `(N, N)`, zero on the diagonal)."""
        return _MEASURE[self.constraint](self.couplings)


def attractor_sgd_step(net: AttractorNetwork, images: Float[ArrayLike, "B H W"], *, lr: float,
                       clip: float, objective: Union[AttractorObjective, str] = "energy"):
    """One training step of the paper's sec. II-C / V-B: the mean over the batch of E(ξ) (or the
    exact negative log pseudo-likelihood on the sphere, `objective="pseudo_likelihood"`; an
    `AttractorObjective` or its name: `EnergyObjective()`, `PseudoLikelihoodObjective()`) at
    `net.lam_train`, its gradient with respect to the couplings only (the loss is a function
    of the data and the couplings: nothing is backpropagated through the dynamics), the
    gradient's L2 norm clipped at `clip`, a plain SGD step of size `lr`, and the couplings put
    back on their constraint (fixed norm, zero diagonal blocks).

    Pure and jittable (`eqx.filter_jit(attractor_sgd_step)`); images must be in [0, 1].

    **Returns:** `(net, metrics)` with metrics `loss` (per image, before the step),
    `grad_norm` (before clipping), `coupling_norm` (the whole tensor's) and `skipped` (1.0 when
    the loss or the updated couplings were not finite: the couplings are then left as they
    were).
    """
    _check_images("attractor_sgd_step", images, net.embedding.image_shape, True)
    objective = choice("attractor.objective", objective, where="attractor_sgd_step: objective")
    x = jax.vmap(net.embedding.embed)(jnp.asarray(images, jnp.float32))  # (B, N, d)
    lam = net.lam_train

    def loss(J):
        return jnp.mean(jax.vmap(lambda xx: objective.loss(xx, J, lam))(x))

    value, g = jax.value_and_grad(loss)(net.couplings)
    gnorm = jnp.sqrt(jnp.sum(g * g))
    g = g * jnp.minimum(1.0, clip / (gnorm + 1e-12))
    J = _PROJECT[net.constraint](net.couplings - lr * g, net.norm_value)
    ok = jnp.isfinite(value) & jnp.all(jnp.isfinite(J))
    J = jnp.where(ok, J, net.couplings)  # a non-finite step is skipped, never applied
    net = eqx.tree_at(lambda m: m.couplings, net, J)
    cn = jnp.sqrt(jnp.sum(J * J))
    return net, {"loss": value, "grad_norm": gnorm, "coupling_norm": cn,
                 "skipped": (~ok).astype(jnp.float32)}
