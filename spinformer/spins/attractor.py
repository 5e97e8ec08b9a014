r"""Self-attention as an attractor network of vector spins: local energies and their dynamics.

F. D'Amico, M. Negri, "Self-attention as an attractor network: transient memories without
backpropagation", arXiv:2409.16112. Tokens are unit vectors x_i ∈ S^{d−1} ⊂ R^d, i = 1..N,
coupled by position-dependent d × d blocks 𝕁_ij (an `(N, N, d, d)` tensor, 𝕁_ii = 0, generally
not symmetric). With the overall strength λ (the paper's "inverse temperature", 5 in training
and 1 at test) multiplying every block:

    scores      s_ij = λ x_i · 𝕁_ij x_j                                   (j ≠ i)
    attention   α_{i←j} = softmax_j(s_ij)                                  (eq. 2)
    local energy e_i = −log Σ_{j≠i} exp(s_ij)                              (eq. 4)
    total energy E = Σ_i e_i                                               (eq. 6)
    field       −∂e_i/∂x_i = Σ_{j≠i} α_{i←j} λ 𝕁_ij x_j
    dynamics    x_i ← normalise(−∂e_i/∂x_i + γ x_i),  γ = 1              (eqs. 1, 3)

The update of token i is the gradient of *its own* energy e_i with respect to x_i only
(`field`); it is not the gradient of E, which would add Σ_{k≠i} ∂e_k/∂x_i — the terms by which
the Energy Transformer's layer differs from self-attention. The dynamics is therefore not a
descent on any single energy, and E need not decrease along it.

**What the paper gets wrong or leaves open (checked here):**

- *Normalisation.* The paper applies "a layer normalization that enforces the spherical
  normalization of the spins", but layer normalisation x ↦ (x − mean x)/std x puts x on a
  sphere of radius √d *inside the hyperplane orthogonal to (1, …, 1)*, not on the unit sphere
  the tokens are embedded in (the embedded tokens have a non-zero mean component, which layer
  normalisation deletes). `normalize(x, "sphere")` (x/‖x‖, the default) is what the text
  means; `normalize(x, "layernorm")` is the literal operation, rescaled by 1/√d to unit norm.
- *Training objective.* The paper calls Σ_μ E(ξ^μ) a pseudo-likelihood, but e_i is not the
  negative log of a normalised conditional: there is no partition function over x_i, so the
  loss can be lowered without bound by growing the couplings (hence the paper's fixed norm).
  The conditional exp(−e_i) restricted to the unit sphere *is* normalisable in closed form:
  Σ_j exp(x_i · v_ij) with v_ij = λ 𝕁_ij x_j is a mixture of von Mises–Fisher densities, and
  `∫_{S^{d−1}} exp(x · v) dx = (2π)^{d/2} κ^{1−d/2} I_{d/2−1}(κ)`, `κ = ‖v‖`. So

      −log p(x_i | x_{∖i}) = e_i + log Σ_{j≠i} Z_d(‖λ 𝕁_ij x_j‖)

  (`pseudo_likelihood`), the exact negative log pseudo-likelihood of the spins on the sphere
  (Besag 1975). Scaling the couplings up no longer lowers it by itself: for couplings that
  do not fit the data it grows with λ (a normalised density cannot put mass everywhere). It
  is still not bounded below — couplings that fit a configuration exactly (𝕁_ij ∝ x_i x_jᵀ)
  concentrate each conditional on it and drive it to −∞ like −(d−1)/2 · N · log λ — so a
  norm constraint remains useful, but it no longer has to carry the whole regularisation.
- *Notation.* The paper puts the tokens on "a d-dimensional sphere S^d of unitary radius" in
  R^d; that is S^{d−1} (what `log_sphere_partition` integrates over).
- *Lyapunov function.* E is not one: the dynamics updates every token at once along its own
  e_i, and E rises in about a third of the steps of random systems
  (`notebooks/energy_views.ipynb`).
- eq. 3 and eq. 1 agree (checked with `jax.grad` in the tests); eq. 5's identification
  𝕁 = Σ_k W_k^Q ⊗ W_k^K = W^V is what makes them self-attention.

Everything here handles one configuration `x (N, d)`; vmap over a batch. One step costs
O(N² d²): each receiving token's row (its scores and messages, a batched contraction over the
N source tokens) is computed in a compiled `lax.map` over the tokens, which keeps each row's
couplings and messages in cache, which is faster on CPU than one contraction over all N²
pairs.
"""

