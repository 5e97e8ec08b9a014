"""Private helpers shared by the spin modules: input checks, configuration enumeration,
coupling symmetrisation, size limits, matmul precision, and the spin functions' default
adjoint (`DEFAULT_ADJOINT`, re-exported as `spins.vector.DEFAULT_ADJOINT`)."""

from __future__ import annotations

from typing import Optional, Union

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import ArrayLike, Float

from .. import solvers

# Shapes of the spin functions' arguments (one system per call).
Scalar = Union[float, Float[ArrayLike, ""]]
Vector = Float[ArrayLike, " n"]  # fields or magnetizations of n binary spins
Matrix = Float[ArrayLike, "n n"]  # couplings
Tensor3 = Optional[Float[ArrayLike, "n n n"]]  # optional three-body couplings
Spins = Float[ArrayLike, "n D"]  # n vector spins of dimension D
Solver = Optional[solvers.AbstractSolver]
Adjoint = Optional[solvers.AbstractAdjoint]

# Size limits of the exact methods (one place; `nn` reads them from here).
MAX_ENUMERATION = 30  # ising.exact_marginals and friends: 2^n configurations, chunked
MAX_BOLTZMANN_T = 24  # ising.boltzmann_marginals: 2^T configurations for every query
MAX_DQA = 12  # samplers.dqa: a dense 2^n state vector

# Full float32 matmuls (GPUs would otherwise round to TF32/bf16 passes: the enumerations are
# meant to be exact).
HIGHEST = jax.lax.Precision.HIGHEST


def mm(a, b):
    """`a @ b` in full float32 precision."""
    return jnp.matmul(a, b, precision=HIGHEST)


# XLA's CPU backend runs a product that contracts the row index of its left operand (the
# pullback Aᵀ ḡ of A @ B with respect to B) as a slow strided dot. These products give their
# forward-mode rules an explicit transposed copy of A (kept by an optimisation barrier, which
# XLA cannot fold back into the dot), so the reverse pass derived from them is a plain
# product; values, gradients, `jvp`, `jacfwd` and `hessian` are those of the plain product.


@jax.custom_jvp
def matmul_rt(A, B):
    """`A @ B` for `A (..., n, s)`, `B (..., s, d)`, with a plain-product reverse pass for B
    (see above; it speeds up the spin attention's time-step layer on CPU)."""
    return A @ B


@matmul_rt.defjvp
def _matmul_rt_jvp(primals, tangents):
    A, B = primals
    dA, dB = tangents
    At = jax.lax.optimization_barrier(jnp.swapaxes(A, -1, -2))
    # A @ dB written through At, so that its transpose (the reverse pass) is At @ ḡ
    return A @ B, dA @ B + jnp.einsum("...ji,...jd->...id", At, dB)


@jax.custom_jvp
def matmul_nt_rt(A, B):
    """`A @ Bᵀ` for `A (..., n, d)`, `B (..., s, d)` (attention scores), with a plain-product
    reverse pass for B: ḡᵀ A through an explicit copy of ḡᵀ (see above). Every attention's
    scores use it, since it speeds up the forward + backward of softmax and spin layers on
    CPU. (Softmax's value mix W v keeps the plain product: through `matmul_rt` it was
    slower.)"""
    return jnp.einsum("...nd,...sd->...ns", A, B)


@matmul_nt_rt.defjvp
def _matmul_nt_rt_jvp(primals, tangents):
    A, B = primals
    dA, dB = tangents
    out = jnp.einsum("...nd,...sd->...ns", A, B)
    # A dBᵀ = (dB Aᵀ)ᵀ, the outer transpose behind a barrier: its transpose copies ḡᵀ once
    # and multiplies it by A as a plain product
    t = jnp.swapaxes(jax.lax.optimization_barrier(jnp.einsum("...sd,...nd->...sn", dB, A)),
                     -1, -2)
    return out, jnp.einsum("...nd,...sd->...ns", dA, B) + t


def bits(n: int) -> np.ndarray:
    """All 2^n configurations as ±1, shape (2^n, n) float32; spin k is bit k of the row index
    (s_k = 1 − 2·bit_k)."""
    idx = np.arange(2**n)[:, None]
    return (1 - 2 * ((idx >> np.arange(n)[None, :]) & 1)).astype(np.float32)


