r"""Steepest-descent free energy of vector spins and its saddle (approximate free-energy
minimisation).

```python
import jax, jax.numpy as jnp
from spinformer.spins import free_energy as fe

kH, kJ = jax.random.split(jax.random.key(0))
n, D = 8, 64
H = jax.random.normal(kH, (4, n, D))                        # 4 systems: raw fields
A = jax.random.normal(kJ, (n, n)) / jnp.sqrt(n * D)
J = (A + A.T) * (1 - jnp.eye(n))                            # symmetric couplings

sol = fe.saddle(H[0], J, beta=1.0)          # Solution: sol.value = t* (n,), sol.result
logZ = fe.log_partition(H[0], J, beta=1.0)  # ≈ ln Z, constants included
m = fe.magnetizations(H[0], J, beta=1.0)    # ⟨σ_i⟩ = ½ Σ_j [V⁻¹]_ij h_j at t*, (n, D)
m = jax.vmap(lambda h: fe.magnetizations(h, J, beta=1.0))(H)        # a batch, (4, n, D)
m = fe.magnetizations(H[0] / jnp.sqrt(D), J, beta=1.0, normalized=True)  # unit spins
```

Source: M. Bal, "Transformers from Spin Models: Approximate Free Energy Minimization" (2021),
https://mcbal.github.io/post/transformers-from-spin-models-approximate-free-energy-minimization/
(after H. E. Stanley, "Spherical Model as the Limit of Infinite Spin Dimensionality",
Phys. Rev. 176, 718 (1968), https://doi.org/10.1103/PhysRev.176.718).

**Model.** N spins σ_i ∈ ℝ^D on the sphere |σ_i|² = D, energy

    E = −Σ_{i,j} J_ij σ_i·σ_j − Σ_i h_i·σ_i         (the double sum counts each pair twice)

and Z = ∫ Π_i dσ_i δ(D − |σ_i|²) exp(−βE). Only the symmetric part of J enters E, so every
function here uses (J + Jᵀ)/2. A diagonal of J is allowed and exact: it adds β D Tr J to
log Z (|σ_i|² = D), and the formulas below carry it through V.

**Steepest descent.** Writing each δ as a contour integral over t_i, the σ integrals become
Gaussian with V = diag(t) − J (positive definite on the contour), and

    Z = (β/2πi)^N (π/β)^{DN/2} ∫ d^N t exp(D φ(t)),
    φ(t) = β Σ_j t_j − ½ log det V + (β/4D) Tr(Hᵀ V⁻¹ H)          (raw fields, H: N × D).

φ is strictly convex on {t : V ≻ 0} (−log det is convex, Tr(HᵀV⁻¹H) is the matrix-fractional
function, and ½V⁻¹∘V⁻¹ ≻ 0 by the Schur product theorem) and tends to +∞ at the boundary
V → singular and as any t_i → ∞ (Hadamard: log det V ≤ Σ log V_ii). So for every β > 0,
symmetric J and H there is exactly one real saddle t*, the minimum of φ over real t, and
along the imaginary direction it is the maximum that dominates for large D:

    log Z = (DN/2) ln(π/β) + D φ(t*) + ln R,
    ln R ≈ N ln(β/2π) + (N/2) ln(2π/D) − ½ log det ∇²φ(t*)     (Gaussian fluctuations of t),

the fluctuation term optional in `log_partition` (it makes the error O(1/D) in log Z
itself instead of O(ln D)). Closed forms, with A = V⁻¹, G = HHᵀ, c = β/(4D):

    ∂φ/∂t_i       = β − ½ A_ii − c [A G A]_ii,
    ∂²φ/∂t_i∂t_j  = ½ A_ij² + 2c A_ij [A G A]_ij,
    ⟨σ_i⟩ = β⁻¹ ∂ ln Z/∂h_i = (D/β) ∂φ/∂h_i = ½ Σ_j A_ij h_j          (fixed J).

At t* the Gaussian the saddle describes (per component: mean ½V⁻¹h_α, covariance V⁻¹/2β)
meets the spherical constraint on average, D A_ii/(2β) + ¼|[A H]_i|² = D; the saddle's
residual is this relative violation, ∇φ/β = 1 − A_ii/(2β) − |[A H]_i|²/(4D).

**Normalised convention** (`normalized=True`, the post's implementation): the fields are
passed as h_i = h_i^raw/√D (a LayerNorm'ed input divided by √D, so |h_i| = O(1)) and the
spins are reported as s_i = σ_i/√D (unit vectors). It is exactly the raw model with
H ← √D·H: φ has β/4 instead of β/(4D), Z is the same number, and the magnetization of the
unit spins is again ½ Σ_j A_ij h_j. With J fixed and H normalised, φ does not depend on D,
which is the setting where D → ∞ is a proper limit.

**Free energy.** With Z₀ = (π^{D/2} D^{(D−2)/2}/Γ(D/2))^N the total mass of the δ measure
(`log_measure`), Stirling gives the post's boxed large-D result

    −βf = lim_{D→∞} D⁻¹ ln(Z/Z₀) = φ(t*) − N/2 − (N/2) ln(2β)              (`free_energy`);

at finite D, `(log_partition(...) − log_measure(N, D)) / D` is the finite-D value.

**Input-dependent couplings.** Anywhere J is accepted, a callable `J(H) -> (N, N)` may be
passed. The magnetization is then the total derivative of ln Z: by stationarity the
saddle's own dependence on H drops out, but J(H)'s does not,
`⟨σ_i⟩ = (D/β) d/dh_i φ(t, H, J(H))|_{t = t*}` (raw), computed by autodiff at fixed `t*`.
`tanh_couplings` is the post's example.

**Solving.** `saddle` runs `spinformer.solvers.root_find` on ∇φ/β with `SaddleNewton`, a
damped Newton method with the closed-form Hessian whose steps keep V positive definite (a
line search from the full step, checked by Cholesky, falling back to a damped length that
provably stays inside; see `SaddleNewton`), from t0_i ≈ λ_max(J) + t_i^{(0)}, where t^{(0)}
is the exact saddle of the uncoupled system (J = 0) and λ_max(J) the largest eigenvalue
(estimated by power iteration; V(t0) is then close to ⪰ diag(t^{(0)}) ≻ 0, which is checked,
with Gershgorin's bound as the fallback), and t0 = t* when J = 0. Gradients are implicit
(`SaddleImplicit`: one Cholesky solve with the closed-form Hessian).
A failed saddle (not converged, or V not positive definite) is reported in
`Solution.result` and raises with `throw=True`; with `throw=False` the functions that
return arrays return NaN for it (never a silent wrong value).

**Costs** (one system): each Newton step factorises V (Cholesky, N³/3), forms V⁻¹ (N³),
V⁻¹GV⁻¹ (2N³) and the N × N Hessian, and solves with it (Cholesky, N³/3), plus one
Cholesky per backtracking trial (usually one): O(N³) per step, independent of D, as the
saddle depends on H only through G = HHᵀ (N²D once). The default start is close enough that
a handful of steps suffice over a wide range of β and coupling strengths
(experiments/results/implicit/findings.md).
`magnetizations` adds N²D. The backward pass (`SaddleImplicit`) is one more Hessian and
Cholesky solve plus one VJP of ∇φ, O(N³); the matrix-free `solvers.Implicit` would need up
to N products of O(N³) each.

**What the source gets wrong** (each checked by derivation and by the tests):

- The Hessian of φ. The post gives ½[V⁻¹∘V⁻ᵀ] + (β/4)[V⁻ᵀHHᵀV⁻ᵀV⁻ᵀ ∘ I] + (β/4)[V⁻ᵀV⁻ᵀHHᵀV⁻ᵀ ∘ I]:
  the field part is not diagonal. Correct (normalised convention):
  ∂²φ/∂t_i∂t_j = ½ [V⁻¹]_ij² + (β/2) [V⁻¹]_ij [V⁻¹HHᵀV⁻¹]_ij, i.e.
  ½ V⁻¹∘V⁻¹ + (β/2) V⁻¹∘(V⁻¹HHᵀV⁻¹) (β/(2D) with raw fields).
- The magnetization. The post writes ⟨σ_i⟩ = d log Z/dh_i = ∂φ/∂h_i = (β/2) Σ_j [V⁻¹]_ij h_j.
  Two factors are off: ⟨σ_i⟩ = β⁻¹ ∂ ln Z/∂h_i (the field enters as βh·σ), and
  ln Z ≈ const + D φ, not φ. Correct: ⟨σ_i⟩ = ½ Σ_j [V⁻¹]_ij h_j (raw σ and h; equally
  ⟨σ_i⟩/√D = ½ Σ_j [V⁻¹]_ij h_j with normalised h) — no β prefactor (β enters through t*).
- The normaliser. The post's Z_N^{(D)}(0) = (π^{D/2} D^{(D−1)/2}/Γ(D/2))^N is neither the
  surface area of the sphere of radius √D (2π^{D/2}D^{(D−1)/2}/Γ(D/2)) nor the mass of the
  δ(D − |σ|²) measure used in Z, which is that area divided by the Jacobian 2√D:
  (π^{D/2} D^{(D−2)/2}/Γ(D/2))^N. The difference, (N/2) ln D, is O(ln D / D) per D, so the
  boxed −βf (the D → ∞ limit) is unaffected.
- Stability. "Stable as long as det V > 0" is not enough: det V > 0 also holds with two
  (any even number of) negative eigenvalues. The Gaussian integrals need V positive definite,
  which is what `is_stable` checks (a Cholesky factorisation succeeds).
- The example couplings J(H) = tanh(H Q Kᵀ Hᵀ √D)/√(ND) are neither symmetric nor
  traceless, unlike the model's J. Only their symmetric part enters the energy (and the
  diagonal only shifts log Z), but V = diag(t) − J must be symmetrised before a Cholesky
  factorisation or a symmetric-matrix formula is applied; `tanh_couplings` symmetrises and
  zeroes the diagonal.
"""

