r"""Transformers that reconstruct an image from a corrupted one, patch by patch: the
backpropagation-trained baselines of F. D'Amico, M. Negri, "Self-attention as an attractor
network", arXiv:2409.16112, sec. V-C.

- *Recurrent block* (`depth=1`, `iterations` > 1): one pre-LN transformer block (eqs. 8–9,
  `nn.Block` with `nn.SoftmaxAttention` and a GELU MLP) applied τ times with shared weights,
  τ ~ U{3..7} in training (AlphaFold's recycling); trained linear embedding F and output map
  F_out; learned positional encoding added after the embedding and subtracted before F_out.
- *ViT* (`depth=5`, one pass): five different blocks, the same embedding and output maps.

Any registered attention can stand in for softmax (`attention=`, `attention_kwargs=`). The
Energy Transformer's masked-image model (B. Hoover et al., arXiv:2302.07253, sec. 4) is
`attention="energy_transformer", ffn_hidden=0, norm=False, final_norm=True`: one block
x ← x_T (T descent steps of one energy, no MLP: the Hopfield energy takes its place, no
pre-norm: the energy's own layer norm), so `iterations` k continues the same descent to k·T
steps, and the output map reads the layer-normalised tokens. The readout needs the norm: the
descent moves x by −α ∂E/∂g, which does not shrink as ‖x‖ grows (E depends on x only
through g = LN(x)), so x_T drifts and a linear map of x_T itself is off by O(1) at
initialisation and worse when the descent is continued (experiments/results/attractor/
findings.md). Differences from the paper's model: no CLS token (it only collects a global
representation), no learned MASK token (masked pixels enter as zeros through the linear
embedding, as for the other baselines), and the readout's layer norm is a separate one (per
feature γ, δ) instead of the block's own (scalar γ); followed by a linear map both are "an
affine map of the centred, unit-variance token". The reference code
(`bhoov/energy-transformer-jax`, `image_core.py`) applies its layer norm twice before
decoding (`decode(lnorm(x))` with `decode` normalising again).
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Union

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

from ._block import Block
from .._schema import get_attention

__all__ = ["PatchReconstructor"]


class PatchReconstructor(eqx.Module):
    """Linear patch embedding + positions + a stack of `depth` pre-LN blocks applied
    `iterations` times + positions removed + linear map back to pixels.

    **Arguments:** `num_tokens` N, `patch_dim` (pixels per patch, P²), `dim` D, `depth`,
    `num_heads`, `ffn_hidden` (None: 2·D; 0: no MLP), `attention` (a registered attention's
    name or class, non-causal) and `attention_kwargs` (its constructor's options), `norm`
    (False: blocks without layer norms, `x + attn(x)`), `final_norm` (True: the output map
    reads LayerNorm(h); False: h − positions, the attractor paper's baselines), `key`.

    `model(patches (N, P²), iterations)` returns `(N, P²)`; `iterations` may be a traced
    integer (it masks a scan of fixed length `max_iterations`, so one compiled step serves
    every τ). `trajectory(patches, steps)` returns the outputs after 0..steps iterations.
    """

    embed: eqx.nn.Linear
    unembed: eqx.nn.Linear
    pos: Float[Array, "N D"]
    blocks: Block
    final_norm: Optional[eqx.nn.LayerNorm]
    depth: int = eqx.field(static=True)

    def __init__(self, num_tokens: int, patch_dim: int, dim: int, depth: int = 1,
                 num_heads: int = 4, ffn_hidden: Optional[int] = None, *,
                 attention: Union[str, Callable[..., eqx.Module]] = "softmax",
                 attention_kwargs: Optional[dict[str, Any]] = None, norm: bool = True,
                 final_norm: bool = False, key: PRNGKeyArray):
        if depth < 1:
            raise ValueError(f"PatchReconstructor: depth must be >= 1; got {depth}.")
        ffn_hidden = 2 * dim if ffn_hidden is None else int(ffn_hidden)
        reg = get_attention(attention)
        kwargs = dict(attention_kwargs or {})
        ke, ku, kp, kb = jax.random.split(key, 4)
        self.embed = eqx.nn.Linear(patch_dim, dim, key=ke)
        self.unembed = eqx.nn.Linear(dim, patch_dim, key=ku)
        self.pos = 0.02 * jax.random.normal(kp, (num_tokens, dim))
        self.final_norm = eqx.nn.LayerNorm(dim) if final_norm else None

        def make(k):
            ka, kf = jax.random.split(k)
            attn = reg.build(dim=dim, num_heads=num_heads, causal=False, max_len=num_tokens,
                             key=ka, **kwargs)
            return Block(attn, dim, ffn_hidden, norm=norm, key=kf)

        self.blocks = eqx.filter_vmap(make)(jax.random.split(kb, depth))
        self.depth = int(depth)

    def block(self, i: int = 0) -> Block:
        """Block `i` of the stack (`blocks` holds them stacked along a leading axis)."""
        if not 0 <= i < self.depth:
            raise IndexError(f"PatchReconstructor: block {i} of a stack of {self.depth}.")
        return jax.tree.map(lambda a: a[i] if eqx.is_array(a) else a, self.blocks)

    def _stack(self, x):
        params, static = eqx.partition(self.blocks, eqx.is_array)

        def body(h, p):
            return eqx.combine(p, static)(h), None

        return jax.lax.scan(body, x, params)[0]

    def encode(self, patches: Float[Array, "N p"]) -> Float[Array, "N D"]:
        """The blocks' input tokens: embedded patches plus positions."""
        if patches.ndim != 2 or patches.shape[0] != self.pos.shape[0]:
            raise ValueError(f"PatchReconstructor: patches must be (N, P²) with N = "
                             f"{self.pos.shape[0]}; got {patches.shape}. vmap over a batch.")
        return jax.vmap(self.embed)(patches) + self.pos

    def decode(self, h: Float[Array, "N D"]) -> Float[Array, "N p"]:
        """Patches from the blocks' output tokens: the output map of LayerNorm(h) (with
        `final_norm`) or of h − positions."""
        if self.final_norm is not None:
            return jax.vmap(lambda t: self.unembed(self.final_norm(t)))(h)
        return jax.vmap(self.unembed)(h - self.pos)

    def __call__(self, patches: Float[Array, "N p"], iterations: Union[int, Int[Array, ""]] = 1,
                 *, max_iterations: Optional[int] = None) -> Float[Array, "N p"]:
        """Output patches after `iterations` passes through the stack (`max_iterations`, the
        scan length, defaults to `iterations` when that is a Python int)."""
        h = self.encode(patches)
        if isinstance(iterations, int) and max_iterations is None:
            max_iterations = iterations
        if max_iterations is None:
            raise ValueError("PatchReconstructor: pass max_iterations= with a traced "
                             "iterations count.")

        def body(h, t):
            return jnp.where(t < iterations, self._stack(h), h), None

        h = jax.lax.scan(body, h, jnp.arange(int(max_iterations)))[0]
        return self.decode(h)

    def trajectory(self, patches: Float[Array, "N p"], steps: int) -> Float[Array, "T N p"]:
        """`(steps + 1, N, P²)`: the input itself, then the output after 1..steps passes."""
        h = self.encode(patches)

        def body(h, _):
            h = self._stack(h)
            return h, self.decode(h)

        _, outs = jax.lax.scan(body, h, None, length=int(steps))
        return jnp.concatenate([patches[None], outs], axis=0)
