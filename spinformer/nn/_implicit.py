"""Deep Implicit Attention: attention as the mean-field response of a vector-spin model,
solved to equilibrium as one implicit (DEQ) layer (M. Bal, "Deep Implicit Attention: A
Mean-Field Theory Perspective on Attention Mechanisms" (2021),
https://mcbal.github.io/post/deep-implicit-attention-a-mean-field-theory-perspective-on-attention-mechanisms/).

The N input vectors X_i act as external fields on N vector spins of dimension d; the output
is the spins' mean-field magnetizations, the solution of

    ⟨S_i⟩ = Σ_j J_ij ⟨S_j⟩ − f(⟨S_i⟩) + X_i                       (the post's DEQ update)

with d × d coupling blocks J_ij (zero block diagonal) and a self-correction f:

- `onsager="mlp"` (`MLPOnsager`): f_θ is a small MLP, trained with the couplings (the post's
  "neural Onsager term");
- `onsager="adaptive_tap"` (`AdaptiveTAPOnsager`): the explicit adaptive-TAP correction of
  Opper and Winther with a Gaussian N(0, I) prior per site (`spinformer.spins.adaptive_tap`):
  cavity variances V_i solved self-consistently, ⟨S_i⟩ = (I − V_i)⁻¹(Σ_j J_ij⟨S_j⟩ − V_i⟨S_i⟩
  + X_i). Cost O((N d)³) per call (the post's "slow and explicit" equations);
- `onsager="none"` (`NaiveOnsager`): naive mean field, ⟨S_i⟩ = Σ_j J_ij⟨S_j⟩ + X_i.

Couplings are either explicit parameters J (`couplings="explicit"`: one d × d block per
ordered pair of sites, initialised N(0, 1/(N d²)) as in the post, optionally symmetric in the
sites and/or the internal dimension), or amortised from the input as in a transformer
(`couplings="softmax"`: J_ij = softmax_j(q_i·k_j/√d) W with a learned d × d block W). The
Onsager terms are objects (registered under `implicit.onsager`); the constructor also takes
their names, as the config does.
With H heads the internal dimension is cut into H blocks: the couplings are block-diagonal.

The fixed point is found by Anderson acceleration (at most 40 steps, tolerance 1e-4 on the
max-norm residual, as in the post's example) and differentiated implicitly (the backward
linear system solved to 1e-4). A solve that fails is reported in the diagnostics (and raises
with `throw=True`) and passes no gradient through its magnetizations. The Onsager MLP's last
layer starts at zero, so training starts from naive mean field, a contraction at the initial
coupling scale. A Hutchinson estimate of ‖∂F/∂m‖_F² at the solution
(`jacobian_penalty > 0`, training only) can be added to the loss to keep the fixed point
stable (Bai, Koltun and Kolter, "Stabilizing Equilibrium Models by Jacobian Regularization",
ICML 2021); the spectral radius of ∂F/∂m at the solution is reported when
`spectral_steps > 0`.
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
from .._schema import (Choice, ConfigError, check_solvers, check_values, choice, option,
                       register_attention, register_choice)
from ._attention_diagnostics import Diagnostics, Stats
from ._heads import check_heads, masked_softmax, qk_scores
from ._literal import check_literal
from ._masks import combine_masks

# The key of the spectral-radius estimate (a diagnostic: the same start vector every call).
_SPECTRAL_KEY = 20211


# -- the options: how the couplings are made, and the self-correction ------------------------

# Where the couplings J_ij come from (`couplings=`, config `model.attention.couplings`):
# `explicit`, learned d × d blocks per ordered pair of sites (a fixed number of sites
# `max_len`), initialised N(0, 1/(N d²)) and symmetrised as `sym_sites`, `sym_internal` say;
# `softmax`, amortised from the input, J_ij = softmax_j(q_i·k_j/√d) W, with learned query/key
# maps and a learned d × d block W per head (kept factored, `FactoredCouplings`).
Couplings = Literal["explicit", "softmax"]


class FactoredCouplings(eqx.Module):
    """Couplings J_ij = A_ij W of one input, kept as their factors: `A (h, n, n)` (zero on
    the diagonal and where the mask forbids a coupling) and `W (h, dh, dh)`. Σ_j J_ij m_j is
    then W (Σ_j A_ij m_j), O(n²·dh + n·dh²) per head instead of the dense tensor's
    O(n²·dh²) products and memory (32× fewer at dh = 32)."""

    A: Float[Array, "h n n"]
    W: Float[Array, "h dh dh"]

    def dense(self) -> Float[Array, "h n n dh dh"]:
        return self.A[:, :, :, None, None] * self.W[:, None, None]

    def apply(self, mh: Float[Array, "n h dh"]) -> Float[Array, "n h dh"]:
        return jnp.einsum("hab,ihb->iha", self.W, jnp.einsum("hij,jhb->ihb", self.A, mh))

    def norms(self) -> Float[Array, "h n n"]:
        """‖J_ij‖_F = |A_ij| ‖W‖_F per head."""
        return jnp.abs(self.A) * jnp.sqrt(jnp.sum(self.W ** 2, axis=(-2, -1)))[:, None, None]


class OnsagerTerm(Choice):
    """The self-correction f(⟨S_i⟩) of the mean-field update (the option `onsager`, kind
    `"implicit.onsager"`): `MLPOnsager` (`"mlp"`), `AdaptiveTAPOnsager` (`"adaptive_tap"`) or
    `NaiveOnsager` (`"none"`)."""

    def network(self, dim: int, hidden: int, *, key: PRNGKeyArray) -> Optional[eqx.nn.MLP]:
        """The learned correction's network (None: nothing is learned)."""
        return None

    def cavity(self, J: "Float[Array, 'h n n dh dh'] | FactoredCouplings"
               ) -> Optional[Float[Array, "h n dh dh"]]:
        """What the correction needs of the couplings `J` (dense `(H, n, n, dh, dh)` or
        factored): the cavity variances `(H, n, dh, dh)`, or None."""
        return None

    def correct(self, m: Float[Array, "n d"], field: Float[Array, "n d"],
                V: Optional[Float[Array, "h n dh dh"]],
                network: Optional[eqx.nn.MLP]) -> Float[Array, "n d"]:
        """The update F(m) from the magnetizations `m`, the mean field `field` = Σ_j J_ij m_j
        + X_i, the cavity variances `V` (from `cavity`, or None) and the learned correction's
        `network` (from `network`, or None); d = H·dh."""
        raise NotImplementedError


