"""Energy Transformer attention: tokens descend one energy of attention and Hopfield memory
(B. Hoover et al., "Energy Transformer", NeurIPS 2023, arXiv:2302.07253; the physics is
`spinformer.spins.energy_transformer`).

The layer's input x₀ `(n, D)` descends E(LN(x)) = E_ATT + E_HN for `steps` steps of size
`alpha`, x ← x − α ∂E/∂g, with the same weights at every step (an unrolled `lax.scan`), and
returns the displacement x_T − x₀: inside a pre-norm block the residual stream then moves
as the paper's tokens do. The layer norm is the energy-based one (learned γ > 0, kept
positive as exp(log γ), and δ), the attention energy has queries and keys and no values,
and the Hopfield memories are ξ `(M, D)` (`hopfield`: `"relu"` or `"softmax"`, the energy's
`kind=` in `spins.energy_transformer`).

Not causal: every token's update depends on every other token through the keys
(∂E_ATT/∂g_B sums over the queries that see B), so causal models are refused; a padding
`mask` removes query–key pairs from the energy.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, PRNGKeyArray

from .._schema import ConfigError, check_values, option, register_attention
from ..spins import energy_transformer as et
from ..spins.energy_transformer import HopfieldEnergy
from ._attention_diagnostics import Diagnostics
from ._heads import check_heads, check_shapes
from ._literal import check_literal
from ._masks import combine_masks


@dataclasses.dataclass(frozen=True)
class EnergyTransformerConfig:
    """Settings of Energy Transformer attention: a config's
    `model.attention: {name: energy_transformer, ...}`."""

    steps: int = option(12, "descent steps T per layer (the paper: 12)")
    alpha: float = option(0.1, "step size alpha of x <- x - alpha dE/dg")
    head_dim: int = option(0, "Y, the width of each head's queries and keys (0: dim/num_heads)")
    memories: int = option(0, "M, the Hopfield memories (0: 2 * dim)")
    hopfield: HopfieldEnergy = option("relu", "the Hopfield energy: relu (-1/2 sum "
                                      "relu(xi.g)^2) or softmax (-1/beta_hn sum log sum exp)")
    beta_hn: float = option(1.0, "softmax memories: inverse temperature of the Hopfield energy")

    def __post_init__(self):
        if not self.steps >= 1:
            raise ConfigError(f"steps={self.steps} must be >= 1.")
        if not self.alpha > 0:
            raise ConfigError(f"alpha={self.alpha} must be > 0.")
        if not (self.head_dim >= 0 and self.memories >= 0):
            raise ConfigError("head_dim and memories must be >= 0 (0: the default size).")
        if not self.beta_hn > 0:
            raise ConfigError(f"beta_hn={self.beta_hn} must be > 0.")


# the constructor's defaults are the settings' (one source of defaults)
_DEFAULTS = EnergyTransformerConfig()


@register_attention("energy_transformer", config=EnergyTransformerConfig,
                    help="tokens descend an attention + Hopfield energy",
                    coupling_fields=("Wq", "Wk"))
class EnergyTransformerAttention(eqx.Module):
    """Energy Transformer attention; one example per call.

    **Arguments:**

    - `dim`: model width D; `num_heads`: H.
    - `causal`: must be False (the descent is not causal; see the module docstring).
    - `steps`, `alpha`: the descent's number of steps and step size.
    - `head_dim`: Y, the query/key width per head (0: D/H).
    - `memories`: M, the number of Hopfield memories (0: 2·D).
    - `hopfield`: the Hopfield-network energy of the memories, `"relu"`
      (−½ Σ_μ Σ_B relu(ξ_μ·g_B)², the paper's main choice) or `"softmax"`
      (−β_HN⁻¹ Σ_B ln Σ_μ exp(β_HN ξ_μ·g_B)); `beta_hn` the softmax variant's inverse
      temperature β_HN.
    - `key`: PRNG key.

    The attention energy's inverse temperature is the paper's β = 1/√Y.
    """

    Wq: Float[Array, "h y d"]
    Wk: Float[Array, "h y d"]
    xi: Float[Array, "m d"]
    log_gamma: Float[Array, ""]
    delta: Float[Array, " d"]
    alpha: float
    beta_hn: float
    dim: int = eqx.field(static=True)
    num_heads: int = eqx.field(static=True)
    causal: bool = eqx.field(static=True)
    steps: int = eqx.field(static=True)
    hopfield: HopfieldEnergy = eqx.field(static=True)

    def __init__(
        self, dim: int, num_heads: int = 1, causal: bool = False, *,
        steps: int = _DEFAULTS.steps,
        alpha: float = _DEFAULTS.alpha,
        head_dim: int = _DEFAULTS.head_dim,
        memories: int = _DEFAULTS.memories,
        hopfield: HopfieldEnergy = _DEFAULTS.hopfield,
        beta_hn: float = _DEFAULTS.beta_hn,
        key: PRNGKeyArray,
    ):
        check_heads("EnergyTransformerAttention", dim, num_heads)
        if causal:
            raise ValueError(
                "EnergyTransformerAttention is not causal: each token's descent depends on "
                "every other token through the attention energy's keys; use it in "
                "non-causal models (classifiers, encoders, masked reconstruction).")
        check_values(EnergyTransformerConfig, "EnergyTransformerAttention", steps=steps,
                     alpha=alpha, beta_hn=beta_hn)
        Y = head_dim or dim // num_heads
        M = memories or 2 * dim
        kq, kk, km = jax.random.split(key, 3)
        scale = 1.0 / math.sqrt(dim)
        self.Wq = scale * jax.random.normal(kq, (num_heads, Y, dim))
        self.Wk = scale * jax.random.normal(kk, (num_heads, Y, dim))
        self.xi = scale * jax.random.normal(km, (M, dim))
        self.log_gamma = jnp.zeros(())
        self.delta = jnp.zeros((dim,))
        self.alpha, self.beta_hn, self.steps = alpha, beta_hn, steps
        self.hopfield = check_literal("EnergyTransformerAttention", "hopfield", hopfield,
                                      HopfieldEnergy)
        self.dim, self.num_heads, self.causal = dim, num_heads, causal

    def params(self) -> et.Params:
        """The block's weights as `spins.energy_transformer.Params`."""
        return et.Params(jnp.exp(self.log_gamma), self.delta, self.Wq, self.Wk, self.xi,
                         beta=1.0 / math.sqrt(self.Wq.shape[1]), beta_hn=self.beta_hn)

    def __call__(self, x: Float[Array, "n d"], *, context: Optional[Float[Array, "s d"]] = None,
                 mask: Optional[Bool[Array, "n s"]] = None, state: None = None,
                 key: Optional[PRNGKeyArray] = None, return_diagnostics: bool = False):
        """**Arguments:** `x (n, d)`; `context`: not supported (one energy over one set of
        tokens); `mask (n, n)`, True where query i may use key j; `state`, `key`: unused;
        `return_diagnostics`: also return `Diagnostics` with `fields` the energies along
        the descent `(steps + 1,)` and `weights (H, n, n)`, the attention of the final
        normalised tokens.

        **Returns:** the displacement x_T − x `(n, d)`, or `(it, diagnostics)`.
        """
        del state, key
        if context is not None:
            raise ValueError("EnergyTransformerAttention: cross-attention (context=) is not "
                             "defined: the energy is over one set of tokens.")
        check_shapes("EnergyTransformerAttention", x, x, self.dim)
        allowed = combine_masks(x.shape[0], x.shape[0], False, mask)
        p = self.params()
        run = et.descent(x, p, steps=self.steps, alpha=self.alpha, kind=self.hopfield,
                         mask=allowed)
        out = run.x - x
        if return_diagnostics:
            g = et.layer_norm(run.x, p.gamma, p.delta, p.eps)
            weights = et.attention_weights(g, p.Wq, p.Wk, beta=p.beta, mask=allowed)
            return out, Diagnostics(weights=weights, fields=run.energies)
        return out
