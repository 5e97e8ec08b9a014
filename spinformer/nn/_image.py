"""Image classification with any registered attention: a patch or convolutional embedding,
a classification site, a stack of attention layers, a linear head on the classification site.

The convolutional embedding follows the MNIST example of M. Bal, "Deep Implicit Attention"
(2021): two 3×3 convolutions with ReLU and 3×3 max pooling of stride 2, which turn a 28×28
image into a 4×4 grid of `conv_channels` features, 16 sites mapped linearly to the model
width. The classification site is an extra site whose input is a learned vector shared by
all examples (the post's "learnable input injection"); the model reads its output.
"""

from __future__ import annotations

from typing import Any, Callable, Literal, Optional, Union

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PRNGKeyArray

from .._schema import get_attention
from ._block import Block
from ._literal import check_literal


def conv_grid(size: int) -> int:
    """Side of the grid the convolutional embedding makes of a `size × size` image
    (3×3 valid convolution, 3×3/2 max pooling, twice)."""
    for _ in range(2):
        size = (size - 2 - 3) // 2 + 1
    return size


class ConvEmbed(eqx.Module):
    """Conv(3×3) → ReLU → MaxPool(3, 2) → Conv(3×3) → ReLU → MaxPool(3, 2) → Linear, per
    image `(H, W)` → sites `(g·g, dim)` (g = 4 for 28×28)."""

    conv1: eqx.nn.Conv2d
    conv2: eqx.nn.Conv2d
    pool: eqx.nn.MaxPool2d
    proj: eqx.nn.Linear

    def __init__(self, channels: int, dim: int, *, key: PRNGKeyArray):
        k1, k2, k3 = jax.random.split(key, 3)
        self.conv1 = eqx.nn.Conv2d(1, channels, 3, key=k1)
        self.conv2 = eqx.nn.Conv2d(channels, channels, 3, key=k2)
        self.pool = eqx.nn.MaxPool2d(3, stride=2)
        self.proj = eqx.nn.Linear(channels, dim, key=k3)

    def __call__(self, image: Float[Array, "H W"]) -> Float[Array, "p d"]:
        h = self.pool(jax.nn.relu(self.conv1(image[None])))
        h = self.pool(jax.nn.relu(self.conv2(h)))
        c = h.shape[0]
        return jax.vmap(self.proj)(h.reshape(c, -1).T)