from __future__ import annotations

import math
from typing import Callable, Optional, Union

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.scipy.linalg import cho_solve, solve_triangular
from jaxtyping import Array, ArrayLike, Bool, Float

from .. import solvers
from ._common import HIGHEST, Adjoint, Matrix, Scalar, Solver, Spins, as_float, check_vector, mm

__all__ = [
    "phi",
    "phi_grad",
    "phi_hessian",
    "is_stable",
    "SaddleNewton",
    "SaddleImplicit",
    "saddle",
    "log_partition",
    "log_measure",
    "free_energy",
    "magnetizations",
    "tanh_couplings",
]

Couplings = Union[Matrix, Callable[[Array], Array]]
Aux = Float[ArrayLike, " n"]

# ----------------------------------------------------------------------------- closed forms


def _sym(J):
    return 0.5 * (J + J.T)


def _chol(V):
    """Lower Cholesky factor of V and whether it exists (all finite, positive diagonal)."""
    L = jnp.linalg.cholesky(V)
    d = jnp.diagonal(L)
    ok = jnp.all(jnp.isfinite(L)) & jnp.all(d > 0)
    return L, ok


def _V(t, J):
    return jnp.diag(t) - J


def _inverse(L):
    """A = V⁻¹ = L⁻ᵀL⁻¹ from the Cholesky factor (exactly symmetric)."""
    X = solve_triangular(L, jnp.eye(L.shape[0], dtype=L.dtype), lower=True)
    return jnp.matmul(X.T, X, precision=HIGHEST)


