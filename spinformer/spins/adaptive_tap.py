r"""Adaptive TAP mean-field theory for vector spins with explicit couplings.

The model: N sites, each with a spin S_i ∈ ℝ^d, couplings J_ij (d × d blocks, J_ii = 0) and
fields X_i, with the Boltzmann distribution

    p(S) ∝ Π_i ρ(S_i) · exp( ½ Σ_{i≠j} S_iᵀ J_ij S_j + Σ_i X_i·S_i ),   J_ji = J_ijᵀ,

i.e. the (N d) × (N d) block matrix 𝐉 = [J_ij] (see `block_matrix`) is symmetric with a
zero block diagonal. For d = 1 and the binary prior this is `spins.ising` at β = 1
(energy −(h·s + ½ sᵀJs), h = X). The single-site prior ρ is

- `"gaussian"`: N(0, I_d). The model is then a Gaussian with precision I − 𝐉: exact means
  (I − 𝐉)⁻¹ X and covariances (I − 𝐉)⁻¹, which exist iff I − 𝐉 is positive definite;
- `"binary"`: uniform on {−1, +1}^d (every component ±1). For d = 1 this is the Ising spin;
  for d > 1 a site is a cluster of d Ising spins without internal couplings, and the
  single-site sums below run over its 2^d states exactly (so any d × d V is handled, not
  only a diagonal one; d ≤ `MAX_BINARY_DIM`). The whole model is the Ising model of N d
  spins with couplings 𝐉.

Adaptive TAP (M. Opper and O. Winther, "Tractable approximations for probabilistic models:
The adaptive Thouless-Anderson-Palmer mean field approach", Phys. Rev. Lett. 86, 3695
(2001), https://doi.org/10.1103/PhysRevLett.86.3695; "Adaptive and self-averaging
Thouless-Anderson-Palmer mean-field theory for probabilistic modeling", Phys. Rev. E 64,
056131 (2001), https://doi.org/10.1103/PhysRevE.64.056131; in the vector form of M. Bal, "Deep
Implicit Attention: A Mean-Field Theory Perspective on Attention Mechanisms" (2021),
https://mcbal.github.io/post/deep-implicit-attention-a-mean-field-theory-perspective-on-attention-mechanisms/,
"Slow and explicit"). The cavity field h_i = Σ_j J_ij S_j, taken Gaussian with mean a_i and
covariance V_i in the system with site i removed, gives the marginal
p(S_i) ∝ ρ(S_i) E[exp(S_i·h_i)] = ρ(S_i) exp(S_i·(a_i + X_i) + ½ S_iᵀ V_i S_i), so

    Z_i(u, V_i) = ∫ dρ(S) exp(S·u + ½ Sᵀ V_i S),   u = a_i + X_i,
    ⟨S_i⟩ = ∂ log Z_i/∂u,   χ_i := Cov(S_i) = ∂² log Z_i/∂u²          (`site_moments`)

  gaussian: ⟨S_i⟩ = (I − V_i)⁻¹ u, χ_i = (I − V_i)⁻¹ (needs I − V_i positive definite);
  binary, d = 1: ⟨S_i⟩ = tanh u, χ_i = 1 − ⟨S_i⟩² (the ½ V S² term is the constant V/2).

Reaction: given S_i, the cavity field is tilted to mean a_i + V_i S_i, so the full mean field
is Σ_j J_ij⟨S_j⟩ = a_i + V_i⟨S_i⟩, the cavity mean (`cavity_means`) is

    a_i = Σ_j J_ij ⟨S_j⟩ − V_i ⟨S_i⟩                                 (Onsager term −V_i⟨S_i⟩).

Cavity variances from linear response (V held fixed): differentiating ⟨S_i⟩ = f_i(a_i + X_i)
with respect to X_j gives ∂⟨S_i⟩/∂X_j = χ_i (δ_ij + Σ_k (J_ik − V_i δ_ik) ∂⟨S_k⟩/∂X_j), i.e.

    𝛘 = (𝚲 − 𝐉)⁻¹,   𝚲 = blockdiag(Λ_i),   Λ_i = V_i + χ_i⁻¹          (`susceptibility`),

and adaptive TAP asks the two estimates of the diagonal blocks to agree, `[𝛘]_ii = χ_i`. With
𝚲 evaluated at the current V this is the Opper–Winther update (`cavity_update`)

    V_i ← Λ_i − [𝛘]_ii⁻¹ = [𝛘]_ii⁻¹ [𝛘 𝐉]_ii,

the right-hand form following from 𝛘(𝚲 − 𝐉) = I; it avoids the cancellation of two large
terms when χ_i → 0 (saturated spins), and is computed as 𝛘 = (I + 𝛘_loc(V − 𝐉))⁻¹ 𝛘_loc
without ever inverting χ_i. By the Schur complement,
`[𝛘]_ii⁻¹ = Λ_i − 𝐉_{i,∖i} [(𝚲 − 𝐉)_{∖i∖i}]⁻¹ 𝐉_{∖i,i}`, so the update is
`V_i ← 𝐉_{i,∖i} [(𝚲 − 𝐉)_{∖i∖i}]⁻¹ 𝐉_{∖i,i}`: the covariance of the cavity field in the
linear-response system with site i removed, as it should be.

Exact for Gaussian models: with the Gaussian prior Λ_i = V_i + (I − V_i) = I whatever V is,
so 𝛘 = (I − 𝐉)⁻¹ exactly, one update gives V_i = I − [(I − 𝐉)⁻¹]_ii⁻¹
(`gaussian_cavity_variances`), χ_i = (I − V_i)⁻¹ = [(I − 𝐉)⁻¹]_ii (the exact marginal
covariance), and at any fixed point (I − V_i)⟨S_i⟩ = Σ_j J_ij⟨S_j⟩ − V_i⟨S_i⟩ + X_i gives
⟨S⟩ = 𝐉⟨S⟩ + X, the exact means. (So the Gaussian means do not depend on V at all: naive mean
field, V = 0, already has them; V fixes the covariances and changes how the iteration
converges, not where.)

Iteration: `adaptive_tap` solves the joint fixed point of (m, V) ↦ (f(a + X; V), update(V))
with `solvers.fixed_point` (Anderson by default). At fixed m (binary prior, where χ_i does not
depend on V for d = 1) the V-map has Jacobian `∂V_i'/∂V_k = δ_ik − [𝛘]_ik²/[𝛘]_ii²` (scalar
case): its diagonal vanishes, so it converges like a Jacobi iteration whose rate is the size of
the off-diagonal susceptibilities, O(β²) for SK couplings of strength β; for the Gaussian
prior it converges in one step. The m-map has Jacobian χ_i(J_ik − V_i δ_ik).

Validity: a covariance is positive semi-definite, so at the solution 𝚲 − 𝐉 (its symmetric
part) must be positive definite, and for the Gaussian prior also I − V_i; this is checked
after every successful solve (a failed check is reported as `RESULTS.nonfinite` with NaN
values, or raised with `throw=True`). For the Gaussian prior it fails exactly when I − 𝐉 is not positive
definite, i.e. when the Boltzmann distribution does not exist.

Couplings that are not symmetric (J_ji ≠ J_ijᵀ, e.g. the post's `weight_sym_sites=False`)
define no Boltzmann distribution (exp(½ Sᵀ𝐉S) sees only (𝐉 + 𝐉ᵀ)/2; pass
`symmetrize_couplings(J)` for that one). The functions then solve the same equations with 𝐉
as given — the post's implicit-attention layer: for the Gaussian prior the means are
(I − 𝐉)⁻¹X and χ_i the diagonal blocks of the response (I − 𝐉)⁻¹ (not symmetric in general).

Cost: each evaluation of the adaptive map solves one (N d) × (N d) linear system, O((N d)³)
time and O((N d)²) memory, plus O(N d³) (gaussian) or O(N 2^d d²) (binary) for the sites;
`tap` and `naive_mean_field` cost O(N² d³) and O(N² d²) per evaluation.

What the source (Bal 2021) gets wrong or leaves ambiguous:

- Sign and normalization: its energy E = Σ_{i,j} S_iᵀJ_ijS_j + Σ_i X_i·S_i (with
  p ∝ e^{−E}) gives the cavity field −Σ_j J_ij⟨S_j⟩ − X_i and counts each pair twice; the
  update equations ⟨S_i⟩ = tanh(Σ_j J_ij⟨S_j⟩ − V_i⟨S_i⟩ + x_i) belong to
  E = −½ Σ_{i≠j} S_iᵀJ_ijS_j − Σ_i X_i·S_i, the convention used here.
- Λ_i = V_i + Σ⁻¹ in "Generalizing the cavity variance calculation", with Σ the prior
  covariance, is wrong: Λ_i = V_i + χ_i⁻¹ with the local covariance χ_i = (Σ⁻¹ − V_i)⁻¹, so
  Λ_i = Σ⁻¹ (independent of V). Read literally (Λ_i = V_i + I for Σ = I), the iteration
  converges to cavity variances with [(I + 𝐕 − 𝐉)⁻¹]_ii = I, which are not the exact ones
  (the marginal variances come out too low; experiments/results/implicit/findings.md). The
  linear system printed next to it, (δ_ik − Σ_i J_ik + Σ_i V_i δ_ik) χ_kj = Σ_i δ_ij, is right
  only if Σ_i means that local covariance.
- χ_ij = ∂² log Z_0^{(i)}/∂x_i∂x_j: the single-site Z_0^{(i)} depends on x_i only; the
  off-diagonal susceptibilities are derivatives of the full log Z (or, here, of the means).
- The binary Z_0^{(i)} = cosh(a_i + x_i) drops the factor e^{V_i/2} (harmless: it does not
  depend on x_i).
- "χ_ii V_i = χ_ii Λ_i − 1" is correct only with χ_ii the linear-response block [𝛘]_ii (not
  the local covariance, which is the same symbol a few lines earlier) and Λ at the current V.
- The cavity and spin variances are listed as "system properties" without a batch dimension,
  "identical across all examples": true for the Gaussian prior (V depends on 𝐉 only), false
  for the binary prior, where χ_i = 1 − ⟨S_i⟩² and therefore V depend on the fields.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Float

from .. import solvers
from ._common import DEFAULT_ADJOINT, HIGHEST, as_float

__all__ = [
    "MAX_BINARY_DIM",
    "PRIORS",
    "TAPState",
    "adaptive_tap",
    "adaptive_tap_update",
    "block_matrix",
    "cavity_means",
    "cavity_update",
    "cavity_variances",
    "covariances",
    "gaussian_cavity_variances",
    "naive_mean_field",
    "site_log_partition",
    "site_moments",
    "susceptibility",
    "symmetrize_couplings",
    "tap",
]

PRIORS = ("gaussian", "binary")
MAX_BINARY_DIM = 12  # the binary single-site sums run over 2^d states

Couplings = Float[ArrayLike, "N N d d"]
Fields = Float[ArrayLike, "N d"]


class TAPState(NamedTuple):
    """The fixed-point variables of the mean-field equations (a pytree).

    - `m`: spin means ⟨S_i⟩, `(N, d)`.
    - `V`: cavity variances V_i, `(N, d, d)` (zero for naive mean field).
    """

    m: Float[Array, "N d"]
    V: Float[Array, "N d d"]


# ----------------------------------------------------------------------------- checks


def _concrete(x):
    """`x` as a numpy array, or None when it is traced (values unknown at trace time)."""
    try:
        return np.asarray(x)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None


def _check_prior(name, prior, d=None):
    if prior not in PRIORS:
        raise ValueError(f"{name}: prior={prior!r} is not supported; use one of {PRIORS} "
                         "(N(0, I) per site, or every component ±1).")
    if prior == "binary" and d is not None and d > MAX_BINARY_DIM:
        raise ValueError(
            f"{name}: the binary prior sums over the 2^d states of a site; d = {d} exceeds "
            f"MAX_BINARY_DIM = {MAX_BINARY_DIM}. Use the gaussian prior or smaller sites.")


def _check_J(name, J, N=None, d=None):
    """Shape (N, N, d, d) and a zero block diagonal: a ValueError now when J is concrete, a
    run-time error (`eqx.error_if`) when it is traced. Returns (J, N, d)."""
    shape = jnp.shape(J)
    ok = len(shape) == 4 and shape[0] == shape[1] and shape[2] == shape[3]
    if ok and N is not None:
        ok = shape[:2] == (N, N) and shape[2] == d
    if not ok:
        want = "(N, N, d, d)" if N is None else f"(N, N, d, d) = ({N}, {N}, {d}, {d})"
        raise ValueError(
            f"{name}: J must have shape {want}: one d × d coupling block J[i, j] per pair of "
            f"sites; got {shape}. Pass one system per call and vmap over a batch.")
    N, d = shape[1], shape[2]
    idx = np.arange(N)
    Jc = _concrete(J)
    if Jc is not None:
        worst = float(np.max(np.abs(Jc[idx, idx]))) if N else 0.0
        if worst != 0.0:
            raise ValueError(
                f"{name}: the diagonal blocks J[i, i] must be zero (no self-coupling; a "
                f"site's own quadratic term belongs in its prior), got max |J[i, i]| = "
                f"{worst:.3g}. Use symmetrize_couplings(J), which zeroes them.")
        return J, N, d
    J = eqx.error_if(J, jnp.any(J[idx, idx] != 0),
                     f"{name}: the diagonal blocks J[i, i] must be zero (no self-coupling), "
                     "found a nonzero or NaN entry; use symmetrize_couplings(J), which zeroes "
                     "them.")
    return J, N, d


def _check_system(name, X, J, prior):
    if jnp.ndim(X) != 2:
        raise ValueError(
            f"{name}: X must have shape (N, d) (fields on N sites of dimension d), got "
            f"{jnp.shape(X)}. Pass one system per call and vmap over a batch.")
    N, d = jnp.shape(X)
    _check_prior(name, prior, d)
    J, _, _ = _check_J(name, J, N, d)
    return J, N, d


def _check_state(name, state, N, d):
    if not (isinstance(state, tuple) and len(state) == 2):
        raise ValueError(f"{name}: state must be a TAPState(m, V) (or a pair (m, V)); got "
                         f"{type(state).__name__}.")
    m, V = state
    if jnp.shape(m) != (N, d) or jnp.shape(V) != (N, d, d):
        raise ValueError(f"{name}: state has m {jnp.shape(m)} and V {jnp.shape(V)}; the system "
                         f"needs m ({N}, {d}) and V ({N}, {d}, {d}).")


# ----------------------------------------------------------------------------- block algebra


def block_matrix(J: Float[ArrayLike, "... N N d d"]) -> Float[Array, "... Nd Nd"]:
    """The (N d) × (N d) matrix 𝐉 with 𝐉[i·d + α, j·d + β] = J[i, j, α, β] (trailing axes).

    In this form the exponent of the Boltzmann weight is ½ Sᵀ𝐉S + X·S with S = the (N d,)
    flattening of the spins, so e.g. the Gaussian model has covariance (I − 𝐉)⁻¹.
    """
    J = jnp.asarray(J)
    *lead, N, _, d, _ = J.shape
    return jnp.swapaxes(J, -3, -2).reshape(*lead, N * d, N * d)


def _unblock(A, N, d):
    """Inverse of `block_matrix` for one (N d, N d) matrix."""
    return jnp.swapaxes(A.reshape(N, d, N, d), 1, 2)


def _diag_blocks(A4):
    N = A4.shape[0]
    idx = jnp.arange(N)
    return A4[idx, idx]


def _sym(A):
    return 0.5 * (A + jnp.swapaxes(A, -1, -2))


def _einsum(spec, *ops):
    return jnp.einsum(spec, *ops, precision=HIGHEST)


def symmetrize_couplings(
    J: Float[ArrayLike, "... N N d d"], *, sites: bool = True, internal: bool = True
) -> Float[Array, "... N N d d"]:
    """Project couplings onto the allowed set: zero block diagonal and, optionally, symmetric.

    - always: J_ii = 0 (no self-coupling);
    - `sites`: J_ij ← ½(J_ij + J_jiᵀ), so J_ji = J_ijᵀ and 𝐉 (`block_matrix`) is symmetric —
      what the Boltzmann distribution needs;
    - `internal`: J_ij ← ½(J_ij + J_ijᵀ), every block symmetric.

    With both, J_ij = J_ji = J_ijᵀ: N(N−1)/2 · d(d+1)/2 free parameters (Bal 2021). Each
    option is an orthogonal projection (idempotent and self-adjoint), and the two commute.

    **Arguments:** `J` of shape `(..., N, N, d, d)`; `sites`, `internal` as above.

    **Returns:** the projected couplings, same shape.
    """
    J = jnp.asarray(J)
    if J.ndim < 4 or J.shape[-4] != J.shape[-3] or J.shape[-2] != J.shape[-1]:
        raise ValueError(f"symmetrize_couplings: J must have shape (..., N, N, d, d), got "
                         f"{J.shape}.")
    (J,) = as_float(J)
    N = J.shape[-3]
    if sites:
        J = 0.5 * (J + jnp.swapaxes(jnp.swapaxes(J, -4, -3), -2, -1))
    if internal:
        J = 0.5 * (J + jnp.swapaxes(J, -2, -1))
    off = jnp.asarray(1.0 - np.eye(N), J.dtype)[:, :, None, None]
    return J * off


def cavity_means(
    m: Float[ArrayLike, "N d"], V: Float[ArrayLike, "N d d"], J: Couplings
) -> Float[Array, "N d"]:
    """a_i = Σ_j J_ij m_j − V_i m_i: the mean of the cavity field, the full mean field minus
    the Onsager reaction term. Shapes: `m (N, d)`, `V (N, d, d)`, `J (N, N, d, d)`."""
    return _einsum("ijab,jb->ia", J, m) - _einsum("iab,ib->ia", V, m)


# ----------------------------------------------------------------------------- single site


def _binary_states(d, dtype):
    idx = np.arange(2**d)[:, None]
    return jnp.asarray(1 - 2 * ((idx >> np.arange(d)[None, :]) & 1), dtype)


def _binary_logits(u, V):
    S = _binary_states(u.shape[0], u.dtype)  # (2^d, d)
    return S, S @ u + 0.5 * jnp.sum((S @ jnp.swapaxes(V, 0, 1)) * S, axis=1)


def _site_check(name, u, V):
    if jnp.ndim(u) != 1 or jnp.shape(V) != (jnp.shape(u)[0],) * 2:
        raise ValueError(f"{name}: u must have shape (d,) and V shape (d, d); got "
                         f"{jnp.shape(u)} and {jnp.shape(V)}. vmap over sites.")


def site_log_partition(
    u: Float[ArrayLike, " d"], V: Float[ArrayLike, "d d"], *, prior: str = "gaussian"
) -> Float[Array, ""]:
    """log Z(u, V) = log ∫ dρ(S) exp(S·u + ½ SᵀVS) for one site (ρ normalized).

    - gaussian: ½ uᵀ(I − V)⁻¹u − ½ log det(I − V), with V symmetrized (only its symmetric part
      enters); NaN unless I − V is positive definite (the integral diverges).
    - binary: log 2^{−d} Σ_{S ∈ {±1}^d} exp(S·u + ½ SᵀVS) (for d = 1: log cosh u + V/2).

    Its gradient and Hessian in u are the mean and covariance of `site_moments` (for symmetric
    V). **Arguments:** `u` `(d,)` (the cavity mean plus the field), `V` `(d, d)`, `prior`.
    **Returns:** a scalar.
    """
    _site_check("site_log_partition", u, V)
    d = jnp.shape(u)[0]
    _check_prior("site_log_partition", prior, d)
    u, V = as_float(u, V)
    if prior == "gaussian":
        A = jnp.eye(d, dtype=u.dtype) - _sym(V)
        L = jnp.linalg.cholesky(A)  # NaN when A is not positive definite
        w = jax.scipy.linalg.solve_triangular(L, u, lower=True)
        return 0.5 * jnp.sum(w * w) - jnp.sum(jnp.log(jnp.diag(L)))
    _, logits = _binary_logits(u, V)
    return jax.nn.logsumexp(logits) - d * jnp.log(2.0).astype(u.dtype)


def site_moments(
    u: Float[ArrayLike, " d"], V: Float[ArrayLike, "d d"], *, prior: str = "gaussian"
) -> tuple[Float[Array, " d"], Float[Array, "d d"]]:
    """Mean and covariance of one site under ρ(S) exp(S·u + ½ SᵀVS).

    - gaussian: ((I − V)⁻¹u, (I − V)⁻¹) (Bal 2021 with Σ = I); a distribution only when I − V
      is positive definite (not checked here: `adaptive_tap` checks its solution). For a
      non-symmetric V these are the response formulas (mean and ∂mean/∂u), see the module
      docstring.
    - binary: d = 1: (tanh u, 1 − tanh²u), the latter computed without cancellation;
      d > 1: exact sums over the 2^d states.

    **Arguments:** `u` `(d,)`, `V` `(d, d)`, `prior`. **Returns:** `(mean (d,), cov (d, d))`.
    """
    _site_check("site_moments", u, V)
    d = jnp.shape(u)[0]
    _check_prior("site_moments", prior, d)
    u, V = as_float(u, V)
    return _site(u, V, prior)


def _site(u, V, prior):
    d = u.shape[0]
    if prior == "gaussian":
        A = jnp.eye(d, dtype=u.dtype) - V
        C = jnp.linalg.inv(A)
        return _einsum("ab,b->a", C, u), C
    if d == 1:
        t = jnp.exp(-2.0 * jnp.abs(u))
        return jnp.tanh(u), (4.0 * t / (1.0 + t) ** 2)[:, None]  # sech²u
    S, logits = _binary_logits(u, V)
    p = jax.nn.softmax(logits)
    mean = p @ S
    D = S - mean
    return mean, (D * p[:, None]).T @ D


def _sites(u, V, prior):
    return jax.vmap(lambda a, b: _site(a, b, prior))(u, V)


# ----------------------------------------------------------------------------- cavity variances


def _floor(C):
    """Local covariances with a tiny ridge, so that a saturated binary spin (χ_i underflowed to
    0) keeps [𝛘]_ii invertible; far below any covariance that float arithmetic resolves."""
    tiny = jnp.finfo(C.dtype).tiny ** 0.75
    return C + tiny * jnp.eye(C.shape[-1], dtype=C.dtype)


def _linear_response(V, C, J):
    """𝛘 = (𝚲 − 𝐉)⁻¹ with Λ_i = V_i + C_i⁻¹, as (I + C(V − 𝐉))⁻¹ C (C never inverted);
    returns the blocks (N, N, d, d)."""
    N, d = V.shape[:2]
    eye_N = jnp.eye(N, dtype=V.dtype)
    K = eye_N[:, :, None, None] * V[:, None] - J  # V_i δ_ij − J_ij
    CK = _einsum("iab,ijbc->ijac", C, K)
    M = jnp.eye(N * d, dtype=V.dtype) + block_matrix(CK)
    Cb = block_matrix(eye_N[:, :, None, None] * C[:, None])
    return _unblock(jnp.linalg.solve(M, Cb), N, d)


def _cavity_update(V, C, J):
    G = _linear_response(V, _floor(C), J)
    G_ii = _diag_blocks(G)
    GJ_ii = _einsum("ikab,kibc->iac", G, J)
    return jnp.linalg.solve(G_ii, GJ_ii)


def cavity_update(
    V: Float[ArrayLike, "N d d"], C: Float[ArrayLike, "N d d"], J: Couplings
) -> Float[Array, "N d d"]:
    """One Opper–Winther update of the cavity variances at fixed local covariances.

    `V_i ← Λ_i − [𝛘]_ii⁻¹ = [𝛘]_ii⁻¹ [𝛘𝐉]_ii` with `𝛘 = (𝚲 − 𝐉)⁻¹`, `Λ_i = V_i + C_i⁻¹` (the
    post's "χ_ii V_i = χ_ii Λ_i − 1" with `χ_ii = [𝛘]_ii`); its fixed points satisfy
    `[𝛘]_ii = C_i`. Cost O((N d)³).

    **Arguments:** `V` current cavity variances `(N, d, d)`; `C` local covariances χ_i
    `(N, d, d)` (e.g. from `site_moments`); `J` couplings `(N, N, d, d)`.

    **Returns:** the updated V, `(N, d, d)`.
    """
    J, N, d = _check_J("cavity_update", J)
    for nm, a in (("V", V), ("C", C)):
        if jnp.shape(a) != (N, d, d):
            raise ValueError(f"cavity_update: {nm} must have shape (N, d, d) = ({N}, {d}, {d}),"
                             f" got {jnp.shape(a)}.")
    V, C, J = as_float(V, C, J)
    return _cavity_update(V, C, J)


def _v_map(V, args):
    C, J = args
    return _cavity_update(V, C, J)


def cavity_variances(
    C: Float[ArrayLike, "N d d"], J: Couplings, *, V0: Optional[Float[ArrayLike, "N d d"]] = None,
    solver: solvers.AbstractSolver = solvers.Anderson(),
    adjoint: solvers.AbstractAdjoint = DEFAULT_ADJOINT, throw: bool = True,
) -> solvers.Solution:
    """Cavity variances V consistent with given local covariances: [(𝚲 − 𝐉)⁻¹]_ii = C_i.

    Iterates `cavity_update` (Anderson by default) at fixed C, the inner problem of adaptive
    TAP when the means are held fixed (for the binary prior with d = 1, C_i = 1 − m_i² does not
    depend on V). The plain iteration's Jacobian has a zero diagonal and off-diagonal entries
    −([𝛘]_ik/[𝛘]_ii)² (d = 1), so it contracts when the off-diagonal susceptibilities are
    small compared with the diagonal ones.

    **Arguments:**

    - `C`: local covariances `(N, d, d)` (positive definite); `J`: couplings `(N, N, d, d)`.
    - `V0`: initial guess, default 0 (then the first update is the linear response of the
      independent-site system).
    - `solver`, `adjoint`, `throw`: as `solvers.fixed_point` (defaults `solvers.Anderson()`,
      its default solver, and `spins.vector.DEFAULT_ADJOINT`).

    **Returns:** a `solvers.Solution` whose `value` is V `(N, d, d)`.
    """
    J, N, d = _check_J("cavity_variances", J)
    if jnp.shape(C) != (N, d, d):
        raise ValueError(f"cavity_variances: C must have shape (N, d, d) = ({N}, {d}, {d}), "
                         f"got {jnp.shape(C)}.")
    C, J = as_float(C, J)
    if V0 is None:
        V0 = jnp.zeros((N, d, d), C.dtype)
    elif jnp.shape(V0) != (N, d, d):
        raise ValueError(f"cavity_variances: V0 must have shape ({N}, {d}, {d}), got "
                         f"{jnp.shape(V0)}.")
    V0 = jax.lax.stop_gradient(jnp.asarray(V0, C.dtype))
    return solvers.fixed_point(_v_map, V0, (C, J), solver=solver, adjoint=adjoint, throw=throw)


def gaussian_cavity_variances(J: Couplings) -> Float[Array, "N d d"]:
    """The adaptive-TAP cavity variances of the Gaussian prior N(0, I), in closed form.

    V_i = I − [(I − 𝐉)⁻¹]_ii⁻¹ (computed as [G]_ii⁻¹[G𝐉]_ii, G = (I − 𝐉)⁻¹): the fixed point
    of `cavity_update`, reached in one step from any V, independent of the fields. Then
    (I − V_i)⁻¹ = [(I − 𝐉)⁻¹]_ii is the exact marginal covariance. Cost O((N d)³).

    **Arguments:** `J` couplings `(N, N, d, d)` with zero diagonal blocks (I − 𝐉 should be
    positive definite for the model to exist; not checked here).

    **Returns:** V `(N, d, d)`.
    """
    J, N, d = _check_J("gaussian_cavity_variances", J)
    (J,) = as_float(J)
    eye = jnp.eye(N * d, dtype=J.dtype)
    G = _unblock(jnp.linalg.solve(eye - block_matrix(J), eye), N, d)
    return jnp.linalg.solve(_diag_blocks(G), _einsum("ikab,kibc->iac", G, J))


# ----------------------------------------------------------------------------- mean-field maps


def _onsager(C, J):
    """Classic TAP: V_i = Σ_j J_ij C_j J_ijᵀ, the cavity-field covariance of independent
    neighbours (for d = 1, binary: Σ_j J_ij² (1 − m_j²), the SK Onsager term)."""
    return _einsum("ijab,jbc,ijdc->iad", J, C, J)


def _make_map(method, prior):
    def fn(state, args):
        X, J = args
        m, V = state
        m_new, C = _sites(cavity_means(m, V, J) + X, V, prior)
        if method == "adaptive":
            V_new = _cavity_update(V, C, J)
        elif method == "tap":
            V_new = _onsager(C, J)
        else:
            V_new = V
        return TAPState(m_new, V_new)

    fn.__name__ = f"_{method}_{prior}_map"
    return fn


# One function object per (method, prior): `fixed_point` compiles once per map.
_MAPS = {(meth, pr): _make_map(meth, pr)
         for meth in ("adaptive", "tap", "naive") for pr in PRIORS}

_NAMES = {"adaptive": "adaptive_tap", "tap": "tap", "naive": "naive_mean_field"}


def adaptive_tap_update(
    state: TAPState, X: Fields, J: Couplings, *, prior: str = "gaussian"
) -> TAPState:
    """One application of the map whose fixed point `adaptive_tap` solves:
    m_i ← f(a_i + X_i; V_i) (`site_moments`), V ← `cavity_update`(V, χ, J), both from the
    current state — e.g. to run another solver or to check a residual.

    **Arguments:** `state` a `TAPState(m (N, d), V (N, d, d))`, `X` `(N, d)`, `J`
    `(N, N, d, d)`, `prior`. **Returns:** the new `TAPState`.
    """
    J, N, d = _check_system("adaptive_tap_update", X, J, prior)
    _check_state("adaptive_tap_update", state, N, d)
    X, J, m, V = as_float(X, J, *state)
    return _MAPS[("adaptive", prior)](TAPState(m, V), (X, J))


def _stable(state, X, J, prior):
    """True where the solution is a valid one: sym(𝚲 − 𝐉) positive definite (the linear-
    response covariance) and, for the Gaussian prior, every sym(I − V_i) too."""
    m, V = state
    N, d = m.shape
    eye_N = jnp.eye(N, dtype=m.dtype)
    if prior == "gaussian":
        Lam = jnp.broadcast_to(jnp.eye(d, dtype=m.dtype), (N, d, d))  # V + (I − V)
        ok_site = jnp.all(jnp.isfinite(jnp.linalg.cholesky(_sym(Lam - V))))
    else:
        _, C = _sites(cavity_means(m, V, J) + X, V, prior)
        Lam = V + jnp.linalg.inv(_floor(C))
        ok_site = True
    A = block_matrix(eye_N[:, :, None, None] * Lam[:, None] - J)
    ok = jnp.all(jnp.isfinite(jnp.linalg.cholesky(_sym(A))))
    return ok & ok_site & jnp.all(jnp.isfinite(A))


def _solve(method, X, J, prior, solver, adjoint, throw, init):
    name = _NAMES[method]
    J, N, d = _check_system(name, X, J, prior)
    X, J = as_float(X, J)
    if init is None:
        V0 = jnp.zeros((N, d, d), X.dtype)
        m0 = _sites(X, V0, prior)[0]
    else:
        _check_state(name, init, N, d)
        m0, V0 = (jnp.asarray(a, X.dtype) for a in init)
        if method == "naive":
            V0 = jnp.zeros_like(V0)
    x0 = jax.lax.stop_gradient(TAPState(m0, V0))
    sol = solvers.fixed_point(_MAPS[(method, prior)], x0, (X, J), solver=solver,
                              adjoint=adjoint, throw=throw)
    ok = _stable(jax.lax.stop_gradient(sol.value), jax.lax.stop_gradient(X),
                 jax.lax.stop_gradient(J), prior)
    bad = (sol.result == solvers.RESULTS.successful) & ~ok
    result = jnp.where(bad, solvers.RESULTS.nonfinite, sol.result).astype(sol.result.dtype)
    nan = jnp.where(bad, jnp.nan, 0.0).astype(X.dtype)
    value = jax.tree.map(lambda a: a + nan, sol.value)
    if throw:
        what = ("I − J is not positive definite: the Gaussian model does not exist (its "
                "density is not normalizable)" if prior == "gaussian" else
                "the linear-response susceptibility (Λ − J)⁻¹ is not positive definite: the "
                "solution is not a stable one")
        message = (f"{name}: the fixed point was found but is not a valid mean-field solution:"
                   f" {what}. Scale the couplings down, or pass throw=False to get the "
                   "Solution with result RESULTS.nonfinite and NaN values.")
        value = eqx.error_if(solvers.backward_error_if(value, bad, 0, [message]), bad,
                             message)
    return solvers.Solution(value, sol.num_steps, sol.residual, sol.final_residual, result)


_SOLVE_ARGS = """
    **Arguments:**

    - `X`: fields `(N, d)`; `J`: couplings `(N, N, d, d)`, zero diagonal blocks, J_ji = J_ijᵀ
      for a Boltzmann distribution (see `symmetrize_couplings` and the module docstring for
      other J).
    - `prior`: `"gaussian"` (N(0, I) per site) or `"binary"` (every component ±1).
    - `solver`: a `spinformer.solvers` fixed-point solver with its stopping rule (on the
      residual of (m, V)); default `solvers.Anderson()`, `solvers.fixed_point`'s default.
    - `adjoint`: how gradients flow; default `spins.vector.DEFAULT_ADJOINT`.
    - `throw`: raise if the solve fails or its solution is invalid; with `False` the failure is
      reported in `result` (and an invalid solution's values are NaN).
    - `init`: initial `TAPState`, default the uncoupled sites (m = f(X; 0), V = 0).

    **Returns:** a `solvers.Solution` whose `value` is a `TAPState(m (N, d), V (N, d, d))`;
    the local covariances χ_i follow from `covariances`, the full linear response from
    `susceptibility`.
"""


def adaptive_tap(
    X: Fields, J: Couplings, *, prior: str = "gaussian",
    solver: solvers.AbstractSolver = solvers.Anderson(),
    adjoint: solvers.AbstractAdjoint = DEFAULT_ADJOINT, throw: bool = True,
    init: Optional[TAPState] = None,
) -> solvers.Solution:
    return _solve("adaptive", X, J, prior, solver, adjoint, throw, init)


adaptive_tap.__doc__ = """Adaptive TAP means and cavity variances (Opper & Winther 2001;
    Bal 2021): the joint fixed point of

    m_i = f(a_i + X_i; V_i),  a_i = Σ_j J_ij m_j − V_i m_i,
    V_i = [𝛘]_ii⁻¹[𝛘𝐉]_ii,   𝛘 = (𝚲 − 𝐉)⁻¹,  Λ_i = V_i + χ_i⁻¹,

    with f and χ_i the mean and covariance of `site_moments`. Exact for the Gaussian prior.
    Cost O((N d)³) per iteration.
""" + _SOLVE_ARGS


def tap(
    X: Fields, J: Couplings, *, prior: str = "gaussian",
    solver: solvers.AbstractSolver = solvers.Anderson(),
    adjoint: solvers.AbstractAdjoint = DEFAULT_ADJOINT, throw: bool = True,
    init: Optional[TAPState] = None,
) -> solvers.Solution:
    return _solve("tap", X, J, prior, solver, adjoint, throw, init)


tap.__doc__ = """Classic TAP: the cavity variances are those of independent neighbours,
    V_i = Σ_j J_ij χ_j J_ijᵀ, instead of the linear-response ones. For d = 1 and the binary
    prior this is the SK Onsager term, m_i = tanh(Σ_j J_ij m_j + X_i − m_i Σ_j J_ij²(1 − m_j²))
    (as `spins.ising.tap` at β = 1). Cost O(N² d³) per iteration.
""" + _SOLVE_ARGS


def naive_mean_field(
    X: Fields, J: Couplings, *, prior: str = "gaussian",
    solver: solvers.AbstractSolver = solvers.Anderson(),
    adjoint: solvers.AbstractAdjoint = DEFAULT_ADJOINT, throw: bool = True,
    init: Optional[TAPState] = None,
) -> solvers.Solution:
    return _solve("naive", X, J, prior, solver, adjoint, throw, init)


naive_mean_field.__doc__ = """Naive mean field: V = 0, m_i = f(Σ_j J_ij m_j + X_i; 0).
    For the Gaussian prior its means are already exact, (I − 𝐉)⁻¹X, but its covariances are
    the prior's I. `value.V` stays zero. Cost O(N² d²) per iteration.
""" + _SOLVE_ARGS


def covariances(
    state: TAPState, X: Fields, J: Couplings, *, prior: str = "gaussian"
) -> Float[Array, "N d d"]:
    """Local covariances χ_i = Cov(S_i) of the single-site measures at a solution, the
    estimates of the marginal covariances (exact for the Gaussian prior with adaptive TAP).

    **Arguments:** `state` the `value` of `adaptive_tap` / `tap` / `naive_mean_field`, `X`
    `(N, d)`, `J` `(N, N, d, d)`, `prior` as used there. **Returns:** `(N, d, d)`.
    """
    J, N, d = _check_system("covariances", X, J, prior)
    _check_state("covariances", state, N, d)
    X, J, m, V = as_float(X, J, *state)
    return _sites(cavity_means(m, V, J) + X, V, prior)[1]


def susceptibility(
    state: TAPState, X: Fields, J: Couplings, *, prior: str = "gaussian"
) -> Float[Array, "N N d d"]:
    """The linear-response susceptibilities 𝛘 = (𝚲 − 𝐉)⁻¹, Λ_i = V_i + χ_i⁻¹, as blocks
    𝛘[i, j] ≈ ∂⟨S_i⟩/∂X_j ≈ Cov(S_i, S_j) (for V held fixed). At an adaptive-TAP solution
    its diagonal blocks equal `covariances`; with the Gaussian prior it is the exact
    covariance (I − 𝐉)⁻¹; from a naive mean-field solution it is the linear-response
    correction of H. J. Kappen and F. B. Rodríguez, "Efficient learning in Boltzmann machines
    using linear response theory", Neural Computation 10, 1137 (1998). Cost O((N d)³).

    **Arguments:** as `covariances`. **Returns:** `(N, N, d, d)`.
    """
    J, N, d = _check_system("susceptibility", X, J, prior)
    _check_state("susceptibility", state, N, d)
    X, J, m, V = as_float(X, J, *state)
    C = _sites(cavity_means(m, V, J) + X, V, prior)[1]
    return _linear_response(V, _floor(C), J)
