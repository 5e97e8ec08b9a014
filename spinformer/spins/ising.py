r"""Binary Ising spins in equilibrium: naive mean field, TAP, exact enumeration.

Spins s ∈ {-1, +1}^n, energy

    E(s) = -( h·s + ½ sᵀJs + Σ_{j<k<l} K_jkl s_j s_k s_l ),

J symmetric with zero diagonal (only its symmetric part matters for the marginals), the
three-body term optional, Boltzmann weight exp(-βE). Every function handles one system;
vmap over a batch.

Mean-field equations (the Onsager term of the SK model is the second-order Plefka
correction; as written in M. Bal, "Deep Implicit Attention: A Mean-Field Theory Perspective on
Attention Mechanisms" (2021), mcbal.github.io):

    mean field:  m_i = tanh(β(h_i + Σ_j J_ij m_j))
    TAP:         m_i = tanh(β(h_i + Σ_j J_ij m_j) − β² m_i Σ_j J_ij² (1 − m_j²))

Exact enumeration (as needed by G. Kim, D. K. Park, "Boltzmann Attention: Learnable Ising
Couplings for Cooperative Attention", arXiv:2606.12478 (2026)) sums over all 2^n
configurations in chunks of partial log-sum-exps, so float32 keeps ~1e-6 accuracy at n = 20
and memory stays small.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float

from .. import solvers
from ._common import MAX_BOLTZMANN_T as MAX_BOLTZMANN_T
from ._common import MAX_ENUMERATION as MAX_ENUMERATION
from ._common import (
    DEFAULT_ADJOINT,
    Adjoint,
    Matrix,
    Scalar,
    Tensor3,
    Vector,
    as_float,
    bits,
    check_damping,
    check_vector,
    sym3,
    sym_offdiag,
    upper3,
)
from ._common import check_hJK as _check_hJ
from ._boltzmann import boltzmann_marginals as boltzmann_marginals

__all__ = [
    "MAX_BOLTZMANN_T",
    "MAX_ENUMERATION",
    "symmetrize",
    "mean_field_update",
    "tap_update",
    "mean_field",
    "tap",
    "exact_marginals",
    "log_partition",
    "connected_correlations",
    "boltzmann_marginals",
]

def symmetrize(J: Float[ArrayLike, "... n n"]) -> Float[Array, "... n n"]:
    """(J + Jᵀ)/2 with the diagonal removed, on the trailing two axes: the part of J that the
    energy ½ sᵀJs sees (the rest only shifts it by a constant)."""
    return sym_offdiag(jnp.asarray(J))


# ----------------------------------------------------------------------------- mean field


def mean_field_update(
    m: Float[ArrayLike, " n"],
    h: Vector, J: Matrix, *, beta: Scalar = 1.0, K: Tensor3 = None,
    visible: Vector | None = None,
) -> Float[Array, " n"]:
    """One naive mean-field update, m ↦ tanh(β(h + J m [+ ½ Ks:mm])).

    **Arguments:**

    - `m`: current magnetizations, shape `(n,)`.
    - `h`: external fields, shape `(n,)`.
    - `J`: couplings, shape `(n, n)`, symmetric with zero diagonal.
    - `beta`: inverse temperature.
    - `K`: optional three-body couplings `(n, n, n)`; only K[j, k, l] with j < k < l is used.
      Their mean-field field on spin j is Σ_{k<l; j,k,l distinct} K m_k m_l = ½ Σ_kl Ks_jkl
      m_k m_l with Ks the symmetric tensor of the entries.
    - `visible`: optional `(n,)` of 1 (the spin is in the model) and 0 (it is removed: no
      field, no couplings, magnetization 0): the update of the model restricted to the
      visible spins, without forming its couplings. Vmapped over rows of `m`, `h` and
      `visible` with one shared `J`, every row's update is one matrix product.

    **Returns:** the updated magnetizations, shape `(n,)`.
    """
    n = _check_hJ("mean_field_update", h, J, K)
    check_vector("mean_field_update", m, "m", n)
    m, h, J, K, beta = as_float(m, h, J, K, beta)
    v = 1.0 if visible is None else jnp.asarray(visible, m.dtype)
    local = h + v * (J @ (v * m))
    if K is not None:
        local = local + 0.5 * v * jnp.einsum("jkl,k,l->j", sym3(K), v * m, v * m)
    return v * jnp.tanh(beta * local)


def tap_update(
    m: Vector, h: Vector, J: Matrix, *, beta: Scalar = 1.0, visible: Vector | None = None
) -> Float[Array, " n"]:
    """One TAP update with the Onsager reaction term,

    m_i ↦ tanh(β(h_i + Σ_j J_ij m_j) − β² m_i Σ_j J_ij² (1 − m_j²))

    (Thouless, Anderson & Palmer 1977; the second-order Plefka expansion, as written in
    M. Bal, "Deep Implicit Attention: A Mean-Field Theory Perspective on Attention
    Mechanisms" (2021), mcbal.github.io).

    **Arguments:** as `mean_field_update` (pairwise couplings only; `visible` removes spins
    from the sums over j as well).

    **Returns:** the updated magnetizations, shape `(n,)`.
    """
    n = _check_hJ("tap_update", h, J)
    check_vector("tap_update", m, "m", n)
    m, h, J, beta = as_float(m, h, J, beta)
    v = 1.0 if visible is None else jnp.asarray(visible, m.dtype)
    vm = v * m
    onsager = beta**2 * vm * ((J * J) @ (v * (1.0 - vm * vm)))
    return v * jnp.tanh(beta * (h + v * (J @ vm)) - onsager)


def _mf_map(m, args):
    h, J, K, beta, damping = args
    return damping * m + (1.0 - damping) * mean_field_update(m, h, J, beta=beta, K=K)


def _tap_map(m, args):
    h, J, _, beta, damping = args
    return damping * m + (1.0 - damping) * tap_update(m, h, J, beta=beta)


def _solve_mf(name, tap_, h, J, K, beta, damping, solver, adjoint, m0, throw):
    n = _check_hJ(name, h, J, K)
    check_damping(name, damping)
    h, J, K, beta = as_float(h, J, K, beta)
    if m0 is None:
        m0 = jnp.tanh(beta * h)  # the J = 0 solution
    else:
        check_vector(name, m0, "m0", n)
        m0 = jnp.asarray(m0, h.dtype)
    args = (h, J, K, beta, jnp.asarray(damping, h.dtype))
    return solvers.fixed_point(_tap_map if tap_ else _mf_map, m0, args, solver=solver,
                               adjoint=DEFAULT_ADJOINT if adjoint is None else adjoint,
                               throw=throw)


def mean_field(
    h: Vector,
    J: Matrix,
    *,
    beta: Scalar = 1.0,
    K: Tensor3 = None,
    damping: float = 0.0,
    solver: solvers.AbstractSolver = solvers.Anderson(),
    adjoint: Adjoint = None,
    m0: Vector | None = None,
    throw: bool = True,
) -> solvers.Solution:
    """Naive mean-field magnetizations, the fixed point of `mean_field_update`.

    **Arguments:**

    - `h`, `J`, `beta`: fields `(n,)`, couplings `(n, n)`, inverse temperature.
    - `K`: optional three-body couplings `(n, n, n)` (see `mean_field_update`).
    - `damping`: in [0, 1); iterates m ↦ damping·m + (1 − damping)·update(m) (same fixed
      points, more stable at strong coupling).
    - `solver`: a `spinformer.solvers` solver with its stopping rule (default
      `solvers.Anderson()`, `solvers.fixed_point`'s default).
    - `adjoint`: how gradients flow (`None`, the default: `spins.vector.DEFAULT_ADJOINT`,
      the spin functions' one).
    - `m0`: initial guess, default tanh(βh) (the J = 0 solution).
    - `throw`: as `solvers.fixed_point`.

    **Returns:** a `solvers.Solution`; its `value` holds the magnetizations `(n,)`.
    """
    return _solve_mf("mean_field", False, h, J, K, beta, damping, solver, adjoint, m0, throw)


def tap(
    h: Vector, J: Matrix, *, beta: Scalar = 1.0, damping: float = 0.0,
    solver: solvers.AbstractSolver = solvers.Anderson(), adjoint: Adjoint = None,
    m0: Vector | None = None, throw: bool = True,
) -> solvers.Solution:
    """TAP magnetizations, the fixed point of `tap_update` (pairwise couplings only).

    Arguments and return value as `mean_field`. Gradients are implicit by default, so they do
    not depend on the number of iterations taken.
    """
    return _solve_mf("tap", True, h, J, None, beta, damping, solver, adjoint, m0, throw)


# ----------------------------------------------------------------------------- enumeration


def _split(n: int) -> tuple[int, int]:
    """(low, high): configurations are enumerated as 2^high chunks of 2^low."""
    if n <= 12:
        return n, 0
    lo = (n + 1) // 2
    return lo, n - lo


def _moments(name, h, J, K, beta, want_corr):
    """log Z, ⟨s⟩ and (optionally) ⟨s sᵀ⟩ by chunked enumeration."""
    n = _check_hJ(name, h, J, K)
    if n > MAX_ENUMERATION:
        raise ValueError(
            f"{name}: exact enumeration of n={n} spins needs 2^{n} configurations; it is "
            f"limited to n <= {MAX_ENUMERATION}. Use mean_field/tap or a sampler instead."
        )
    h, J, K, beta = as_float(h, J, K, beta)
    dt = h.dtype
    lo, hi = _split(n)
    S_lo = jnp.asarray(bits(lo), dt)  # (C, lo)
    h_lo, h_hi = h[:lo], h[lo:]
    J_ll, J_lh, J_hh = J[:lo, :lo], J[:lo, lo:], J[lo:, lo:]
    # Low-block part of -E, shared by every chunk: h_lo·s + ½ sᵀ J_ll s.
    base = S_lo @ h_lo + 0.5 * jnp.sum((S_lo @ J_ll) * S_lo, axis=1)
    if K is not None:
        K_pairs_l = upper3(K).reshape(n * n, n).T  # (l, (j, k))
    shifts = jnp.arange(hi, dtype=jnp.int32)

    def chunk(c):
        s_hi = (1 - 2 * ((c >> shifts) & 1)).astype(dt)  # (hi,)
        neg_e = base + S_lo @ (J_lh @ s_hi) + s_hi @ h_hi + 0.5 * s_hi @ (J_hh @ s_hi)
        S = jnp.concatenate([S_lo, jnp.broadcast_to(s_hi, (S_lo.shape[0], hi))], axis=1)
        if K is not None:
            pairs = (S[:, :, None] * S[:, None, :]).reshape(S.shape[0], n * n)
            neg_e = neg_e + jnp.sum(pairs * (S @ K_pairs_l), axis=1)
        logw = beta * neg_e
        lse = jax.nn.logsumexp(logw)
        p = jnp.exp(logw - lse)
        mean = p @ S
        second = (S * p[:, None]).T @ S if want_corr else jnp.zeros((), dt)
        return lse, mean, second

    if hi == 0:
        lse, mean, second = chunk(jnp.asarray(0, jnp.int32))
        return lse, mean, second
    lses, means, seconds = jax.lax.map(chunk, jnp.arange(2**hi, dtype=jnp.int32),
                                       batch_size=min(2**hi, 16))
    log_z = jax.nn.logsumexp(lses)
    w = jnp.exp(lses - log_z)
    mean = w @ means
    second = jnp.tensordot(w, seconds, axes=1) if want_corr else None
    return log_z, mean, second


def exact_marginals(
    h: Vector, J: Matrix, *, beta: Scalar = 1.0, K: Tensor3 = None
) -> Float[Array, " n"]:
    """Exact magnetizations ⟨s_i⟩ by enumerating all 2^n configurations.

    **Arguments:**

    - `h`: fields `(n,)`; `J`: couplings `(n, n)`; `beta`: inverse temperature.
    - `K`: optional three-body couplings `(n, n, n)`; only K[j, k, l] with j < k < l is used
      (Kim & Park 2026, Appendix C).

    **Returns:** `(n,)` magnetizations. Cost 2^n·n² (2^n·n³ with K); n ≤ 30.
    """
    return _moments("exact_marginals", h, J, K, beta, False)[1]


def log_partition(
    h: Vector, J: Matrix, *, beta: Scalar = 1.0, K: Tensor3 = None
) -> Float[Array, ""]:
    """log Z = log Σ_s exp(−βE(s)), by chunked enumeration (arguments as `exact_marginals`).

    **Returns:** a scalar. Its gradient with respect to h is β⟨s⟩.
    """
    return _moments("log_partition", h, J, K, beta, False)[0]


def connected_correlations(
    h: Vector, J: Matrix, *, beta: Scalar = 1.0, K: Tensor3 = None
) -> Float[Array, "n n"]:
    """Exact connected correlations C_jk = ⟨s_j s_k⟩ − ⟨s_j⟩⟨s_k⟩ by enumeration.

    They obey the fluctuation–dissipation identity ∂⟨s_j⟩/∂h_k = β C_jk (Kim & Park
    2026, Proposition 1). Arguments as `exact_marginals`.

    **Returns:** `(n, n)`, symmetric, diagonal 1 − ⟨s_j⟩².
    """
    _, m, second = _moments("connected_correlations", h, J, K, beta, True)
    return second - jnp.outer(m, m)