class PatchEmbed(eqx.Module):
    """Non-overlapping `patch × patch` patches, each mapped linearly to the model width:
    image `(H, W)` → `(H W / patch², dim)`."""

    proj: eqx.nn.Linear
    patch: int = eqx.field(static=True)

    def __init__(self, patch: int, dim: int, *, key: PRNGKeyArray):
        self.proj = eqx.nn.Linear(patch * patch, dim, key=key)
        self.patch = patch

    def __call__(self, image: Float[Array, "H W"]) -> Float[Array, "p d"]:
        H, W = image.shape
        p = self.patch
        patches = image.reshape(H // p, p, W // p, p).transpose(0, 2, 1, 3).reshape(-1, p * p)
        return jax.vmap(self.proj)(patches)


#: How an image becomes sites (`embed=`): `"conv"` (`ConvEmbed`, the Deep Implicit Attention
#: post's two conv+pool stages; images of at least 16×16) or `"patch"` (`PatchEmbed`, a
#: linear embedding of `patch × patch` patches).
ImageEmbed = Literal["conv", "patch"]


def _embedding(embed: ImageEmbed, image_shape: tuple[int, int], dim: int, *, patch: int,
               conv_channels: int, key: PRNGKeyArray) -> tuple[eqx.Module, int]:
    """The embedding module `embed` names for images of `image_shape` and the number of
    sites it makes (`patch`, `conv_channels`: the options of the patch and conv
    embeddings)."""
    H, W = image_shape
    if embed == "conv":
        if conv_grid(H) < 1 or conv_grid(W) < 1:
            raise ValueError(
                f"ImageClassifier: embed='conv' shrinks a {H}×{W} image to nothing (two "
                "3×3 convolutions and 3×3/2 poolings need at least 16×16 pixels); use "
                "embed='patch'.")
        return ConvEmbed(conv_channels, dim, key=key), conv_grid(H) * conv_grid(W)
    if patch < 1 or H % patch or W % patch:
        raise ValueError(f"ImageClassifier: patch={patch} must divide the image "
                         f"sides {H}×{W}.")
    return PatchEmbed(patch, dim, key=key), (H // patch) * (W // patch)


class BareLayer(eqx.Module):
    """An attention used as a whole layer: `x ↦ attention(x)` with no norm and no residual
    (the implicit layer of Deep Implicit Attention carries its own source term)."""

    attention: eqx.Module

    def __call__(self, x, *, key=None, return_diagnostics: bool = False, **kwargs):
        return self.attention(x, key=key, return_diagnostics=return_diagnostics, **kwargs)


class ImageClassifier(eqx.Module):
    """An image `(H, W)` → class logits `(num_classes,)`.

    **Arguments:**

    - `image_shape`: `(H, W)` of the (single-channel) images.
    - `num_classes`: number of classes.
    - `dim`: model width D; `depth`: number of attention layers; `num_heads`: heads.
    - `attention`: a registered attention name or class (as `Transformer`);
      `attention_kwargs`: its constructor arguments.
    - `embed`: `"conv"` (the Deep Implicit Attention post's two conv+pool stages; needs
      images of at least 16×16) or `"patch"` (linear patch embedding, `patch × patch`
      patches).
    - `conv_channels`: channels of the convolutional embedding.
    - `residual`: True wraps each attention in a pre-norm residual `Block` (with an FFN of
      width `ffn_hidden`, 0 for none) and ends with a LayerNorm; False applies the attentions
      bare, one after the other (the DEQ model of the post: one implicit layer, no FFN).
    - `positions`: add a learned position embedding to the sites.
    - `dropout`: dropout on the residual branches (residual only).
    - `key`: PRNG key.

    Sites: the embedded patches plus one classification site (site 0), whose input is a
    learned vector; attentions that need the number of sites (`takes_max_len`) get it.
    """

    embed: Union[ConvEmbed, PatchEmbed]
    cls_token: Float[Array, " d"]
    pos_embed: Optional[Float[Array, "n d"]]
    layers: eqx.Module
    norm: Optional[eqx.nn.LayerNorm]
    head: eqx.nn.Linear
    depth: int = eqx.field(static=True)
    image_shape: tuple[int, int] = eqx.field(static=True)

    def __init__(
        self,
        image_shape: tuple[int, int],
        num_classes: int,
        dim: int,
        depth: int = 1,
        num_heads: int = 1,
        attention: Union[str, Callable[..., eqx.Module]] = "softmax",
        attention_kwargs: Optional[dict[str, Any]] = None,
        *,
        embed: ImageEmbed = "conv",
        patch: int = 4,
        conv_channels: int = 32,
        residual: bool = True,
        ffn_hidden: int = 0,
        positions: bool = True,
        dropout: float = 0.0,
        key: PRNGKeyArray,
    ):
        H, W = image_shape
        if depth < 1:
            raise ValueError(f"ImageClassifier: depth={depth} must be >= 1.")
        embed = check_literal("ImageClassifier", "embed", embed, ImageEmbed)
        ke, kc, kp, kl, kh = jax.random.split(key, 5)
        self.embed, num_sites = _embedding(embed, (H, W), dim, patch=patch,
                                           conv_channels=conv_channels, key=ke)
        n = num_sites + 1
        self.cls_token = jax.random.normal(kc, (dim,)) / jnp.sqrt(dim)
        self.pos_embed = 0.02 * jax.random.normal(kp, (n, dim)) if positions else None
        self.layers = _layers(attention, attention_kwargs, dim, num_heads, n, depth,
                              residual=residual, ffn_hidden=ffn_hidden, dropout=dropout, key=kl)
        self.norm = eqx.nn.LayerNorm(dim) if residual else None
        self.head = eqx.nn.Linear(dim, num_classes, key=kh)
        self.depth = depth
        self.image_shape = (H, W)

    @property
    def num_sites(self) -> int:
        """Sites of the spin model / tokens of the attention: patches + 1."""
        return jax.eval_shape(self.embed, jnp.zeros(self.image_shape)).shape[0] + 1

    def sites(self, image: Float[Array, "H W"]) -> Float[Array, "n d"]:
        """The attention's input: the classification site, then the embedded patches (plus
        positions)."""
        x = self.embed(image)
        x = jnp.concatenate([self.cls_token[None].astype(x.dtype), x], axis=0)
        if self.pos_embed is not None:
            x = x + self.pos_embed
        return x

    def __call__(self, image: Float[Array, "H W"], *, key: Optional[PRNGKeyArray] = None,
                 return_diagnostics: bool = False):
        """**Arguments:** `image (H, W)` (one example; vmap for a batch); `key` enables
        dropout and training-only regularisers; `return_diagnostics` also returns the layers'
        `Diagnostics` stacked over layers (leading axis `depth`).

        **Returns:** logits `(num_classes,)`, or `(logits, diagnostics)`.
        """
        if image.shape != self.image_shape:
            raise ValueError(f"ImageClassifier: image must have shape {self.image_shape}; got "
                             f"{image.shape}. Use jax.vmap(model)(images) for a batch.")
        x, diags = _apply(self.layers, self.depth, self.sites(image), key, return_diagnostics)
        h = x[0] if self.norm is None else self.norm(x[0])
        logits = self.head(h)
        return (logits, diags) if return_diagnostics else logits


def _layers(attention, attention_kwargs, dim, num_heads, n, depth, *, residual, ffn_hidden,
            dropout, key):
    """`depth` non-causal layers over `n` sites, stacked on a leading axis (for `_apply`):
    pre-norm residual `Block`s with an FFN of width `ffn_hidden`, or bare attentions."""
    reg = get_attention(attention)
    kwargs = dict(attention_kwargs or {})

    def make_layer(k):
        ka, kf = jax.random.split(k)
        attn = reg.build(dim=dim, num_heads=num_heads, causal=False, max_len=n, key=ka,
                         **kwargs)
        if residual:
            return Block(attn, dim, ffn_hidden=ffn_hidden, dropout=dropout, key=kf)
        return BareLayer(attn)

    return eqx.filter_vmap(make_layer)(jax.random.split(key, depth))


def _apply(layers, depth, x, key, return_diagnostics):
    """`(x, diagnostics)`: the stacked layers applied in turn (one `lax.scan`); the
    diagnostics stacked over layers, None without `return_diagnostics`."""
    dynamic, static = eqx.partition(layers, eqx.is_array)
    keys = None if key is None else jax.random.split(key, depth)

    def layer(h, xs):
        params, k = xs
        out = eqx.combine(params, static)(h, key=k, return_diagnostics=return_diagnostics)
        return out if return_diagnostics else (out, None)

    return jax.lax.scan(layer, x, (dynamic, keys))


class ImageReconstructor(eqx.Module):
    """A corrupted image `(H, W)` → the restored image `(H, W)`, patch by patch, with any
    registered (non-causal) attention: the masked-image and denoising tasks of the attractor
    paper (F. D'Amico, M. Negri, arXiv:2409.16112) and the Energy Transformer (B. Hoover et
    al., arXiv:2302.07253), trained by the library's trainer on `data.ImageReconstruction`.

    Non-overlapping `patch × patch` patches are embedded linearly (plus learned positions),
    go through `depth` layers (pre-norm residual `Block`s with FFNs of width `ffn_hidden`,
    or with `residual=False` the bare attentions), a final LayerNorm (residual only), and a
    linear map from each site back to its patch's pixels. Arguments as `ImageClassifier`'s
    (no classification site, no conv embedding). `nn.PatchReconstructor` is the attractor
    experiment's variant (recurrent iterations, patches in and out).

    `model(image, key=None, return_diagnostics=False)` returns the image `(H, W)` (and the
    layers' `Diagnostics` stacked over layers).
    """

    embed: PatchEmbed
    pos_embed: Optional[Float[Array, "n d"]]
    layers: eqx.Module
    norm: Optional[eqx.nn.LayerNorm]
    unembed: eqx.nn.Linear
    depth: int = eqx.field(static=True)
    image_shape: tuple[int, int] = eqx.field(static=True)

    def __init__(self, image_shape: tuple[int, int], dim: int, depth: int = 1,
                 num_heads: int = 1, attention: Union[str, Callable[..., eqx.Module]] = "softmax",
                 attention_kwargs: Optional[dict[str, Any]] = None, *, patch: int = 4,
                 residual: bool = True, ffn_hidden: int = 0, positions: bool = True,
                 dropout: float = 0.0, key: PRNGKeyArray):
        if depth < 1:
            raise ValueError(f"ImageReconstructor: depth={depth} must be >= 1.")
        ke, kp, kl, ku = jax.random.split(key, 4)
        self.embed, n = _embedding("patch", tuple(image_shape), dim, patch=patch,
                                   conv_channels=0, key=ke)
        self.pos_embed = 0.02 * jax.random.normal(kp, (n, dim)) if positions else None
        self.layers = _layers(attention, attention_kwargs, dim, num_heads, n, depth,
                              residual=residual, ffn_hidden=ffn_hidden, dropout=dropout, key=kl)
        self.norm = eqx.nn.LayerNorm(dim) if residual else None
        self.unembed = eqx.nn.Linear(dim, patch * patch, key=ku)
        self.depth = depth
        self.image_shape = tuple(int(v) for v in image_shape)

    def __call__(self, image: Float[Array, "H W"], *, key: Optional[PRNGKeyArray] = None,
                 return_diagnostics: bool = False):
        if image.shape != self.image_shape:
            raise ValueError(f"ImageReconstructor: image must have shape {self.image_shape}; "
                             f"got {image.shape}. Use jax.vmap(model)(images) for a batch.")
        x = self.embed(image)
        if self.pos_embed is not None:
            x = x + self.pos_embed
        x, diags = _apply(self.layers, self.depth, x, key, return_diagnostics)
        if self.norm is not None:
            x = jax.vmap(self.norm)(x)
        H, W = self.image_shape
        p = self.embed.patch
        out = jax.vmap(self.unembed)(x).reshape(H // p, W // p, p, p)
        out = out.transpose(0, 2, 1, 3).reshape(H, W)
        return (out, diags) if return_diagnostics else out