@register_choice("implicit.onsager", "mlp")
@dataclasses.dataclass(frozen=True)
class MLPOnsager(OnsagerTerm):
    """f_θ a small MLP (one hidden layer, GELU), trained with the couplings; its last layer
    starts at zero, so training starts from naive mean field."""

    def network(self, dim, hidden, *, key):
        mlp = eqx.nn.MLP(dim, dim, hidden, depth=1, activation=jax.nn.gelu, key=key)
        # the last layer starts at zero: training starts from naive mean field, whose map
        # m -> Jm + X contracts at the initial coupling scale
        last = mlp.layers[-1]
        return eqx.tree_at(lambda t: (t.layers[-1].weight, t.layers[-1].bias), mlp,
                           (jnp.zeros_like(last.weight), jnp.zeros_like(last.bias)))

    def correct(self, m, field, V, network):
        return field - jax.vmap(network)(m)


@register_choice("implicit.onsager", "adaptive_tap")
@dataclasses.dataclass(frozen=True)
class AdaptiveTAPOnsager(OnsagerTerm):
    """The adaptive-TAP correction with a Gaussian N(0, I) prior per site: cavity variances
    V_i (`gaussian_cavity_variances`), ⟨S_i⟩ = (I − V_i)⁻¹(Σ_j J_ij⟨S_j⟩ − V_i⟨S_i⟩
    + X_i)."""

    def cavity(self, J):
        return gaussian_cavity_variances(J)

    def correct(self, m, field, V, network):
        n, H, dh = m.shape[0], V.shape[0], V.shape[-1]
        mh = m.reshape(n, H, dh)
        a = field.reshape(n, H, dh) - jnp.einsum("hiab,ihb->iha", V, mh)
        # ⟨S_i⟩ = (I − V_i)⁻¹ (a_i + X_i) under the N(0, I) prior
        eye = jnp.eye(dh, dtype=m.dtype)
        out = jnp.linalg.solve(eye - V, jnp.swapaxes(a, 0, 1)[..., None])[..., 0]
        return jnp.swapaxes(out, 0, 1).reshape(n, m.shape[1])


@register_choice("implicit.onsager", "none")
@dataclasses.dataclass(frozen=True)
class NaiveOnsager(OnsagerTerm):
    """No correction: naive mean field, ⟨S_i⟩ = Σ_j J_ij⟨S_j⟩ + X_i."""

    def correct(self, m, field, V, network):
        return field