from __future__ import annotations

import functools
import math
from typing import Literal

import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float

__all__ = [
    "NORMS",
    "attention_weights",
    "check_couplings",
    "energy",
    "field",
    "local_energies",
    "log_sphere_partition",
    "normalize",
    "pseudo_likelihood",
    "scores",
    "step",
    "trajectory",
    "zero_diagonal",
]

NORMS = ("sphere", "layernorm")
Norm = Literal["sphere", "layernorm"]
Tokens = Float[ArrayLike, "N d"]
Couplings = Float[ArrayLike, "N N d d"]


def check_couplings(name: str, x, J) -> tuple[int, int]:
    """Checks `x (N, d)` and `J (N, N, d, d)` agree; returns (N, d). A `ValueError` otherwise."""
    x_shape, J_shape = tuple(jnp.shape(x)), tuple(jnp.shape(J))
    if len(x_shape) != 2:
        raise ValueError(f"{name}: tokens x must be (N, d) (one configuration; vmap over a "
                         f"batch); got shape {x_shape}.")
    N, d = x_shape
    if J_shape != (N, N, d, d):
        raise ValueError(f"{name}: couplings J must be (N, N, d, d) = {(N, N, d, d)} for "
                         f"tokens of shape {x_shape}; got {J_shape}.")
    if N < 2:
        raise ValueError(f"{name}: need at least 2 tokens (each attends to the others); got "
                         f"N = {N}.")
    return N, d


def zero_diagonal(J: Couplings) -> Float[Array, "N N d d"]:
    """`J` with its diagonal blocks 𝕁_ii set to zero."""
    J = jnp.asarray(J)
    N = J.shape[0]
    return J * (1.0 - jnp.eye(N, dtype=J.dtype))[:, :, None, None]


def _row(x, J, i, lam):
    """Token i's scores s_i· `(N,)` (−inf at j = i) and messages y_ij = 𝕁_ij x_j `(N, d)`."""
    y = jnp.einsum("jab,jb->ja", J[i], x)
    s = lam * (y @ x[i])
    return jnp.where(jnp.arange(x.shape[0]) == i, -jnp.inf, s), y


def _rows(fn, x, J, lam):
    """`fn(s_i, y_i)` for every receiving token i, row by row (`lax.map`): each row reads its
    N·d² couplings once and keeps its N × d messages in cache, which is faster than
    materialising all N² d messages at once (`experiments/bench/attractor.py` measures it)."""
    x, J = jnp.asarray(x), jnp.asarray(J)
    return jax.lax.map(lambda i: fn(*_row(x, J, i, lam)), jnp.arange(x.shape[0]))


def scores(x: Tokens, J: Couplings, *, lam: float = 1.0) -> Float[Array, "N N"]:
    """s_ij = λ x_i · 𝕁_ij x_j, with −inf on the diagonal (a token does not attend to itself).

    **Arguments:** `x (N, d)` tokens, `J (N, N, d, d)` couplings, `lam` the strength λ.
    **Returns:** `(N, N)`."""
    check_couplings("scores", x, J)
    return _rows(lambda s, y: s, x, J, lam)


def attention_weights(x: Tokens, J: Couplings, *, lam: float = 1.0) -> Float[Array, "N N"]:
    """α_{i←j} = softmax_j(λ x_i · 𝕁_ij x_j) over j ≠ i (eq. 2); rows sum to one, zero
    diagonal. **Returns:** `(N, N)`."""
    return jax.nn.softmax(scores(x, J, lam=lam), axis=-1)


def local_energies(x: Tokens, J: Couplings, *, lam: float = 1.0) -> Float[Array, " N"]:
    """e_i = −log Σ_{j≠i} exp(λ x_i · 𝕁_ij x_j) (eq. 4). **Returns:** `(N,)`."""
    check_couplings("local_energies", x, J)
    return _rows(lambda s, y: -jax.nn.logsumexp(s), x, J, lam)


def energy(x: Tokens, J: Couplings, *, lam: float = 1.0) -> Float[Array, ""]:
    """E = Σ_i e_i (eq. 6), the paper's training loss for one configuration."""
    return jnp.sum(local_energies(x, J, lam=lam))


