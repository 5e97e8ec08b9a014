"""Free-energy attention: the AFEM `VectorSpinAttention` of M. Bal, "Transformers from Spin
Models: Approximate Free Energy Minimization" (2021),
https://mcbal.github.io/post/transformers-from-spin-models-approximate-free-energy-minimization/.

Per head, the n tokens are the external fields of n vector spins on spheres, coupled by a
scalar coupling matrix J (symmetric, zero diagonal): explicit parameters (the post's default,
initialised N(0, 1/(n D_h)) in standard deviation — the post's "N(0, 1/√(ND))" read as the
scale 1/√N · 1/√D its text explains) or input-dependent couplings
J(H) = sym(tanh(√D H Q Kᵀ Hᵀ))/√(n D) (the post's example, symmetrised): the option
`couplings`, `"explicit"` or `"input"` (the words of `Couplings`). The fields are
h_i = LayerNorm(x_i)/√D_h (|h_i| ≈ 1, the post's normalisation); the output is the unit-spin
magnetizations ⟨σ_i⟩/√D_h = β⁻¹ ∂ ln Z/∂h_i of the steepest-descent (large-D)
partition function, found at the saddle t* of φ(t) (`spinformer.spins.free_energy`), heads
concatenated, then an optional output map.

With fixed J the output is ½ Σ_j [(diag(t*) − J)⁻¹]_ij h_j: a symmetric, input-dependent
mixing of the fields through t* (the Neumann series of the inverse starts with the residual
term h_i/(2t_i)). With J(H) the derivative also runs through the couplings.

The saddle is solved by a damped Newton method that keeps diag(t) − J positive definite and
differentiated implicitly with the closed-form Hessian (O(n³) per step, independent of D). A
failed saddle is reported in the diagnostics (and raises with `throw=True`); its output is
zero and passes no gradient, never NaN.

On a CPU with few cores, jaxlib 0.10's batched Cholesky can deadlock XLA's thread pool
inside a training step. The project's
dependency bounds exclude jaxlib 0.10, and `train.fit` warns if it is installed anyway
(docs/guides/installing.md, "Known problem").
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal, Optional

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, PRNGKeyArray

from .. import solvers
from .._schema import (ConfigError, check_solvers, check_values, option, register_attention,
                       register_choice)
from ..spins import free_energy as fe
from ._attention_diagnostics import Diagnostics, Stats
from ._heads import check_heads, merge_heads, split_heads
from ._literal import check_literal
from ._masks import combine_masks

# config words of the saddle's own solver and adjoint
register_choice("solver", "saddle_newton")(fe.SaddleNewton)
register_choice("adjoint", "saddle_implicit")(fe.SaddleImplicit)


# Where the coupling matrices J come from (`couplings=`, config `model.attention.couplings`):
# `explicit`, learned symmetric J `(H, max_len, max_len)` with zero diagonal, entries
# initialised N(0, 1/(n D_h)); `input`, J(H) = sym(tanh(√D H Q Kᵀ Hᵀ))/√(n D) from the fields
# (`spins.free_energy.tanh_couplings`) with learned D_h × D_h maps Q, K per head, the saddle's
# derivative running through them.
Couplings = Literal["explicit", "input"]


@dataclasses.dataclass(frozen=True)
class FreeEnergyConfig:
    """Settings of free-energy attention: a config's `model.attention: {name: free_energy, ...}`."""

    couplings: Couplings = option("explicit", "explicit: learned symmetric J with zero "
                                  "diagonal (needs a fixed number of tokens); input: J(H) = "
                                  "sym(tanh(√D H Q Kᵀ Hᵀ))/√(nD) from the fields")
    beta: float = option(1.0, "inverse temperature β")
    output_proj: bool = option(True, "mix the heads' magnetizations with a learned linear map")
    solver: solvers.AbstractSolver = option(
        fe.SaddleNewton(tol=1e-5, max_steps=50),
        "the saddle's root finder (tol: max relative violation of the spherical constraint; "
        "saddle_newton keeps diag(t) - J positive definite)", kind="solver")
    adjoint: solvers.AbstractAdjoint = option(
        fe.SaddleImplicit(),
        "how gradients flow through the saddle (saddle_implicit: the closed-form Hessian)",
        kind="adjoint")

    def __post_init__(self):
        # the saddle exists and is unique for every beta > 0 (`spins.free_energy`)
        if not self.beta > 0:
            raise ConfigError(f"beta={self.beta} must be > 0.")
        check_solvers(self, root=True)


# the constructor's defaults are the settings' (one source of defaults)
_DEFAULTS = FreeEnergyConfig()


