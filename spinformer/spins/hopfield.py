r"""Modern (continuous, exponential) Hopfield networks: the energy, the update and retrieval
(H. Ramsauer, B. Schäfl, J. Lehner, P. Seidl, M. Widrich, T. Adler, L. Gruber, M. Holzleitner,
M. Pavlović, G. K. Sandve, V. Greiff, D. Kreil, M. Kopp, G. Klambauer, J. Brandstetter,
S. Hochreiter, "Hopfield Networks is All You Need", ICLR 2021, arXiv:2008.02217).

N stored patterns x_i ∈ R^d (the rows of `X (N, d)`) and a state pattern ξ ∈ R^d have the
energy (the paper's Eq. 2)

    E(ξ) = −lse(β, X ξ) + ½ ξ·ξ + β⁻¹ ln N + ½ M²,   lse(β, z) = β⁻¹ ln Σ_i exp(β z_i),

with M = max_i ‖x_i‖, and the update (Eq. 3)

    ξ_new = f(ξ) = Xᵀ softmax(β X ξ).

E is a convex function (½ξ·ξ) plus a concave one (−lse), and the update is the
concave–convex procedure: ξ_new minimises ½ξ·ξ − ξ·∇lse(ξ_old), so E never increases along
the updates (Theorem 1; tested), the iterates converge to stationary points of E, and the
fixed points of f are exactly the stationary points (∇E(ξ) = ξ − f(ξ)). The constant terms
β⁻¹ ln N + ½ M² make E ≥ 0 (Lemma A1); they do not change the dynamics.

Attention is one update: with the state patterns the queries and the stored patterns the
keys, `softmax(β X ξ)` are the attention weights of query ξ (`weights`); iterating f to its
fixed point before reading out the values is retrieval (`retrieve`).

The regimes the paper describes, each tested here on small instances:

- **Retrieval of one pattern** (Theorems 3–4): with the separation of pattern i
  Δ_i = x_i·x_i − max_{j≠i} x_i·x_j, a state near x_i is mapped to within
  2(N−1) M exp(−β(Δ_i − 2 M ‖ξ − x_i‖)) of x_i by one update (`retrieval_error_bound`), so
  well-separated patterns are retrieved in one step at large β.
- **Metastable states**: at small β the fixed point averages many patterns (β → 0: the
  mean of the stored patterns).
- **Global average**: β = 0 gives the mean exactly.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Bool, Float

from .. import solvers
from ._common import DEFAULT_ADJOINT, Adjoint, Scalar, as_float, mm

__all__ = ["energy", "max_norm", "retrieval_error_bound", "retrieve", "separation", "update",
           "weights"]

Patterns = Float[ArrayLike, "N d"]
State = Float[ArrayLike, " d"]
Visible = Optional[Bool[ArrayLike, " N"]]


def _check(name: str, xi, X, mask, *, batched: bool = False) -> tuple[int, int]:
    """X `(N, d)`; xi `(d,)` (or `(..., d)` when `batched`); mask `(N,)` (or broadcastable
    to `(..., N)`)."""
    if jnp.ndim(X) != 2:
        raise ValueError(f"{name}: the stored patterns X must have shape (N, d), got "
                         f"{jnp.shape(X)}. Pass one system per call; vmap over a batch.")
    N, d = jnp.shape(X)
    shape = jnp.shape(xi)
    if shape[-1:] != (d,) or (not batched and len(shape) != 1):
        want = f"(..., {d})" if batched else f"(d,) = ({d},)"
        raise ValueError(f"{name}: the state xi must have shape {want} like a stored "
                         f"pattern, got {shape}.")
    if mask is not None:
        mshape = jnp.shape(mask)
        if mshape[-1:] != (N,) or (not batched and len(mshape) != 1):
            raise ValueError(f"{name}: mask must have shape (N,) = ({N},)"
                             f"{' or (..., N)' if batched else ''}, got {mshape}.")
    return N, d


def _scores(xi, X, beta, mask):
    z = beta * mm(xi, X.T)
    # the most negative float, not −inf: a state that sees no pattern stays finite
    return z if mask is None else jnp.where(mask, z, jnp.finfo(z.dtype).min)


def weights(xi: State, X: Patterns, *, beta: Scalar, mask: Visible = None
            ) -> Float[Array, "... N"]:
    """`softmax(β X ξ)` `(N,)` over the visible patterns (`mask`, True = visible; zero
    elsewhere, and all zero when none is visible): the attention weights of query ξ on
    keys X. Several states at once: `xi (..., d)`, `mask (..., N)` → `(..., N)`."""
    _check("weights", xi, X, mask, batched=True)
    xi, X = as_float(xi, X)
    p = jax.nn.softmax(_scores(xi, X, beta, mask), axis=-1)
    return p if mask is None else jnp.where(mask, p, 0.0)


def update(xi: State, X: Patterns, *, beta: Scalar, mask: Visible = None
           ) -> Float[Array, "... d"]:
    """One update `f(ξ) = Xᵀ softmax(β X ξ)` `(d,)` (Eq. 3), over the visible patterns (zero
    when none is visible). Several states at once: `xi (..., d)` → `(..., d)`."""
    p = weights(xi, X, beta=beta, mask=mask)
    return mm(p, as_float(X)[0])


def max_norm(X: Patterns, mask: Visible = None) -> Float[Array, ""]:
    """M = the largest norm of a visible stored pattern."""
    n = jnp.linalg.norm(as_float(X)[0], axis=-1)
    return jnp.max(n if mask is None else jnp.where(mask, n, 0.0))


def energy(xi: State, X: Patterns, *, beta: Scalar, mask: Visible = None) -> Float[Array, ""]:
    """E(ξ) = −β⁻¹ ln Σ_i exp(β x_i·ξ) + ½ ξ·ξ + β⁻¹ ln N + ½ M² (Eq. 2), over the N visible
    patterns; E ≥ 0 (Lemma A1), and ∇E(ξ) = ξ − f(ξ). `beta` > 0."""
    N, _ = _check("energy", xi, X, mask)
    xi, X = as_float(xi, X)
    count = N if mask is None else jnp.sum(mask)
    lse = jax.nn.logsumexp(_scores(xi, X, beta, mask)) / beta
    return -lse + 0.5 * jnp.dot(xi, xi) + jnp.log(count) / beta + 0.5 * max_norm(X, mask) ** 2


def separation(X: Patterns) -> Float[Array, " N"]:
    """Δ_i = x_i·x_i − max_{j≠i} x_i·x_j `(N,)`: how far pattern i stands out from the others
    (the paper's separation of a pattern; retrieval in one step needs Δ_i ≫ ln N / β)."""
    X = as_float(X)[0]
    G = mm(X, X.T)
    off = jnp.where(jnp.eye(G.shape[0], dtype=bool), -jnp.inf, G)
    return jnp.diagonal(G) - jnp.max(off, axis=1)


def retrieval_error_bound(xi: State, X: Patterns, i: int, *, beta: Scalar,
                          fixed_point: Optional[State] = None) -> Float[Array, ""]:
    """Theorem 4's bound on the one-update error ‖f(ξ) − x_i‖ for a state ξ near pattern i:
    2(N−1) M exp(−β(Δ_i − 2 M max(‖ξ − x_i‖, ‖x_i* − x_i‖))), x_i* the fixed point near x_i
    (`fixed_point`; omitted: ‖ξ − x_i‖ alone). Meaningful when the exponent is negative."""
    xi, X = as_float(xi, X)
    N = X.shape[0]
    M = max_norm(X)
    dist = jnp.linalg.norm(xi - X[i])
    if fixed_point is not None:
        dist = jnp.maximum(dist, jnp.linalg.norm(as_float(fixed_point)[0] - X[i]))
    return 2.0 * (N - 1) * M * jnp.exp(-beta * (separation(X)[i] - 2.0 * M * dist))


def retrieve(
    xi0: State, X: Patterns, *, beta: Scalar, mask: Visible = None,
    solver: solvers.AbstractSolver = solvers.Picard(), adjoint: Adjoint = None,
    throw: bool = True,
) -> solvers.Solution:
    """The fixed point ξ* = f(ξ*) reached from `xi0` (a stationary point of E), solved with
    `solver` (default `solvers.Picard()`: the plain updates, which never increase E) and
    differentiated with `adjoint` (`None`, the default: `spins.vector.DEFAULT_ADJOINT`,
    implicit with GMRES(5)).

    **Returns:** a `solvers.Solution` with `value` ξ* `(d,)`.
    """
    _check("retrieve", xi0, X, mask)
    xi0, X = as_float(xi0, X)

    def fn(xi, args):
        XX, b, m = args
        return update(xi, XX, beta=b, mask=m)

    return solvers.fixed_point(fn, xi0, (X, jnp.asarray(beta, X.dtype), mask), solver=solver,
                               adjoint=DEFAULT_ADJOINT if adjoint is None else adjoint,
                               throw=throw)