def gaussian_cavity_variances(J: "Float[Array, 'h n n dh dh'] | FactoredCouplings"
                              ) -> Float[Array, "h n dh dh"]:
    """Adaptive-TAP cavity variances V_i of each head (Gaussian prior; they do not depend on
    the fields) of the couplings `J` (dense `(H, n, n, dh, dh)` or factored), from
    `spinformer.spins.adaptive_tap`."""
    from ..spins import adaptive_tap

    if isinstance(J, FactoredCouplings):
        J = J.dense()
    return jax.vmap(lambda Jh: adaptive_tap.gaussian_cavity_variances(Jh))(J)


@dataclasses.dataclass(frozen=True)
class ImplicitConfig:
    """Settings of Deep Implicit Attention: a config's `model.attention: {name: implicit, ...}`."""

    couplings: Couplings = option("explicit", "explicit: learned d×d blocks J_ij per pair of "
                            "sites (needs a fixed number of sites); softmax: J_ij = "
                            "softmax(q·k) W amortised from the input")
    onsager: OnsagerTerm = option(MLPOnsager(), "self-correction f(⟨S_i⟩): mlp (learned), adaptive_tap "
                          "(explicit cavity variances, Gaussian prior) or none (naive mean "
                          "field)", kind="implicit.onsager")
    onsager_hidden: int = option(0, "hidden width of the Onsager MLP (0: 2·d)")
    sym_sites: bool = option(False, "explicit couplings: J_ji = J_ijᵀ (symmetric in sites)")
    sym_internal: bool = option(True, "explicit couplings: J_ij = J_ijᵀ (symmetric in the "
                                "internal dimension)")
    normalize_input: bool = option(True, "fields X = LayerNorm(x)/sqrt(d) (|X_i| ~ 1)")
    output_proj: bool = option(False, "mix the magnetizations with a learned d×d map")
    solver: solvers.AbstractSolver = option(
        solvers.Anderson(tol=1e-4, max_steps=40),
        "the forward solver of the mean-field fixed point", kind="solver")
    adjoint: solvers.AbstractAdjoint = option(
        solvers.Implicit(rtol=1e-4), "how gradients flow through the fixed point", kind="adjoint")
    jacobian_penalty: float = option(0.0, "weight of the Jacobian regulariser "
                                     "‖∂F/∂m‖_F²/(N d) added to the loss (0: off)")
    spectral_steps: int = option(0, "power-iteration steps of the spectral-radius diagnostic "
                                 "(0: not computed)")

    def __post_init__(self):
        check_solvers(self)
        for name in ("onsager_hidden", "jacobian_penalty", "spectral_steps"):
            if not getattr(self, name) >= 0:
                raise ConfigError(f"{name}={getattr(self, name)} must be >= 0.")


# the constructor's defaults are the settings' (one source of defaults)
_DEFAULTS = ImplicitConfig()


def symmetrize_blocks(J: Float[Array, "h n n dh dh"], *, sites: bool, internal: bool
                      ) -> Float[Array, "h n n dh dh"]:
    """Zero the diagonal blocks J_ii and optionally symmetrise: `sites` makes J_ji = J_ijᵀ,
    `internal` makes each block symmetric, J_ij = J_ijᵀ."""
    if sites:
        J = 0.5 * (J + jnp.swapaxes(jnp.swapaxes(J, 1, 2), 3, 4))
    if internal:
        J = 0.5 * (J + jnp.swapaxes(J, 3, 4))
    n = J.shape[1]
    return J * (1.0 - jnp.eye(n, dtype=J.dtype))[None, :, :, None, None]


@register_attention("implicit", config=ImplicitConfig, help="Deep Implicit Attention (DEQ "
                    "mean field)", takes_max_len=True, coupling_fields=("J", "to_q", "to_k"))