def _phi_ok(t, G, J, beta, kappa):
    """(φ, V ≻ 0) with φ = β Σt − ½ log det V + βκ Tr(V⁻¹G); φ is NaN where V is not PD."""
    L, ok = _chol(_V(t, J))
    logdet = 2.0 * jnp.sum(jnp.log(jnp.diagonal(L)))
    Y = solve_triangular(L, G, lower=True)  # Tr(V⁻¹G) = Tr(L⁻¹ G L⁻ᵀ)
    Z = solve_triangular(L, Y.T, lower=True)
    val = beta * jnp.sum(t) - 0.5 * logdet + beta * kappa * jnp.trace(Z)
    return jnp.where(ok, val, jnp.nan), ok


def _phi_G(t, G, J, beta, kappa):
    return _phi_ok(t, G, J, beta, kappa)[0]


def _parts(t, G, J):
    """(ok, A, AGA) at t: PD flag, V⁻¹ and V⁻¹GV⁻¹ (NaN where V is not PD)."""
    L, ok = _chol(_V(t, J))
    A = _inverse(L)
    P = mm(mm(A, G), A)
    P = 0.5 * (P + P.T)
    return ok, A, P


def _grad_G(t, G, J, beta, kappa):
    ok, A, P = _parts(t, G, J)
    g = beta - 0.5 * jnp.diagonal(A) - beta * kappa * jnp.diagonal(P)
    return jnp.where(ok, g, jnp.nan)


def _hess_G(t, G, J, beta, kappa):
    ok, A, P = _parts(t, G, J)
    Hs = 0.5 * A * A + 2.0 * beta * kappa * A * P
    return jnp.where(ok, Hs, jnp.nan)


def _residual(t, args):
    """∇φ/β = 1 − A_ii/(2β) − κ[AGA]_ii: the relative violation of the spherical constraint
    by the saddle's Gaussian. NaN where V is not positive definite."""
    G, J, beta, kappa = args
    L, ok = _chol(_V(t, J))
    A = _inverse(L)
    diagA = jnp.diagonal(A)
    diagP = jnp.sum(mm(A, G) * A, axis=1)  # [AGA]_ii = Σ_j [AG]_ij A_ji, A symmetric
    F = 1.0 - diagA / (2.0 * beta) - kappa * diagP
    return jnp.where(ok, F, jnp.nan)


def _newton_parts(t, args):
    """Everything a Newton step needs at t from one Cholesky factorisation: `(F, A, P, φ)`,
    the residual ∇φ/β `(n,)`, A = V⁻¹ and P = AGA `(n, n)` (the Hessian's parts) and φ
    (NaN where V is not positive definite)."""
    G, J, beta, kappa = args
    L, ok = _chol(_V(t, J))
    A = _inverse(L)
    AG = mm(A, G)
    P = mm(AG, A)
    P = 0.5 * (P + P.T)
    F = 1.0 - jnp.diagonal(A) / (2.0 * beta) - kappa * jnp.diagonal(P)
    # φ = βΣt − ½ log det V + βκ Tr(V⁻¹G), log det V = 2 Σ log L_ii
    val = beta * jnp.sum(t) - jnp.sum(jnp.log(jnp.diagonal(L))) + beta * kappa * jnp.trace(AG)
    nan = lambda x: jnp.where(ok, x, jnp.nan)  # noqa: E731
    return nan(F), nan(A), nan(P), nan(val)


# ----------------------------------------------------------------------------- checks


def _check_H(name, H):
    if jnp.ndim(H) != 2:
        raise ValueError(
            f"{name}: H must have shape (n, D) (n spins, D field components), got "
            f"{jnp.shape(H)}. Pass one system per call and vmap over a batch."
        )
    return jnp.shape(H)


def _check_beta(name, beta):
    if isinstance(beta, (int, float)) and not (math.isfinite(beta) and beta > 0):
        raise ValueError(
            f"{name}: beta={beta!r} must be a finite positive inverse temperature; the "
            "steepest-descent saddle exists for every beta > 0."
        )


def _resolve_J(name, H, J):
    """The (N, N) couplings from an array or a callable J(H), shape-checked."""
    n = jnp.shape(H)[0]
    if callable(J):
        J = J(H)
        what = "J(H) (the couplings callable's output)"
    else:
        what = "J"
    if jnp.shape(J) != (n, n):
        raise ValueError(
            f"{name}: {what} must have shape (n, n) = ({n}, {n}) to match the {n} spins of "
            f"H, got {jnp.shape(J)}. Pass one system per call and vmap over a batch."
        )
    return J


def _kappa(D, normalized):
    return 0.25 if normalized else 0.25 / D


def _prepare(name, H, J, beta, normalized):
    """Checked float arrays (H, J_sym, beta, kappa, G) and D."""
    _check_H(name, H)
    _check_beta(name, beta)
    J = _resolve_J(name, H, J)
    H, J, beta = as_float(H, J, beta)
    J = _sym(J)
    D = H.shape[1]
    kappa = jnp.asarray(_kappa(D, normalized), H.dtype)
    G = mm(H, H.T)
    return H, J, beta, kappa, G, D


