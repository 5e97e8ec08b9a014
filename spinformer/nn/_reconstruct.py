r"""Transformers that reconstruct an image from a corrupted one, patch by patch: the
backpropagation-trained baselines of F. D'Amico, M. Negri, "Self-attention as an attractor
network", arXiv:2409.16112, sec. V-C.

- *Recurrent block* (`depth=1`, `iterations` > 1): one pre-LN transformer block (eqs. 8–9,
  `nn.Block` with `nn.SoftmaxAttention` and a GELU MLP) applied τ times with shared weights,
  τ ~ U{3..7} in training (AlphaFold's recycling); trained linear embedding F and output map
  F_out; learned positional encoding added after the embedding and subtracted before F_out.
- *ViT* (`depth=5`, one pass): five different blocks, the same embedding and output maps.
"""

from __future__ import annotations

from typing import Optional, Union

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

from ._block import Block
from ._softmax import SoftmaxAttention

__all__ = ["PatchReconstructor"]


class PatchReconstructor(eqx.Module):
    """Linear patch embedding + positions + a stack of `depth` pre-LN blocks applied
    `iterations` times + positions removed + linear map back to pixels.

    **Arguments:** `num_tokens` N, `patch_dim` (pixels per patch, P²), `dim` D, `depth`,
    `num_heads`, `ffn_hidden`, `key`.

    `model(patches (N, P²), iterations)` returns `(N, P²)`; `iterations` may be a traced
    integer (it masks a scan of fixed length `max_iterations`, so one compiled step serves
    every τ). `trajectory(patches, steps)` returns the outputs after 0..steps iterations.
    """

    embed: eqx.nn.Linear
    unembed: eqx.nn.Linear
    pos: Float[Array, "N D"]
    blocks: Block
    depth: int = eqx.field(static=True)

    def __init__(self, num_tokens: int, patch_dim: int, dim: int, depth: int = 1,
                 num_heads: int = 4, ffn_hidden: Optional[int] = None, *, key: PRNGKeyArray):
        if depth < 1:
            raise ValueError(f"PatchReconstructor: depth must be >= 1; got {depth}.")
        ffn_hidden = 2 * dim if ffn_hidden is None else int(ffn_hidden)
        ke, ku, kp, kb = jax.random.split(key, 4)
        self.embed = eqx.nn.Linear(patch_dim, dim, key=ke)
        self.unembed = eqx.nn.Linear(dim, patch_dim, key=ku)
        self.pos = 0.02 * jax.random.normal(kp, (num_tokens, dim))

        def make(k):
            ka, kf = jax.random.split(k)
            return Block(SoftmaxAttention(dim, num_heads, key=ka), dim, ffn_hidden, key=kf)

        self.blocks = eqx.filter_vmap(make)(jax.random.split(kb, depth))
        self.depth = int(depth)

    def _stack(self, x):
        params, static = eqx.partition(self.blocks, eqx.is_array)

        def body(h, p):
            return eqx.combine(p, static)(h), None

        return jax.lax.scan(body, x, params)[0]

    def _in(self, patches):
        if patches.ndim != 2 or patches.shape[0] != self.pos.shape[0]:
            raise ValueError(f"PatchReconstructor: patches must be (N, P²) with N = "
                             f"{self.pos.shape[0]}; got {patches.shape}. vmap over a batch.")
        return jax.vmap(self.embed)(patches) + self.pos

    def _out(self, h):
        return jax.vmap(self.unembed)(h - self.pos)

    def __call__(self, patches: Float[Array, "N p"], iterations: Union[int, Int[Array, ""]] = 1,
                 *, max_iterations: Optional[int] = None) -> Float[Array, "N p"]:
        """Output patches after `iterations` passes through the stack (`max_iterations`, the
        scan length, defaults to `iterations` when that is a Python int)."""
        h = self._in(patches)
        if isinstance(iterations, int) and max_iterations is None:
            max_iterations = iterations
        if max_iterations is None:
            raise ValueError("PatchReconstructor: pass max_iterations= with a traced "
                             "iterations count.")

        def body(h, t):
            return jnp.where(t < iterations, self._stack(h), h), None

        h = jax.lax.scan(body, h, jnp.arange(int(max_iterations)))[0]
        return self._out(h)

    def trajectory(self, patches: Float[Array, "N p"], steps: int) -> Float[Array, "T N p"]:
        """`(steps + 1, N, P²)`: the input itself, then the output after 1..steps passes."""
        h = self._in(patches)

        def body(h, _):
            h = self._stack(h)
            return h, self._out(h)

        _, outs = jax.lax.scan(body, h, None, length=int(steps))
        return jnp.concatenate([patches[None], outs], axis=0)