@register_attention("free_energy", config=FreeEnergyConfig, help="free-energy (AFEM) "
                    "steepest-descent vector spins", takes_max_len=True,
                    coupling_fields=("J", "Q", "K"))
class FreeEnergyAttention(eqx.Module):
    """Free-energy attention, one example per call.

    **Arguments:**

    - `dim`: model width D; `num_heads`: H (one spin model per head, spins of dimension D/H).
    - `causal`: not supported (raises): the couplings of this model are symmetric and every
      output depends on every field through t* and V⁻¹, so no mask makes token i blind to
      later tokens. Use it in non-causal models (classifiers, encoders).
    - `max_len`: the number of spins of explicit couplings (inputs may have n ≤ max_len
      tokens: the first n are used).
    - `couplings`: where the couplings come from, a word of `Couplings`: `"explicit"`
      (learned symmetric J `(H, max_len, max_len)`, zero diagonal, entries initialised
      N(0, 1/(n D_h))) or `"input"` (J(H) = sym(tanh(√D H Q Kᵀ Hᵀ))/√(n D) from the fields,
      learned `Q`, `K` of shape `(H, D_h, D_h)`); kept in the field `couplings_kind`.
      `beta`: inverse temperature.
    - `output_proj`: a learned D × D map on the concatenated magnetizations.
    - `solver`: the saddle's root finder and `adjoint` (defaults: `FreeEnergyConfig.solver`, a
      `spins.free_energy.SaddleNewton`, and `FreeEnergyConfig.adjoint`, a `SaddleImplicit`
      with the closed-form Hessian); `throw`.
    - `key`: PRNG key.
    """

    J: Optional[Float[Array, "h n n"]]
    Q: Optional[Float[Array, "h dh dh"]]
    K: Optional[Float[Array, "h dh dh"]]
    norm: eqx.nn.LayerNorm
    out_proj: Optional[eqx.nn.Linear]
    beta: float
    solver: solvers.AbstractRootFinder
    adjoint: Optional[solvers.AbstractAdjoint]
    dim: int = eqx.field(static=True)
    num_heads: int = eqx.field(static=True)
    causal: bool = eqx.field(static=True)
    couplings_kind: Couplings = eqx.field(static=True)
    throw: bool = eqx.field(static=True)

    def __init__(
        self, dim: int, num_heads: int = 1, causal: bool = False, *,
        max_len: int,
        couplings: Couplings = _DEFAULTS.couplings,
        beta: float = _DEFAULTS.beta,
        output_proj: bool = _DEFAULTS.output_proj,
        solver: solvers.AbstractRootFinder = _DEFAULTS.solver,
        adjoint: solvers.AbstractAdjoint = _DEFAULTS.adjoint,
        throw: bool = False,
        key: PRNGKeyArray,
    ):
        check_heads("FreeEnergyAttention", dim, num_heads)
        if causal:
            raise ValueError(
                "FreeEnergyAttention: causal=True is not supported: the spin model's couplings "
                "are symmetric and each magnetization depends on every field through the "
                "saddle, so later tokens would leak into earlier outputs. Use it in a "
                "non-causal model (a classifier or encoder).")
        couplings = check_literal("FreeEnergyAttention", "couplings", couplings, Couplings)
        check_values(FreeEnergyConfig, "FreeEnergyAttention", beta=beta)
        H, dh, n = num_heads, dim // num_heads, max_len
        kj, kq, kk, ko = jax.random.split(key, 4)
        if couplings == "explicit":
            A = jax.random.normal(kj, (H, n, n)) / math.sqrt(n * dh)
            # symmetric with the same entry scale, zero diagonal
            self.J = (A + jnp.swapaxes(A, 1, 2)) / math.sqrt(2) * (1 - jnp.eye(n))
            self.Q = self.K = None
        else:
            self.J = None
            self.Q = jax.random.normal(kq, (H, dh, dh)) / math.sqrt(dh)
            self.K = jax.random.normal(kk, (H, dh, dh)) / math.sqrt(dh)
        self.norm = eqx.nn.LayerNorm(dim)
        self.out_proj = eqx.nn.Linear(dim, dim, use_bias=False, key=ko) if output_proj else None
        self.beta = float(beta)
        self.solver, self.adjoint = solver, adjoint
        self.dim, self.num_heads, self.causal, self.throw = dim, num_heads, causal, throw
        self.couplings_kind = couplings

    def fields(self, x: Float[Array, "n d"]) -> Float[Array, "h n dh"]:
        """Per-head normalised fields h_i = LayerNorm(x_i)/√D_h, `(H, n, D_h)`."""
        dh = self.dim // self.num_heads
        return split_heads(jax.vmap(self.norm)(x), self.num_heads) / math.sqrt(dh)

    def couplings(self, h: Float[Array, "h n dh"],
                  mask: Optional[Bool[Array, "n n"]] = None) -> Float[Array, "h n n"]:
        """The coupling matrices J `(H, n, n)` (symmetric, zero diagonal) for fields `h`."""
        n = h.shape[1]
        if self.couplings_kind == "explicit":
            if n > self.J.shape[1]:
                raise ValueError(
                    f"FreeEnergyAttention: {n} tokens but the explicit couplings have "
                    f"{self.J.shape[1]} spins; build the module with max_len >= {n}.")
            J = self.J[:, :n, :n]
            J = 0.5 * (J + jnp.swapaxes(J, 1, 2)) * (1 - jnp.eye(n, dtype=J.dtype))
        else:
            J = jax.vmap(fe.tanh_couplings)(h, self.Q, self.K)
        allowed = combine_masks(n, n, self.causal, mask)
        if allowed is not None:
            keep = (allowed & allowed.T).astype(J.dtype)  # keep J symmetric
            J = J * keep
        return J

    def _one_head(self, h, J):
        """One head's saddle and magnetizations; `J` the coupling matrix, or a function of
        the fields that returns it (the derivative then runs through the couplings)."""
        kw = dict(beta=self.beta, normalized=True)
        sol = fe.saddle(h, J, solver=self.solver, adjoint=self.adjoint, throw=self.throw, **kw)
        m = fe.magnetizations(h, J, saddle=sol, **kw)
        ok = sol.result == solvers.RESULTS.successful
        # a failed saddle gives zeros with no gradient (and is counted in the diagnostics)
        m = jnp.where(ok, m, jax.lax.stop_gradient(jnp.zeros_like(m)))
        return m, Stats.of(sol), sol.value

    def _magnetizations(self, h, mask):
        """Every head's saddle: `(m (H, n, dh), stats, J (H, n, n))`, J the couplings the
        diagnostics report. With input couplings the saddle is given the couplings as a
        function of the fields, so the derivative runs through them."""
        if self.couplings_kind == "explicit":
            J = self.couplings(h, mask)
            m, stats, _ = jax.vmap(lambda hh, jj: self._one_head(hh, jj))(h, J)
            return m, stats, J
        J = jax.lax.stop_gradient(self.couplings(h, mask))

        def one_head(hh, Q, K):
            def coupling_fn(x):
                Jx = fe.tanh_couplings(x, Q, K)
                allowed = combine_masks(x.shape[0], x.shape[0], self.causal, mask)
                if allowed is not None:
                    Jx = Jx * (allowed & allowed.T).astype(Jx.dtype)
                return Jx

            return self._one_head(hh, coupling_fn)

        m, stats, _ = jax.vmap(one_head)(h, self.Q, self.K)
        return m, stats, J

    def __call__(self, x: Float[Array, "n d"], *, context: Optional[Float[Array, "s d"]] = None,
                 mask: Optional[Bool[Array, "n s"]] = None, state=None,
                 key: Optional[PRNGKeyArray] = None, return_diagnostics: bool = False):
        """**Arguments:**

        - `x`: tokens `(n, d)` (the external fields after LayerNorm and /√D_h).
        - `context`: not supported (must be None).
        - `mask`: boolean `(n, n)`: a coupling J_ij is kept where both (i, j) and (j, i) are
          allowed (e.g. padding).
        - `state`, `key`: unused.
        - `return_diagnostics`: also return `Diagnostics` with `magnetizations (H, n, D_h)`,
          `fields (H, n, D_h)`, `couplings` J `(H, n, n)` and `solver` (`Stats` of each
          head's saddle solve).

        **Returns:** `(n, d)`, or `(output, diagnostics)`.
        """
        del state, key
        if context is not None:
            raise ValueError("FreeEnergyAttention: cross-attention (context=) is not "
                             "supported.")
        if x.ndim != 2 or x.shape[-1] != self.dim:
            raise ValueError(f"FreeEnergyAttention: x must have shape (n, {self.dim}); got "
                             f"{x.shape}. Use jax.vmap(module)(x) for a batch.")
        h = self.fields(x)
        m, stats, J = self._magnetizations(h, mask)
        out = merge_heads(m)
        y = jax.vmap(self.out_proj)(out) if self.out_proj is not None else out
        if return_diagnostics:
            return y, Diagnostics(couplings=J, magnetizations=m, fields=h, solver=stats)
        return y