class ImplicitAttention(eqx.Module):
    """Deep Implicit Attention, one example per call.

    **Arguments:**

    - `dim`: width d of the spins (= the model width); `num_heads`: H, the couplings are
      block-diagonal in H blocks of width d/H.
    - `causal`: spin i feels only spins j ≤ i.
    - `max_len`: the number of sites N of explicit couplings (inputs may have n ≤ N tokens:
      the first n sites are used).
    - `couplings`: where the couplings come from, a word of `Couplings`: `"explicit"`
      (learned blocks `J (H, max_len, max_len, d/H, d/H)`) or `"softmax"` (J_ij =
      softmax_j(q_i·k_j/√d) W from the input, learned maps `to_q`, `to_k` and blocks
      `W (H, d/H, d/H)`), see the module docstring; kept in the field `couplings_kind`.
    - `onsager`: an `OnsagerTerm` object or its name: `MLPOnsager()` (`"mlp"`),
      `AdaptiveTAPOnsager()` (`"adaptive_tap"`) or `NaiveOnsager()` (`"none"`);
      `onsager_hidden`: the MLP's hidden width (0: 2d).
    - `sym_sites`, `sym_internal`: symmetries of explicit couplings.
    - `normalize_input`: fields X = LayerNorm(x)/√d.
    - `output_proj`: a learned d × d map on the magnetizations.
    - `solver`: the forward solver and `adjoint` (defaults: `ImplicitConfig.solver`,
      `ImplicitConfig.adjoint`); `throw`: raise on a failed solve instead of reporting
      it in the diagnostics.
    - `jacobian_penalty`: weight of the Jacobian regulariser (training calls only, those with
      a `key`); `spectral_steps`: power steps of the spectral-radius diagnostic (0: off).
    - `key`: PRNG key.
    """

    J: Optional[Float[Array, "h n n dh dh"]]
    to_q: Optional[eqx.nn.Linear]
    to_k: Optional[eqx.nn.Linear]
    W: Optional[Float[Array, "h dh dh"]]
    onsager_mlp: Optional[eqx.nn.MLP]
    norm: Optional[eqx.nn.LayerNorm]
    out_proj: Optional[eqx.nn.Linear]
    solver: solvers.AbstractSolver
    adjoint: solvers.AbstractAdjoint
    dim: int = eqx.field(static=True)
    num_heads: int = eqx.field(static=True)
    causal: bool = eqx.field(static=True)
    couplings_kind: Couplings = eqx.field(static=True)
    onsager: OnsagerTerm = eqx.field(static=True)
    sym_sites: bool = eqx.field(static=True)
    sym_internal: bool = eqx.field(static=True)
    throw: bool = eqx.field(static=True)
    jacobian_penalty: float = eqx.field(static=True)
    spectral_steps: int = eqx.field(static=True)

    def __init__(
        self, dim: int, num_heads: int = 1, causal: bool = False, *,
        max_len: int,
        couplings: Couplings = _DEFAULTS.couplings,
        onsager: OnsagerTerm | str = _DEFAULTS.onsager,
        onsager_hidden: int = _DEFAULTS.onsager_hidden,
        sym_sites: bool = _DEFAULTS.sym_sites,
        sym_internal: bool = _DEFAULTS.sym_internal,
        normalize_input: bool = _DEFAULTS.normalize_input,
        output_proj: bool = _DEFAULTS.output_proj,
        solver: solvers.AbstractSolver = _DEFAULTS.solver,
        adjoint: solvers.AbstractAdjoint = _DEFAULTS.adjoint,
        throw: bool = False,
        jacobian_penalty: float = _DEFAULTS.jacobian_penalty,
        spectral_steps: int = _DEFAULTS.spectral_steps,
        key: PRNGKeyArray,
    ):
        check_heads("ImplicitAttention", dim, num_heads)
        couplings = check_literal("ImplicitAttention", "couplings", couplings, Couplings)
        onsager = choice("implicit.onsager", onsager, where="ImplicitAttention: onsager")
        if max_len < 1:
            raise ValueError(f"ImplicitAttention: max_len={max_len} must be >= 1.")
        check_values(ImplicitConfig, "ImplicitAttention", jacobian_penalty=jacobian_penalty,
                     spectral_steps=spectral_steps, onsager_hidden=onsager_hidden)
        H, dh, n = num_heads, dim // num_heads, max_len
        kj, kq, kk, kw, km, ko = jax.random.split(key, 6)
        if couplings == "explicit":
            # variance 1/(N d²) as in the post, so that Σ_j J_ij m_j stays O(|m|)
            self.J = jax.random.normal(kj, (H, n, n, dh, dh)) / math.sqrt(n * dh * dh)
            self.to_q = self.to_k = self.W = None
        else:
            self.J = None
            self.to_q = eqx.nn.Linear(dim, dim, use_bias=False, key=kq)
            self.to_k = eqx.nn.Linear(dim, dim, use_bias=False, key=kk)
            # spectral norm of W about 1/2: the row-stochastic couplings then contract
            self.W = 0.25 * jax.random.normal(kw, (H, dh, dh)) / math.sqrt(dh)
        self.onsager_mlp = onsager.network(dim, onsager_hidden or 2 * dim, key=km)
        self.norm = eqx.nn.LayerNorm(dim) if normalize_input else None
        self.out_proj = eqx.nn.Linear(dim, dim, use_bias=False, key=ko) if output_proj else None
        self.solver = solver
        self.adjoint = adjoint
        self.dim, self.num_heads, self.causal = dim, num_heads, causal
        self.couplings_kind, self.onsager = couplings, onsager
        self.sym_sites, self.sym_internal = sym_sites, sym_internal
        self.throw = throw
        self.jacobian_penalty, self.spectral_steps = float(jacobian_penalty), spectral_steps

    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads

    # -- the spin model --------------------------------------------------------------------

    def coupling_blocks(self, x: Float[Array, "n d"],
                        mask: Optional[Bool[Array, "n n"]] = None) -> Float[Array, "h n n dh dh"]:
        """The coupling tensor J of the spin model for input `x (n, d)`: per head `(n, n)`
        blocks of size `d/H × d/H`, zero on the block diagonal and wherever the (causal)
        mask forbids a coupling. Explicit couplings are symmetrised as configured."""
        n = x.shape[0]
        if self.couplings_kind == "explicit":
            if n > self.J.shape[1]:
                raise ValueError(
                    f"ImplicitAttention: {n} tokens but the explicit couplings have "
                    f"{self.J.shape[1]} sites; build the module with max_len >= {n}.")
            J = symmetrize_blocks(self.J[:, :n, :n], sites=self.sym_sites,
                                  internal=self.sym_internal)
        else:
            J = self._factors(x, mask).dense()
        allowed = combine_masks(n, n, self.causal, mask)
        if allowed is not None:
            J = J * allowed[None, :, :, None, None].astype(J.dtype)
        return J

    def coupling_operator(self, x: Float[Array, "n d"],
                          mask: Optional[Bool[Array, "n n"]] = None):
        """What the mean-field update multiplies the magnetizations by: the dense coupling
        tensor `coupling_blocks(x, mask)` `(H, n, n, d/H, d/H)` of explicit couplings, or the
        factors `FactoredCouplings` of softmax couplings (the same couplings, cheaper)."""
        if self.couplings_kind == "explicit":
            return self.coupling_blocks(x, mask)
        return self._factors(x, mask)

    def _factors(self, x, mask):
        n = x.shape[0]
        A = self._softmax_weights(x, mask) * (1.0 - jnp.eye(n, dtype=x.dtype))
        allowed = combine_masks(n, n, self.causal, mask)
        if allowed is not None:
            A = A * allowed[None].astype(A.dtype)
        return FactoredCouplings(A, self.W)

    def _softmax_weights(self, x, mask):
        scores, allowed = qk_scores("ImplicitAttention", self.to_q, self.to_k, x, None, mask,
                                    num_heads=self.num_heads, causal=self.causal)
        return masked_softmax(scores, allowed)

    def fields(self, x: Float[Array, "n d"]) -> Float[Array, "n d"]:
        """The external fields X: `LayerNorm(x)/√d` (or `x` unnormalised)."""
        if self.norm is None:
            return x
        return jax.vmap(self.norm)(x) / math.sqrt(self.dim)

    def _coupling_term(self, m, J):
        """Σ_j J_ij m_j with head-block-diagonal couplings: `(n, d)`."""
        n, H, dh = m.shape[0], self.num_heads, self.head_dim
        mh = m.reshape(n, H, dh)
        if isinstance(J, FactoredCouplings):
            return J.apply(mh).reshape(n, self.dim)
        return jnp.einsum("hijab,jhb->iha", J, mh).reshape(n, self.dim)

    def update(self, m: Float[Array, "n d"], args) -> Float[Array, "n d"]:
        """One application of the mean-field map F(m) = Σ_j J_ij m_j − f(m_i) + X_i (or its
        adaptive-TAP form); `args = (X, J, V)` with V the cavity variances (adaptive TAP
        only)."""
        X, J, V = args
        return self.onsager.correct(m, self._coupling_term(m, J) + X, V, self.onsager_mlp)

    def cavity_variances(self, J: Float[Array, "h n n dh dh"]) -> Float[Array, "h n dh dh"]:
        """Adaptive-TAP cavity variances V_i of each head (Gaussian prior; they do not depend
        on the fields), `(H, n, d/H, d/H)`: `gaussian_cavity_variances`."""
        return gaussian_cavity_variances(J)

    def spectral_radius(self, x: Float[Array, "n d"], *, steps: int = 50,
                        mask: Optional[Bool[Array, "n n"]] = None) -> Float[Array, ""]:
        """The spectral radius of ∂F/∂m at this input's fixed point (< 1: the fixed point
        attracts plain iteration), by `solvers.spectral_radius` with `steps` Jacobian–vector
        products."""
        J = self.coupling_operator(x, mask)
        X = self.fields(x)
        V = self.onsager.cavity(J)
        m = solvers.fixed_point(self.update, X, (X, J, V), solver=self.solver,
                                adjoint=self.adjoint, throw=self.throw).value
        args = jax.lax.stop_gradient((X, J, V))
        return solvers.spectral_radius(self.update, jax.lax.stop_gradient(m), args,
                                       key=jax.random.key(_SPECTRAL_KEY), steps=steps)

    def __call__(self, x: Float[Array, "n d"], *, context: Optional[Float[Array, "s d"]] = None,
                 mask: Optional[Bool[Array, "n s"]] = None, state=None,
                 key: Optional[PRNGKeyArray] = None, return_diagnostics: bool = False):
        """**Arguments:**

        - `x`: tokens `(n, d)` (the fields, after `normalize_input`).
        - `context`: not supported (a spin model of the tokens themselves); must be None.
        - `mask`: boolean `(n, n)`, True where a coupling is allowed (combined with `causal`).
        - `state`: unused; `key`: enables the Jacobian penalty (training).
        - `return_diagnostics`: also return `Diagnostics` with `magnetizations (n, d)`,
          `fields (n, d)`, `couplings` (the Frobenius norms ‖J_ij‖ per head, `(H, n, n)`),
          `solver` (`Stats` of the solve), `penalty` (the weighted Jacobian penalty; None
          when off, 0 without a key) and `spectral_radius` (of ∂F/∂m at the solution; None unless
          `spectral_steps > 0`).

        **Returns:** `(n, d)` magnetizations (through `out_proj` if present), or
        `(output, diagnostics)`.
        """
        if context is not None:
            raise ValueError("ImplicitAttention: cross-attention (context=) is not supported; "
                             "the spins are the tokens themselves.")
        if x.ndim != 2 or x.shape[-1] != self.dim:
            raise ValueError(f"ImplicitAttention: x must have shape (n, {self.dim}); got "
                             f"{x.shape}. Use jax.vmap(module)(x) for a batch.")
        J = self.coupling_operator(x, mask)
        X = self.fields(x)
        V = self.onsager.cavity(J)
        args = (X, J, V)
        sol = solvers.fixed_point(self.update, X, args, solver=self.solver,
                                  adjoint=self.adjoint, throw=self.throw)
        # a solve that failed passes no gradient through its magnetizations (its adjoint
        # system belongs to a point that is not a fixed point); the diagnostics report it
        ok = sol.result == solvers.RESULTS.successful
        m = jnp.where(ok, sol.value, jax.lax.stop_gradient(sol.value))
        y = jax.vmap(self.out_proj)(m) if self.out_proj is not None else m
        if not return_diagnostics:
            return y
        m_fixed = jax.lax.stop_gradient(m)
        penalty = None
        if self.jacobian_penalty > 0:
            if key is None:  # inference: nothing to regularise
                penalty = jnp.zeros((), m.dtype)
            else:
                jac = solvers.jacobian_penalty(self.update, m_fixed, args, key=key)
                penalty = self.jacobian_penalty * jac / m.size
        rho = None
        if self.spectral_steps > 0:
            rho = solvers.spectral_radius(
                self.update, m_fixed, jax.lax.stop_gradient(args),
                key=jax.random.key(_SPECTRAL_KEY), steps=self.spectral_steps)
        if isinstance(J, FactoredCouplings):
            norms = jax.lax.stop_gradient(J.norms())
        else:
            norms = jnp.sqrt(jnp.sum(jax.lax.stop_gradient(J) ** 2, axis=(-2, -1)))
        diag = Diagnostics(magnetizations=m, fields=X, couplings=norms, state=m,
                           solver=Stats.of(sol), penalty=penalty, spectral_radius=rho)
        return y, diag