def _check_t(name, t, n):
    check_vector(name, t, "t", n)


# ----------------------------------------------------------------------------- public: φ


def phi(
    t: Aux, H: Spins, J: Couplings, *, beta: Scalar, normalized: bool = False
) -> Float[Array, ""]:
    """φ(t) = β Σ_j t_j − ½ log det V + c Tr(Hᵀ V⁻¹ H), V = diag(t) − J.

    c = β/(4D) (raw fields) or β/4 (`normalized=True`: H is the raw field divided by √D).
    ln Z ≈ (DN/2) ln(π/β) + D φ(t*) (Bal 2021). Uses a Cholesky factorisation of V.

    **Arguments:** `t` `(n,)`; `H` `(n, D)`; `J` `(n, n)` or a callable `J(H)` (its
    symmetric part is used); `beta` > 0; `normalized` as above.

    **Returns:** a scalar; NaN where V is not positive definite (outside φ's domain).
    """
    n, _ = _check_H("phi", H)
    _check_t("phi", t, n)
    H, J, beta, kappa, G, _ = _prepare("phi", H, J, beta, normalized)
    return _phi_G(jnp.asarray(t, H.dtype), G, J, beta, kappa)


def phi_grad(
    t: Aux, H: Spins, J: Couplings, *, beta: Scalar, normalized: bool = False
) -> Float[Array, " n"]:
    """∂φ/∂t_i = β − ½ [V⁻¹]_ii − c [V⁻¹HHᵀV⁻¹]_ii in closed form (c as in `phi`).

    **Arguments:** as `phi`. **Returns:** `(n,)`; NaN where V is not positive definite.
    """
    n, _ = _check_H("phi_grad", H)
    _check_t("phi_grad", t, n)
    H, J, beta, kappa, G, _ = _prepare("phi_grad", H, J, beta, normalized)
    return _grad_G(jnp.asarray(t, H.dtype), G, J, beta, kappa)


def phi_hessian(
    t: Aux, H: Spins, J: Couplings, *, beta: Scalar, normalized: bool = False
) -> Float[Array, "n n"]:
    """∂²φ/∂t_i∂t_j = ½ [V⁻¹]_ij² + 2c [V⁻¹]_ij [V⁻¹HHᵀV⁻¹]_ij in closed form (c as in `phi`),
    i.e. ½ V⁻¹∘V⁻¹ + 2c V⁻¹∘(V⁻¹HHᵀV⁻¹) — positive definite wherever V is.

    **Arguments:** as `phi`. **Returns:** `(n, n)`; NaN where V is not positive definite.
    """
    n, _ = _check_H("phi_hessian", H)
    _check_t("phi_hessian", t, n)
    H, J, beta, kappa, G, _ = _prepare("phi_hessian", H, J, beta, normalized)
    return _hess_G(jnp.asarray(t, H.dtype), G, J, beta, kappa)


def is_stable(t: Aux, J: Matrix) -> Bool[Array, ""]:
    """Whether V = diag(t) − J is positive definite (its Cholesky factorisation exists).

    This is the condition for the Gaussian integrals behind φ; det V > 0 is not enough (it
    also holds with an even number of negative eigenvalues). Only J's symmetric part is used.

    **Arguments:** `t` `(n,)`, `J` `(n, n)`. **Returns:** a boolean scalar.
    """
    n = check_vector("is_stable", t, "t")
    if jnp.shape(J) != (n, n):
        raise ValueError(f"is_stable: J must have shape ({n}, {n}) to match t, got "
                         f"{jnp.shape(J)}.")
    t, J = as_float(t, J)
    return _chol(_V(t, _sym(J)))[1]


# ----------------------------------------------------------------------------- the solver


class _SaddleState(eqx.Module):
    x: Float[Array, " n"]
    r: Float[Array, " n"]  # the residual ∇φ/β at x
    rnorm: Float[Array, ""]
    failed: Bool[Array, ""]
    A: Float[Array, "n n"]  # V⁻¹ at x
    P: Float[Array, "n n"]  # V⁻¹GV⁻¹ at x
    phi: Float[Array, ""]  # φ at x


# f̃ = (9/4)·2φ = 4.5 φ is self-concordant (see `SaddleNewton`); its Newton decrement is
# √4.5 times φ's.
_SC_SCALE = 4.5