def field(x: Tokens, J: Couplings, *, lam: float = 1.0) -> Float[Array, "N d"]:
    """The self-attention output Σ_{j≠i} α_{i←j} λ 𝕁_ij x_j = −∂e_i/∂x_i (eqs. 1 and 3,
    without the γ x_i term). **Returns:** `(N, d)`."""
    check_couplings("field", x, J)
    return _rows(lambda s, y: lam * (jax.nn.softmax(s) @ y), x, J, lam)


def normalize(x: Float[ArrayLike, "... d"], kind: Norm = "sphere", *,
              eps: float = 1e-6) -> Float[Array, "... d"]:
    """Puts each token back on the unit sphere after an update.

    - `"sphere"`: x / ‖x‖ (what the paper's text asks for: "spherical normalization").
    - `"layernorm"`: the paper's literal layer normalisation without gain or bias,
      (x − mean x) / (√d · std x): unit norm, but the mean component is removed, so the tokens
      leave the embedding's subspace (see the module docstring).
    """
    x = jnp.asarray(x)
    if kind == "sphere":
        return x / jnp.sqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps * eps)
    if kind == "layernorm":
        c = x - jnp.mean(x, axis=-1, keepdims=True)
        return c / jnp.sqrt(jnp.sum(c * c, axis=-1, keepdims=True) + eps * eps)
    raise ValueError(f"normalize: kind must be one of {NORMS}; got {kind!r}.")


def step(x: Tokens, J: Couplings, *, lam: float = 1.0, gamma: float = 1.0,
         norm: Norm = "sphere") -> Float[Array, "N d"]:
    """One step of the dynamics: x_i ← normalise(Σ_j α_{i←j} λ 𝕁_ij x_j + γ x_i) (eq. 1)."""
    if norm not in NORMS:
        raise ValueError(f"step: norm must be one of {NORMS}; got {norm!r}.")
    x = jnp.asarray(x)
    return normalize(field(x, J, lam=lam) + gamma * x, norm)


def trajectory(x0: Tokens, J: Couplings, steps: int, *, lam: float = 1.0, gamma: float = 1.0,
               norm: Norm = "sphere") -> Float[Array, "T N d"]:
    """Runs `steps` steps of the dynamics from `x0` with `jax.lax.scan`.

    **Returns:** `(steps + 1, N, d)`: `x0` first, then the state after each step (`x0` is
    returned as given: normalise it first if it is not on the sphere)."""
    check_couplings("trajectory", x0, J)
    if int(steps) < 0:
        raise ValueError(f"trajectory: steps must be >= 0; got {steps}.")
    x0, J = jnp.asarray(x0), jnp.asarray(J)

    def body(x, _):
        x = step(x, J, lam=lam, gamma=gamma, norm=norm)
        return x, x

    _, xs = jax.lax.scan(body, x0, None, length=int(steps))
    return jnp.concatenate([x0[None], xs], axis=0)


# --- the normalised conditional on the sphere ------------------------------------------------

_SERIES_TERMS = 32  # enough for √(ν² + κ²) < _DEBYE_FROM (terms peak at k ≈ κ/2 < 8)
_DEBYE_FROM = 15.0


def _horner(q, nu):
    """S(q) = Σ_k q^k / (k! (ν+1)_k) and S'(q), both by Horner's rule (one fused loop)."""
    acc, dacc = jnp.ones_like(q), jnp.zeros_like(q)
    for k in range(_SERIES_TERMS, 0, -1):
        c = 1.0 / (k * (k + nu))
        acc, dacc = 1.0 + q * c * acc, c * acc + q * c * dacc
    return acc, dacc


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def _log_series(q, nu):
    """log S(q); its derivative S'/S comes from the same Horner pass (a custom JVP: autodiff
    through the unrolled loop would store every partial sum)."""
    return jnp.log(_horner(q, nu)[0])


@_log_series.defjvp
def _log_series_jvp(nu, primals, tangents):
    (q,), (dq,) = primals, tangents
    S, dS = _horner(q, nu)
    return jnp.log(S), (dS / S) * dq