def sym_offdiag(J):
    """(J + Jᵀ)/2 with the diagonal removed, on the trailing (n, n) axes (only this part of J
    enters the energy ½ sᵀJs up to a constant)."""
    n = J.shape[-1]
    return 0.5 * (J + jnp.swapaxes(J, -1, -2)) * (1.0 - jnp.eye(n, dtype=J.dtype))


def upper3(K):
    """K with every entry but K[j, k, l], j < k < l, set to zero (trailing (n, n, n) axes)."""
    n = K.shape[-1]
    j, k, l = np.meshgrid(np.arange(n), np.arange(n), np.arange(n), indexing="ij")
    return jnp.where(jnp.asarray((j < k) & (k < l)), K, 0.0)


def sym3(K):
    """The symmetric three-body tensor Ks with zero on repeated indices and K[j, k, l] on
    j < k < l, so that Σ_{j<k<l} K s_j s_k s_l = ⅙ Σ_{jkl} Ks s_j s_k s_l; trailing axes."""
    Ku = upper3(K)
    lead = tuple(range(Ku.ndim - 3))
    perms = [(0, 1, 2), (0, 2, 1), (1, 0, 2), (1, 2, 0), (2, 0, 1), (2, 1, 0)]
    return sum(jnp.transpose(Ku, lead + tuple(len(lead) + i for i in p)) for p in perms)


def check_square(name: str, J, n: int, what: str = "J") -> None:
    shape = jnp.shape(J)
    if shape != (n, n):
        raise ValueError(
            f"{name}: {what} must have shape (n, n) = ({n}, {n}) to match the {n} spins, "
            f"got {shape}. Pass one system per call and vmap over a batch."
        )


def check_int(name, what, value, minimum):
    """Raise a `ValueError` naming `name` and `what` unless `value` is a Python int >= minimum."""
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name}: {what} must be a Python int >= {minimum}, got {value!r}.")


def check_vector(name: str, v, what: str, n: int | None = None) -> int:
    shape = jnp.shape(v)
    if len(shape) != 1:
        raise ValueError(
            f"{name}: {what} must be a 1-d array of shape (n,), got shape {shape}. "
            "Functions in spinformer.spins take one system per call; vmap over a batch."
        )
    if n is not None and shape[0] != n:
        raise ValueError(f"{name}: {what} has {shape[0]} entries but the system has {n} spins.")
    return shape[0]


def as_float(*arrays):
    """Promote inputs to a common floating dtype, at least float32: the arrays' own (Python
    numbers adapt to them), and for inputs that are all Python numbers or integers the
    default float (float64 when x64 is on, else float32)."""
    present = [a for a in arrays if a is not None]
    dt = jnp.result_type(*present) if present else jnp.dtype(jnp.float32)
    if not jnp.issubdtype(dt, jnp.floating):
        dt = jnp.result_type(float)
    dt = jnp.promote_types(dt, jnp.float32)
    return tuple(None if a is None else jnp.asarray(a, dt) for a in arrays)


#: The spin functions' default adjoint (the `adjoint` default of every spin function that
#: calls `solvers.fixed_point`, or what it puts in place of `adjoint=None`): GMRES with
#: 5-vector Krylov cycles. Spin fixed points away from criticality are well conditioned, so
#: a cycle or two solves the adjoint system to round-off, where the Anderson-on-Richardson
#: default of `solvers.Implicit()` stops at its relative tolerance `rtol`.
DEFAULT_ADJOINT = solvers.Implicit(linear_solver=solvers.GMRES(restart=5))


def check_damping(name: str, damping) -> None:
    if not (0.0 <= float(damping) < 1.0):
        raise ValueError(
            f"{name}: damping={damping} must be in [0, 1): the map is replaced by "
            "m -> damping * m + (1 - damping) * update(m), which keeps the same fixed points."
        )


def check_hJK(name, h, J, K=None):
    """Fields `(n,)`, couplings `(n, n)` and optional three-body `K (n, n, n)`; returns n."""
    n = check_vector(name, h, "h")
    check_square(name, J, n)
    if K is not None and jnp.shape(K) != (n, n, n):
        raise ValueError(
            f"{name}: K must have shape (n, n, n) = ({n}, {n}, {n}), got {jnp.shape(K)}. "
            "Only the entries K[j, k, l] with j < k < l are used."
        )
    return n