class SaddleNewton(solvers.AbstractRootFinder):
    """Damped Newton method for the saddle t* (the minimum of the convex φ) that keeps
    V = diag(t) − J positive definite. Used by `saddle`; it reads `saddle`'s arguments, so it
    is not a general root finder.

    Each step takes the Newton direction Δt = −(∇²φ)⁻¹∇φ with the closed-form Hessian and the
    step length of damped Newton for self-concordant functions. 2φ = −log det V + (linear) +
    Σ_α (β/2D) h_αᵀV⁻¹h_α; along a line, with M = V^{-1/2} diag(Δt) V^{-1/2}, the log-det
    part has second derivative tr M² and the fractional parts obey |g'''| ≤ 3‖M‖ g'', so
    |f'''| ≤ 3 f''^{3/2} for f = 2φ and f̃ = (9/4) f = 4.5 φ is self-concordant. With
    λ̃² = 4.5 Δtᵀ∇²φ Δt (= −4.5 ∇φ·Δt) the step t ← t + αΔt, α = 1 if λ̃ ≤ `full_step`
    (< 1) and 1/(1 + λ̃) otherwise, stays inside the Dikin ellipsoid, hence inside
    {V ≻ 0}, decreases φ, and converges globally, quadratically near t*. In addition every
    trial point is checked by a Cholesky factorisation and the step halved (at most
    `max_backtracks` times) if rounding put it outside; if no halving helps the solve ends as
    `nonfinite`.

    **Arguments:**

    - `tol`: the residual is ∇φ/β = 1 − ⟨|σ_i|²⟩/D under the saddle's Gaussian (the relative
      violation of the spherical constraint), converged when its norm is ≤ tol.
    - `max_steps`, `norm`: as every solver.
    - `full_step`: λ̃ below which full Newton steps are taken without the Armijo test.
    - `armijo`: the sufficient-decrease fraction of the line search.
    - `max_backtracks`: halvings allowed when rounding leaves the positive-definite region.
    """

    tol: float = 1e-5
    max_steps: int = eqx.field(default=100, static=True)
    norm: Callable = eqx.field(default=solvers.max_norm, static=True)
    full_step: float = 0.25
    armijo: float = 1e-4
    max_backtracks: int = eqx.field(default=30, static=True)

    def __check_init__(self):
        if not (0.0 < self.full_step < 1.0):
            raise ValueError(f"SaddleNewton(full_step={self.full_step}) must be in (0, 1): "
                             "full Newton steps are safe only inside the Dikin ellipsoid.")
        if not (isinstance(self.max_backtracks, int) and self.max_backtracks >= 0):
            raise ValueError(f"SaddleNewton(max_backtracks={self.max_backtracks!r}) must be "
                             "an int >= 0.")

    def _at(self, x, args):
        r, A, P, val = _newton_parts(x, args)
        rn = self._rnorm(r)
        return _SaddleState(x, r, rn, ~jnp.isfinite(rn), A, P, val)

    def init(self, prob, x, args):
        return self._at(x, args)

    def step(self, prob, s, args):
        G, J, beta, kappa = args
        # Newton direction on ∇φ/β: its Jacobian ∇²φ/β = (½ A∘A + 2βκ A∘P)/β, with A and P
        # kept from the residual's factorisation at x (one Cholesky of V per step, besides
        # the line search's trial and the Hessian's own).
        hess = (0.5 * s.A * s.A + 2.0 * beta * kappa * s.A * s.P) / beta
        Lh = jnp.linalg.cholesky(hess)
        dx = -cho_solve((Lh, True), s.r)
        # Everything below only chooses the step length: no gradients through it.
        x0, d, r0 = (jax.lax.stop_gradient(a) for a in (s.x, dx, s.r))
        Gc, Jc, bc, kc = (jax.lax.stop_gradient(a) for a in (G, J, beta, kappa))
        slope = bc * jnp.vdot(r0, d)  # ∇φ·Δt = −Δtᵀ∇²φΔt ≤ 0
        lam = jnp.sqrt(_SC_SCALE * jnp.maximum(-slope, 0.0))
        damped = (1.0 / (1.0 + lam)).astype(x0.dtype)
        full = lam <= self.full_step
        phi0 = jax.lax.stop_gradient(s.phi)

        # Trial lengths 1, ½, ¼, … down to the damped step, then halving further only if
        # rounding put the damped step outside {V ≻ 0}. A trial is accepted if V stays
        # positive definite and it decreases φ sufficiently (Armijo), or it is a full step in
        # the quadratic region, or it is no longer than the damped step.
        def accept(a):
            val, ok = _phi_ok(x0 + a * d, Gc, Jc, bc, kc)
            return ok & (full | (a <= damped) | (val <= phi0 + self.armijo * a * slope))

        def cond(c):
            a, good, k = c
            return ~good & (k < self.max_backtracks)

        def body(c):
            a, _, k = c
            a = jnp.where((a > damped) & (0.5 * a < damped), damped, 0.5 * a)
            return a, accept(a), k + 1

        one = jnp.ones((), x0.dtype)
        a, _, _ = jax.lax.while_loop(cond, body, (one, accept(one), jnp.asarray(0, jnp.int32)))
        return self._at(s.x + a * dx, args)

    def terminate(self, state):
        return self._stop(state.rnorm, state.failed)

    def output(self, state):
        return state.x, state.rnorm


# ----------------------------------------------------------------------------- the adjoint


def _saddle_jacobian(t, args):
    """∂F/∂t = ∇²φ/β at t `(n, n)`, in closed form (symmetric positive definite at the
    saddle)."""
    G, J, beta, kappa = args
    return _hess_G(t, G, J, beta, kappa) / beta


class SaddleImplicit(solvers.Implicit):
    """Implicit differentiation of the saddle with the closed-form Hessian: the default
    adjoint of `saddle` (config name `saddle_implicit`). It is `solvers.Implicit` with a
    `solvers.Dense` linear solver that reads ∂F/∂t from `saddle`'s arguments, so it fits no
    other problem.

    By the implicit function theorem, a cotangent ḡ of t* is pulled back by solving
    (∂F/∂t)ᵀ w = −ḡ with F = ∇φ/β, whose Jacobian ∇²φ/β is symmetric positive definite, and
    returning wᵀ ∂F/∂(H, J, β) (one VJP of F). The solve is one dense Cholesky
    factorisation, O(N³), where a matrix-free solve needs up to N products of O(N³) each.
    The backward solve is checked and recorded like every `Implicit` solve
    (`solvers.record_backward`); `tol` (1e-3) bounds the relative residual of the direct
    solve in float32 (about `n·eps·cond(∇²φ)`), so only a failed factorisation (NaN) or a
    nearly singular Hessian fails the check, which gives NaN gradients, and an error in
    `saddle` when `throw=True`.
    """

    linear_solver: solvers.AbstractLinearSolver = solvers.Dense(matrix=_saddle_jacobian,
                                                                positive_definite=True)
    tol: float = 1e-3