def log_sphere_partition(kappa: Float[ArrayLike, "..."], d: int) -> Float[Array, "..."]:
    """`log ∫_{S^{d−1}} exp(κ μ·x) dx = log[(2π)^{d/2} κ^{1−d/2} I_{d/2−1}(κ)]` over the unit
    sphere in R^d (surface measure; μ any unit vector): the von Mises–Fisher normaliser.

    Finite and differentiable for every κ ≥ 0 (κ → 0 gives the sphere's area
    2π^{d/2}/Γ(d/2)): a power series in κ² where √(ν² + κ²) < 15 (ν = d/2 − 1) and the Debye
    (uniform large-order) expansion of log I_ν with three correction terms beyond, which is
    uniform in ν and needs no division by ν. Within 2e-7 of `scipy.special.ive` in float64
    (tested for d = 2..64, κ = 0..1000); its derivative, the Bessel ratio I_{ν+1}(κ)/I_ν(κ),
    to 1e-6 (the series' derivative comes from the same Horner pass, a custom JVP).
    """
    if int(d) < 2:
        raise ValueError(f"log_sphere_partition: need d >= 2; got d = {d}.")
    d = int(d)
    nu = d / 2.0 - 1.0
    kappa = jnp.asarray(kappa)
    kappa = kappa.astype(jnp.result_type(kappa, jnp.float32))
    const = 0.5 * d * math.log(2.0 * math.pi)
    R = jnp.sqrt(nu * nu + kappa * kappa)
    debye = R >= _DEBYE_FROM

    # series: Z = (2π)^{d/2} 2^{−ν} / Γ(ν+1) · Σ_k q^k / (k! (ν+1)_k),  q = κ²/4, summed by
    # Horner's rule (one fused elementwise loop, no (…, K) intermediate); q < 57 here, where
    # 32 terms leave a relative remainder below 1e-9.
    ks = jnp.where(debye, 0.0, kappa)
    series = (const - nu * math.log(2.0) - math.lgamma(nu + 1.0)
              + _log_series(ks * ks / 4.0, nu))

    # Debye: log I_ν(κ) ≈ −½log 2π − ½log R + R + ν log(κ/(ν+R)) + Σ u_k(t)/ν^k, t = ν/R,
    # with u_k(t)/ν^k written in t and R only.
    kd = jnp.where(debye, kappa, _DEBYE_FROM)
    Rd = jnp.sqrt(nu * nu + kd * kd)
    t = nu / Rd
    t2 = t * t
    c1 = (3.0 - 5.0 * t2) / (24.0 * Rd)
    c2 = (81.0 - 462.0 * t2 + 385.0 * t2 * t2) / (1152.0 * Rd * Rd)
    c3 = (30375.0 - 369603.0 * t2 + 765765.0 * t2 * t2 - 425425.0 * t2 ** 3) / (
        414720.0 * Rd ** 3)
    # log Z = const − ν log κ + log I_ν(κ); the κ-dependence of −ν log κ + ν log(κ/(ν+R))
    # cancels exactly, leaving −ν log(ν + R): finite at κ = 0 for large ν too.
    big = (const - nu * jnp.log(nu + Rd) - 0.5 * math.log(2.0 * math.pi) - 0.5 * jnp.log(Rd)
           + Rd + jnp.log1p(c1 + c2 + c3))
    return jnp.where(debye, big, series)


def pseudo_likelihood(x: Tokens, J: Couplings, *, lam: float = 1.0) -> Float[Array, " N"]:
    """The exact negative log conditionals on the unit sphere,
    −log p(x_i | x_{∖i}) = e_i + log Σ_{j≠i} Z_d(‖λ 𝕁_ij x_j‖), with
    p(x_i | x_{∖i}) ∝ exp(−e_i(x_i)) = Σ_{j≠i} exp(λ x_i · 𝕁_ij x_j) normalised over
    x_i ∈ S^{d−1} (a mixture of von Mises–Fisher densities; `log_sphere_partition`).

    Their sum is the negative log pseudo-likelihood (Besag 1975) that the paper's energy
    stands in for. **Returns:** `(N,)`."""
    N, d = check_couplings("pseudo_likelihood", x, J)

    def row(s, y):
        return jax.nn.logsumexp(s), lam * jnp.sqrt(jnp.sum(y * y, axis=-1) + 1e-30)

    lse_s, kappa = _rows(row, x, J, lam)  # (N,), (N, N)
    # the normalisers outside the row loop: one vectorised pass over all N² pairs
    logz = jnp.where(jnp.eye(N, dtype=bool), -jnp.inf, log_sphere_partition(kappa, d))
    return jax.nn.logsumexp(logz, axis=-1) - lse_s