# ----------------------------------------------------------------------------- the saddle

_DEFAULT_SOLVER = SaddleNewton()
_DEFAULT_ADJOINT = SaddleImplicit()

_T0_CODE = 3  # index of the "t0 not PD" message (reported as RESULTS.nonfinite)

_MESSAGES = [
    "",
    "saddle: the Newton iteration did not bring the spherical-constraint residual below tol "
    "within max_steps. The saddle is probably very close to the edge of J's spectrum (large "
    "beta or strong couplings), where V is nearly singular and float32 limits the attainable "
    "accuracy. Enable float64 (jax.config.update('jax_enable_x64', True)), lower beta or scale "
    "J down, raise SaddleNewton(max_steps=...) or loosen SaddleNewton(tol=...); pass "
    "throw=False to inspect Solution.result instead.",
    "saddle: the iteration produced a point where V = diag(t) - J is not positive definite "
    "(its Cholesky factorisation failed) or a non-finite value. Check H, J and beta for "
    "NaN/inf; with another solver than the default SaddleNewton (which keeps V positive "
    "definite) use SaddleNewton; otherwise V is too ill-conditioned for this precision: lower "
    "beta, scale J down or enable float64. Pass throw=False to inspect Solution.result.",
    "saddle: the initial guess t0 does not make V = diag(t0) - J positive definite, where "
    "phi is defined. Pass t0=None (the default starts near lambda_max(J) plus the uncoupled "
    "saddle) or raise t0 above the largest eigenvalue of J.",
]

_BACKWARD_MSG = (
    "saddle: the gradient through the saddle t* is not finite: the implicit backward solve "
    "with the Hessian of phi did not converge (t* close to the edge of J's spectrum), or the "
    "incoming gradient was already non-finite. Lower beta or scale J down, enable float64, "
    "use adjoint=solvers.Implicit(linear_solver=solvers.GMRES(restart=50), max_steps=1000), "
    "or pass throw=False to receive NaN gradients instead of this error."
)


_POWER_STEPS = 24  # power iterations for the default start's estimate of λ_max(J)


def _default_t0(G, J, beta, kappa):
    """λ̂ + the uncoupled saddle t_unc = (1 + √(1 + 16β²κ G_ii))/(4β), with λ̂ ≤ λ_max(J) the
    Rayleigh quotient after `_POWER_STEPS` power iterations on J + cI (c the Gershgorin bound
    max_i Σ_j |J_ij|, which makes the spectrum non-negative so that the iteration finds the
    largest eigenvalue, not the largest in modulus). V(t0) ⪰ diag(t_unc) − (λ_max − λ̂) is
    positive definite unless λ̂ is short by more than min t_unc ≥ 1/(2β); that is checked (a
    Cholesky factorisation) and the start falls back to Gershgorin's t0_i = Σ_j |J_ij| + t_unc_i
    (V then strictly diagonally dominant). An exact `eigvalsh` is avoided because it costs
    far more than a Cholesky factorisation of the same matrix, more than the Newton steps
    it would save (measured on docs/results/cost.md)."""
    t_unc = (1.0 + jnp.sqrt(1.0 + 16.0 * beta**2 * kappa * jnp.diagonal(G))) / (4.0 * beta)
    rows = jnp.sum(jnp.abs(J), axis=1)
    M = J + jnp.max(rows) * jnp.eye(J.shape[0], dtype=J.dtype)

    def power(_, v):
        w = M @ v
        return w / jnp.maximum(jnp.linalg.norm(w), jnp.finfo(w.dtype).tiny)

    v = jax.lax.fori_loop(0, _POWER_STEPS, power, jnp.ones_like(t_unc) / J.shape[0] ** 0.5)
    t0 = jnp.vdot(v, J @ v) + t_unc
    return jnp.where(_chol(_V(t0, J))[1], t0, rows + t_unc)


def _saddle_G(name, G, J, beta, kappa, t0, solver, adjoint, throw):
    """The Solution for t* given the Gram matrix G = HHᵀ (checked value, folded result)."""
    n = G.shape[0]
    if t0 is None:
        t0 = _default_t0(G, J, beta, kappa)
    else:
        check_vector(name, t0, "t0", n)
        t0 = jnp.asarray(t0, G.dtype)
    t0 = jax.lax.stop_gradient(t0)
    args = (G, J, beta, kappa)
    if throw:
        args = solvers.backward_error_if(args, False, 0, [_BACKWARD_MSG], nonfinite=True)
    sol = solvers.root_find(
        _residual, t0, args,
        solver=_DEFAULT_SOLVER if solver is None else solver,
        adjoint=_DEFAULT_ADJOINT if adjoint is None else adjoint,
        throw=False,
    )
    t = sol.value
    pd = _chol(_V(jax.lax.stop_gradient(t), jax.lax.stop_gradient(J)))[1]
    start_pd = _chol(_V(t0, jax.lax.stop_gradient(J)))[1]
    ok = sol.result == solvers.RESULTS.successful
    result = jnp.where(ok & ~pd, solvers.RESULTS.nonfinite, sol.result).astype(jnp.int32)
    if throw:
        index = jnp.where(start_pd, result, _T0_CODE)
        t = eqx.branched_error_if(t, result != solvers.RESULTS.successful, index, _MESSAGES)
    return solvers.Solution(t, sol.num_steps, sol.residual, sol.final_residual, result)


def saddle(
    H: Spins,
    J: Couplings,
    *,
    beta: Scalar,
    normalized: bool = False,
    t0: Aux | None = None,
    solver: Solver = None,
    adjoint: Adjoint = None,
    throw: bool = True,
) -> solvers.Solution:
    """The steepest-descent saddle t* = argmin φ(t), the root of ∇φ (Bal 2021).

    Solved by `solvers.root_find` on ∇φ/β = 1 − ⟨|σ_i|²⟩/D (the relative violation of the
    spherical constraint; see the module docstring). The saddle exists and is unique for
    every β > 0; failures are numerical (V nearly singular at large β or strong couplings).

    **Arguments:**

    - `H`: fields `(n, D)`; `J`: couplings `(n, n)` or a callable `J(H) -> (n, n)` (the
      symmetric part is used); `beta` > 0; `normalized`: H is the raw field divided by √D.
    - `t0`: initial guess `(n,)` with diag(t0) − J positive definite; default
      λ_max(J) + the uncoupled saddle (1 + √(1 + 16β²κ|h_i|²))/(4β), κ = 1/(4D) or 1/4,
      with λ_max(J) estimated by power iteration (checked to be positive definite; else
      Gershgorin's bound row by row).
    - `solver`: `None` means `SaddleNewton()` (tol 1e-5, 100 steps); `solvers.Newton()` or
      `solvers.Broyden()` also work but may step out of the positive-definite region, which
      is then reported as `nonfinite`.
    - `adjoint`: `None` means `SaddleImplicit()` (a dense solve with the closed-form
      Hessian); `solvers.Implicit(...)` (matrix-free) and `solvers.Unrolled()` also work.
    - `throw`: raise if the saddle fails (not converged, V not positive definite, t0 not
      positive definite, or a non-finite gradient through it); with `False` the failure is
      in `Solution.result` only.

    **Returns:** a `solvers.Solution` with `value` = t* `(n,)`; `residual` is the ∞-norm of
    ∇φ/β at t*.
    """
    H, J, beta, kappa, G, _ = _prepare("saddle", H, J, beta, normalized)
    return _saddle_G("saddle", G, J, beta, kappa, t0, solver, adjoint, throw)


def _solved(name, H, J, beta, normalized, t0, solver, adjoint, throw, saddle):
    H, J, beta, kappa, G, D = _prepare(name, H, J, beta, normalized)
    if saddle is None:
        sol = _saddle_G(name, G, J, beta, kappa, t0, solver, adjoint, throw)
    else:
        if not isinstance(saddle, solvers.Solution):
            raise TypeError(f"{name}: saddle= takes the Solution that saddle(H, J, ...) "
                            f"returned, got {type(saddle).__name__}.")
        if jnp.shape(saddle.value) != (H.shape[0],):
            raise ValueError(f"{name}: saddle.value has shape {jnp.shape(saddle.value)}; the "
                             f"saddle of these {H.shape[0]} spins has shape ({H.shape[0]},). "
                             "Pass the Solution of saddle() called with the same H and J.")
        sol = saddle
    ok = sol.result == solvers.RESULTS.successful
    return H, J, beta, kappa, G, D, sol, ok


def _nan_unless(ok, x):
    return jnp.where(ok, x, jnp.nan)


def log_measure(n: int, D: int) -> float:
    """ln Z₀, the total mass of Π_i δ(D − |σ_i|²) dσ_i over n spins in ℝ^D:
    Z₀ = (π^{D/2} D^{(D−2)/2} / Γ(D/2))^n (the sphere's area 2π^{D/2}D^{(D−1)/2}/Γ(D/2)
    divided by the Jacobian 2√D of the δ). The partition function at β = 0. A Python float.
    """
    if not (isinstance(n, int) and isinstance(D, int) and n >= 1 and D >= 1):
        raise ValueError(f"log_measure: n={n!r} and D={D!r} must be positive ints.")
    return n * (0.5 * D * math.log(math.pi) + 0.5 * (D - 2) * math.log(D) - math.lgamma(D / 2))


def log_partition(
    H: Spins,
    J: Couplings,
    *,
    beta: Scalar,
    normalized: bool = False,
    fluctuations: bool = False,
    t0: Aux | None = None,
    solver: Solver = None,
    adjoint: Adjoint = None,
    throw: bool = True,
    saddle: Optional[solvers.Solution] = None,
):
    """Steepest-descent approximation of ln Z for Z = ∫Π dσ_i δ(D − |σ_i|²) exp(−βE):

        ln Z ≈ (DN/2) ln(π/β) + D φ(t*)
               [+ N ln(β/2π) + (N/2) ln(2π/D) − ½ log det ∇²φ(t*)   with `fluctuations`].

    Without the fluctuation term the error is O(ln D) (O(ln D / D) per D); with it, O(1/D).
    Differentiable in H, J (also through a callable J(H)) and β; the saddle's own
    dependence drops out of first derivatives by stationarity.

    **Arguments:** as `saddle`, plus `fluctuations` (add the Gaussian integral over t around
    t*) and `saddle`: the `Solution` that `saddle(H, J, ...)` returned for the same
    arguments, used instead of solving again (so its steps, residual and result can be
    read; `t0`, `solver`, `adjoint`, `throw` are then unused; gradients flow through it).

    **Returns:** a scalar (NaN if the saddle failed with `throw=False`).
    """
    H, J, beta, kappa, G, D, sol, ok = _solved(
        "log_partition", H, J, beta, normalized, t0, solver, adjoint, throw, saddle
    )
    n = H.shape[0]
    t = sol.value
    val = 0.5 * D * n * jnp.log(jnp.pi / beta) + D * _phi_G(t, G, J, beta, kappa)
    if fluctuations:
        L, _ = _chol(_hess_G(t, G, J, beta, kappa))
        logdet = 2.0 * jnp.sum(jnp.log(jnp.diagonal(L)))
        val = val + n * jnp.log(beta / (2 * jnp.pi)) + 0.5 * n * math.log(2 * math.pi / D)
        val = val - 0.5 * logdet
    val = _nan_unless(ok, val)
    return val


def free_energy(
    H: Spins,
    J: Couplings,
    *,
    beta: Scalar,
    normalized: bool = False,
    t0: Aux | None = None,
    solver: Solver = None,
    adjoint: Adjoint = None,
    throw: bool = True,
    saddle: Optional[solvers.Solution] = None,
):
    """−βf = φ(t*) − N/2 − (N/2) ln(2β), the post's boxed large-D free energy
    lim_{D→∞} D⁻¹ ln(Z/Z₀) (note: this returns −βf, which grows with ln Z).

    It is a proper limit with normalised fields (`normalized=True`, φ then independent of
    D); with raw fields the field term is O(1/D). The finite-D counterpart is
    `(log_partition(...) − log_measure(N, D)) / D`, which differs by O(ln D / D).

    **Arguments:** as `saddle`, plus `saddle`: the `Solution` that `saddle(H, J, ...)`
    returned for the same arguments, used instead of solving again (see `log_partition`).

    **Returns:** a scalar (NaN if the saddle failed with `throw=False`).
    """
    H, J, beta, kappa, G, D, sol, ok = _solved(
        "free_energy", H, J, beta, normalized, t0, solver, adjoint, throw, saddle
    )
    n = H.shape[0]
    val = _phi_G(sol.value, G, J, beta, kappa) - 0.5 * n - 0.5 * n * jnp.log(2.0 * beta)
    val = _nan_unless(ok, val)
    return val


def magnetizations(
    H: Spins,
    J: Couplings,
    *,
    beta: Scalar,
    normalized: bool = False,
    t0: Aux | None = None,
    solver: Solver = None,
    adjoint: Adjoint = None,
    throw: bool = True,
    saddle: Optional[solvers.Solution] = None,
):
    """Spin expectation values ⟨σ_i⟩ = β⁻¹ ∂ ln Z/∂h_i from the steepest-descent ln Z.

    - fixed J: ⟨σ_i⟩ = ½ Σ_j [V⁻¹]_ij h_j at t* (raw fields and spins; with
      `normalized=True` the same formula gives the unit-spin magnetization ⟨σ_i⟩/√D from the
      normalised fields).
    - callable J(H): the total derivative, (D/β) ∇_H φ(t, H, J(H)) at t = t* (raw; 1/β with
      `normalized=True`), by autodiff at fixed t*: the saddle's dependence on H drops out by
      stationarity, J(H)'s does not.

    Gradients flow to H, J (and what J(H) closes over) and β, through t* by the implicit
    adjoint. The leading order of the expansion: the fluctuation term of `log_partition`
    is not differentiated.

    **Arguments:** as `saddle`, plus `saddle`: the `Solution` that `saddle(H, J, ...)`
    returned for the same arguments, used instead of solving again (see `log_partition`).

    **Returns:** `(n, D)` (NaN if the saddle failed with `throw=False`).
    """
    couplings = J
    H, J, beta, kappa, G, D, sol, ok = _solved(
        "magnetizations", H, J, beta, normalized, t0, solver, adjoint, throw, saddle
    )
    t = sol.value
    if callable(couplings):
        def phi_of(Hx):
            Jx = _sym(jnp.asarray(couplings(Hx), Hx.dtype))
            return _phi_G(t, mm(Hx, Hx.T), Jx, beta, kappa)

        scale = (1.0 if normalized else D) / beta
        m = scale * jax.grad(phi_of)(H)
    else:
        L, _ = _chol(_V(t, J))
        m = 0.5 * cho_solve((L, True), H)
    m = _nan_unless(ok, m)
    return m


def tanh_couplings(
    H: Spins, Q: Float[ArrayLike, "D k"], K: Float[ArrayLike, "D k"]
) -> Float[Array, "n n"]:
    """The post's example of input-dependent couplings, made a valid J:

        J = sym(tanh(√D · H Q Kᵀ Hᵀ)) / √(N D),  sym(X) = (X + Xᵀ)/2, diagonal set to 0.

    (The post's tanh(H Q Kᵀ Hᵀ √D)/√(ND) is not symmetric; only its symmetric part enters
    the energy, and a diagonal only shifts ln Z.) Pass it as
    `lambda H: tanh_couplings(H, Q, K)` wherever a callable J is accepted.

    **Arguments:** `H` `(n, D)` (normalised fields, as in the post); `Q`, `K` `(D, k)`.

    **Returns:** `(n, n)`, symmetric with zero diagonal.
    """
    n, D = _check_H("tanh_couplings", H)
    if jnp.ndim(Q) != 2 or jnp.shape(Q) != jnp.shape(K) or jnp.shape(Q)[0] != D:
        raise ValueError(
            f"tanh_couplings: Q and K must both have shape (D, k) with D = {D}, got "
            f"{jnp.shape(Q)} and {jnp.shape(K)}."
        )
    H, Q, K = as_float(H, Q, K)
    S = mm(mm(H, Q), mm(H, K).T)
    T = jnp.tanh(math.sqrt(D) * S) / math.sqrt(n * D)
    return _sym(T) * (1.0 - jnp.eye(n, dtype=T.dtype))
