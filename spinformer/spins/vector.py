r"""Vector spins: D-dimensional spins on spheres of radius R, driven by fields and couplings.

A single spin s ∈ ℝ^D with ‖s‖ = R in an effective field θ has density ∝ exp(β s·θ) (a von
Mises–Fisher distribution with concentration βR‖θ‖). Its mean (M. Bal, "Spin-Model Transformers"
(2023), mcbal.github.io, App. A.2) is

    φ(θ) = R · I_{D/2}(βR‖θ‖) / I_{D/2−1}(βR‖θ‖) · θ/‖θ‖,

and, with the radius tied to the dimension by R² = D/2 − 1 and the uniform large-order
expansion of the Bessel ratio, its large-D limit is

    φ(θ) ≈ βθ / (1 + γ),   γ = √(1 + β²‖θ‖²/R²),

which depends on β and R only. The covariance of the spin is (1/β) ∂φ/∂θ (fluctuation–
response); in the large-D limit it is 1/(1+γ) − φφᵀ/(R²γ) (Bal 2023, App. A.3).

Dynamics (Bal 2023, Plefka[t−1,t] for vector spins, large-D):

    mean field:  m_{i,t} = φ(x_i + Σ_j J_ij m_{j,t−1})
    TAP:         m_{i,t} = φ(θ_i),
                 θ_i = x_i + Σ_j J_ij m_{j,t−1} + (1/2β) Var_i⁻¹ [∇²φ(θ_i) : A_i],
                 A_i = Σ_j J_ij² Var_{j,t−1},

a second-order (in the couplings) correction solved self-consistently in m_t; see `tap_step`
for the closed form. `tap_ness` and `mean_field_ness` solve the steady states
m = m_t = m_{t−1} directly.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float

from .. import solvers
from . import kinetic
from ._bessel import inverse_ratio, ratio, ratio_and_over_x, ratio_derivatives
from ._bessel import bessel_ratio as bessel_ratio
from ._common import DEFAULT_ADJOINT as DEFAULT_ADJOINT
from ._common import Adjoint, Matrix, Scalar, Spins, as_float, check_square, matmul_rt

__all__ = [
    "DEFAULT_ADJOINT",
    "NESS_SOLVER",
    "bessel_ratio",
    "magnetization",
    "inverse_magnetization",
    "variance",
    "mean_field_step",
    "tap_step",
    "tap_ness",
    "mean_field_ness",
    "ness_update",
    "covariance",
    "delayed_correlations",
    "entropy_production",
]

# ----------------------------------------------------------------------------- single site


def _sq_norm(v):
    return jnp.sum(v * v, axis=-1, keepdims=True)


def _safe_norm(v):
    s = _sq_norm(v)
    pos = s > 0
    return jnp.where(pos, jnp.sqrt(jnp.where(pos, s, 1.0)), 0.0)


def _gamma_theta(theta, beta, R):
    return jnp.sqrt(1.0 + beta**2 * _sq_norm(theta) / R**2)


def _phi_large(theta, beta, R):
    return beta * theta / (1.0 + _gamma_theta(theta, beta, R))


def _check_dim(name, a, what):
    if jnp.ndim(a) < 1:
        raise ValueError(f"{name}: {what} must have a trailing vector dimension D, got a scalar.")


def magnetization(
    theta: Float[ArrayLike, "... D"], *, beta: Scalar = 1.0, R: Scalar = 1.0, large_d: bool = True
) -> Float[Array, "... D"]:
    """Mean φ(θ) of a vector spin on the sphere of radius R in the field θ (Bal 2023).

    - `large_d=False`: exact for the dimension D = θ.shape[-1],
      φ(θ) = R · I_{D/2}(βR‖θ‖)/I_{D/2−1}(βR‖θ‖) · θ/‖θ‖ (D = 1 gives R tanh(βRθ)).
    - `large_d=True`: the large-D limit βθ/(1 + √(1 + β²‖θ‖²/R²)), which assumes the post's
      convention R² = D/2 − 1 and depends on β and R only.

    **Arguments:**

    - `theta`: effective fields, shape `(..., D)` (one spin per leading index).
    - `beta`: inverse temperature; `R`: spin radius.
    - `large_d`: which of the two forms above.

    **Returns:** magnetizations with the shape of `theta`, of norm < R. Smooth at θ = 0.
    """
    _check_dim("magnetization", theta, "theta")
    theta, beta, R = as_float(theta, beta, R)
    if large_d:
        return _phi_large(theta, beta, R)
    D = theta.shape[-1]
    x = beta * R * _safe_norm(theta)
    _, q = ratio_and_over_x(D / 2.0 - 1.0, x)
    return beta * R * R * q * theta  # R r(x) θ/‖θ‖ with r(x)/‖θ‖ = βR q(x)


def inverse_magnetization(
    m: Float[ArrayLike, "... D"], *, beta: Scalar = 1.0, R: Scalar = 1.0, large_d: bool = True
) -> Float[Array, "... D"]:
    """The field θ whose magnetization is m, the inverse of `magnetization`.

    - `large_d=True`: θ = 2R² m / (β(R² − ‖m‖²)) (Bal 2023).
    - `large_d=False`: exact for D = m.shape[-1]: θ = x/(βR) · m/‖m‖ with x solving
      R · I_{D/2}(x)/I_{D/2−1}(x) = ‖m‖ by Newton's method in log x (from an Amos-type
      starting point; differentiable, with the implicit-function derivative).

    **Arguments:**

    - `m`: magnetizations `(..., D)` with ‖m‖ < R.
    - `beta`, `R`: as `magnetization`; `large_d`: which of the two forms.

    **Returns:** fields with the shape of `m` (infinite as ‖m‖ → R).
    """
    _check_dim("inverse_magnetization", m, "m")
    m, beta, R = as_float(m, beta, R)
    if large_d:
        return 2.0 * R**2 * m / (beta * (R**2 - _sq_norm(m)))
    D = m.shape[-1]
    norm = _safe_norm(m)
    t = norm / R
    if D == 1:  # r_{−1/2} = tanh
        t = jnp.clip(t, 0.0, 1.0 - jnp.finfo(t.dtype).eps)
        x = jnp.arctanh(t)
    else:
        x = inverse_ratio(jnp.asarray(D / 2.0 - 1.0, m.dtype), t)
    return x / (beta * R) * m / jnp.where(norm > 0, norm, 1.0)


def variance(
    theta: Float[ArrayLike, " D"],
    *,
    beta: float | Float[ArrayLike, ""] = 1.0,
    R: float | Float[ArrayLike, ""] = 1.0,
    large_d: bool = True,
) -> Float[Array, "D D"]:
    """Covariance ⟨s sᵀ⟩ − φφᵀ of one vector spin in the field θ, equal to (1/β) ∂φ/∂θ.

    - `large_d=True`: 1/(1+γ) − φφᵀ/(R²γ), γ = √(1 + β²‖θ‖²/R²) (Bal 2023, App. A.3).
    - `large_d=False`: exact for D = θ.shape[-1]: with x = βR‖θ‖, r = I_{D/2}/I_{D/2−1},
      R² r'(x) along θ̂ and R² r(x)/x across it (R²/D · 1 at θ = 0).

    **Arguments:** `theta` of shape `(D,)`, `beta`, `R`, `large_d` as `magnetization`.

    **Returns:** a symmetric positive-definite `(D, D)` matrix.
    """
    if jnp.ndim(theta) != 1:
        raise ValueError(f"variance: theta must have shape (D,), got {jnp.shape(theta)}; vmap "
                         "over several spins.")
    theta, beta, R = as_float(theta, beta, R)
    D = theta.shape[0]
    eye = jnp.eye(D, dtype=theta.dtype)
    if large_d:
        g = _gamma_theta(theta, beta, R)[0]
        phi = _phi_large(theta, beta, R)
        return eye / (1.0 + g) - jnp.outer(phi, phi) / (R**2 * g)
    nu = D / 2.0 - 1.0
    norm = _safe_norm(theta)[0]
    x = beta * R * norm
    nu_, x = jnp.broadcast_arrays(*as_float(nu, x))
    r, q, s = ratio(nu_, x)
    dr, _ = ratio_derivatives(nu_, x, r, q, s)
    u = theta / jnp.where(norm > 0, norm, 1.0)
    uu = jnp.outer(u, u)
    return R**2 * (dr * uu + q * (eye - uu))


# ----------------------------------------------------------------------------- dynamics


def _check_system(name, m_prev, x, J):
    if jnp.ndim(x) != 2:
        raise ValueError(
            f"{name}: x must have shape (n, D) (n spins of dimension D), got {jnp.shape(x)}. "
            "Pass one system per call and vmap over a batch."
        )
    n, D = jnp.shape(x)
    if m_prev is not None and jnp.shape(m_prev) != (n, D):
        raise ValueError(f"{name}: m_prev must have the shape of x, ({n}, {D}); got "
                         f"{jnp.shape(m_prev)}.")
    check_square(name, J, n)
    return n, D


def mean_field_step(
    m_prev: Spins, x: Spins, J: Matrix, *, beta: Scalar = 1.0, R: Scalar = 1.0,
    large_d: bool = True,
) -> Float[Array, "n D"]:
    """One naive mean-field step, m_t = φ(x + J m_{t−1}) (Bal 2023, first-order Plefka).

    **Arguments:**

    - `m_prev`: magnetizations at t−1, `(n, D)`; `x`: fields at t, `(n, D)`.
    - `J`: couplings `(n, n)` (any matrix, e.g. a softmax attention matrix).
    - `beta`, `R`, `large_d`: as `magnetization`.

    **Returns:** magnetizations at t, `(n, D)`.
    """
    _check_system("mean_field_step", m_prev, x, J)
    m_prev, x, J = as_float(m_prev, x, J)
    return magnetization(x + matmul_rt(J, m_prev), beta=beta, R=R, large_d=large_d)


def _gamma_m(m, R):
    """γ of the field that produces m in the large-D limit: γ = (R² + ‖m‖²)/(R² − ‖m‖²)."""
    s = jnp.minimum(_sq_norm(m), (1.0 - 1e-6) * R**2)  # keep |m| < R inside iterations
    return (R**2 + s) / (R**2 - s)


def _hessian_contraction(m, g, a, W, m_prev, beta, R):
    """∇²φ(θ_i) : A_i for every site, with A_i = a_i 1 − Σ_j W_ij m_j m_jᵀ (large-D φ).

    For φ(θ) = βθ/(1+γ) and symmetric A:
    ∇²φ : A = β²(1+3γ)/(R⁴γ³) (mᵀAm) m − β²/(R²γ(1+γ)) (tr A) m − 2β²/(R²γ(1+γ)) A m.
    """
    D = m.shape[-1]
    G = m @ m_prev.T  # (n, n) overlaps m_i · m_j,t−1
    Am = a * m - (W * G) @ m_prev
    mAm = a * _sq_norm(m) - jnp.sum(W * G * G, axis=1, keepdims=True)
    trA = D * a - W @ _sq_norm(m_prev)
    return _hessian_of(m, g, Am, mAm, trA, beta, R)


def _hessian_of(m, g, Am, mAm, trA, beta, R):
    """∇²φ : A from its contractions A m, mᵀ A m and tr A (see `_hessian_contraction`)."""
    c = beta**2 / (R**2 * g * (1.0 + g))
    return beta**2 * (1.0 + 3.0 * g) / (R**4 * g**3) * mAm * m - c * trA * m - 2.0 * c * Am


def _onsager(m, g, H, beta, R):
    """The TAP field's correction Var⁻¹ ∇²φ : A / (2β) from H = ∇²φ : A; rows of m `(..., D)`
    with γ `g` broadcastable to them."""
    # Var_i⁻¹ = (1+γ)(1 + (1+γ) m mᵀ / R²)   (Sherman–Morrison on 1/(1+γ) − m mᵀ/(R²γ))
    vinv_h = (1.0 + g) * (H + (1.0 + g) * jnp.sum(m * H, axis=-1, keepdims=True) * m / R**2)
    return vinv_h / (2.0 * beta)


def _tap_field(m, m_prev, x, J, beta, R):
    """θ(m) of the second-order equations; the TAP magnetizations solve m = φ(θ(m))."""
    g = _gamma_m(m, R)  # (n, 1) at time t
    g_prev = _gamma_m(m_prev, R)  # (n, 1) at time t−1
    J2 = J * J
    a = J2 @ (1.0 / (1.0 + g_prev))  # (n, 1)
    W = J2 / (R**2 * g_prev[:, 0])[None, :]  # (n, n)
    H = _hessian_contraction(m, g, a, W, m_prev, beta, R)
    return x + matmul_rt(J, m_prev) + _onsager(m, g, H, beta, R)


def _tap_row_context(M, x, J, pos, beta, R):
    """What row `pos`'s steady-state field `θ_pos(m)` needs from the other rows, summed once:
    the field of one new position (incremental decoding) solved given the cached rows
    `M (L, D)`, with `x (D,)` and couplings `J (L,)` (its row of J). With row pos of the
    steady-state map's `m_prev` being m itself, every sum over j in `_tap_field` splits into
    j ≠ pos, fixed, and the j = pos term, a function of m:

    a = A0 + J_p²/(1+γ(m)), Σ_j W_j (m·m_j) m_j = C m + W_p |m|² m,
    Σ_j W_j (m·m_j)² = mᵀ C m + W_p |m|⁴, Σ_j W_j |m_j|² = T0 + W_p |m|²,
    Σ_j J_j m_j = JM0 + J_p m,

    with W_j = J_j²/(R² γ_j), C = Σ_{j≠p} W_j m_j m_jᵀ, A0 = Σ_{j≠p} J_j²/(1+γ_j),
    T0 = Σ_{j≠p} W_j |m_j|², JM0 = Σ_{j≠p} J_j m_j. The scalars and JM0 are summed here; C m
    is applied as two products with the other rows (`Mo`, row pos zeroed) in each iteration,
    since forming the D × D matrix C costs L·D², more than the few iterations it would save.
    An iteration then makes two (L, D) products instead of
    three and writes no (L, D) array (`_tap_row_field`)."""
    del beta
    keep = jnp.arange(M.shape[0]) != pos
    Mo = jnp.where(keep[:, None], M, 0.0)
    Jo = jnp.where(keep, J, 0.0)
    g = _gamma_m(Mo, R)[:, 0]
    J2 = Jo * Jo
    W = J2 / (R**2 * g)
    return dict(x=x, Jp=J[pos], A0=J2 @ (1.0 / (1.0 + g)), Mo=Mo, W=W,
                T0=W @ _sq_norm(Mo)[:, 0], JM0=Jo @ Mo)


def _tap_row_field(m, c, beta, R):
    """`_tap_field` of row pos at `m (D,)` from its `_tap_row_context` `c` (the same field
    as with m written into the cached rows; see there)."""
    D = m.shape[-1]
    g = _gamma_m(m, R)[0]
    msq = jnp.sum(m * m)
    Jp2 = c["Jp"] * c["Jp"]
    a = c["A0"] + Jp2 / (1.0 + g)
    Wp = Jp2 / (R**2 * g)
    G = c["Mo"] @ m  # (L,) overlaps with the other rows
    WG = c["W"] * G
    Am = a * m - WG @ c["Mo"] - Wp * msq * m
    mAm = a * msq - jnp.dot(WG, G) - Wp * msq * msq
    trA = D * a - c["T0"] - Wp * msq
    H = _hessian_of(m, g, Am, mAm, trA, beta, R)
    return c["x"] + c["JM0"] + c["Jp"] * m + _onsager(m, g, H, beta, R)


def _tap_map(m, args):
    m_prev, x, J, beta, R = args
    return _phi_large(_tap_field(m, m_prev, x, J, beta, R), beta, R)


def _ness_map(m, args):
    x, J, beta, R = args
    return _phi_large(_tap_field(m, m, x, J, beta, R), beta, R)


def _mf_ness_map(m, args):
    x, J, beta, R = args
    return _phi_large(x + matmul_rt(J, m), beta, R)


def ness_update(
    m: Spins, x: Spins, J: Matrix, *, beta: Scalar = 1.0, R: Scalar = 1.0
) -> Float[Array, "n D"]:
    """One application of the steady-state map m ↦ φ(θ(m; m_{t−1} = m)) whose fixed point
    `tap_ness` solves — for running another solver on the same problem (e.g. a reference
    implementation in a benchmark) or checking a residual ‖ness_update(m) − m‖.

    **Arguments:** `m`, `x` `(n, D)`, `J` `(n, n)`, `beta`, `R` as `tap_step`.

    **Returns:** `(n, D)`.
    """
    _check_system("ness_update", m, x, J)
    m, x, J, beta, R = as_float(m, x, J, beta, R)
    return _ness_map(m, (x, J, beta, R))


def tap_step(
    m_prev: Spins, x: Spins, J: Matrix, *, beta: Scalar = 1.0, R: Scalar = 1.0,
    solver: solvers.AbstractSolver = solvers.Anderson(),
    adjoint: solvers.AbstractAdjoint = DEFAULT_ADJOINT, throw: bool = True,
) -> solvers.Solution:
    """One second-order (TAP) mean-field step for large-D vector spins (Bal 2023).

    Solves m = φ(θ(m)) for m = m_t with

    θ_i = x_i + Σ_j J_ij m_{j,t−1} + (1/2β) Var_i⁻¹ [∇²φ(θ_i) : A_i],
    A_i = Σ_j J_ij² Var_{j,t−1},  Var = 1/(1+γ) − m mᵀ/(R²γ),  γ = (R² + ‖m‖²)/(R² − ‖m‖²),

    i.e. φ(θ_i) equals the average of φ over the Gaussian fluctuations of the field
    Σ_j J_ij s_{j,t−1} to second order in J. Compared with the post: terms quadratic in
    v = θ − x − J m_{t−1} (fourth order) are dropped, and tr Var_j is taken from the same
    large-D covariance (the post uses R² − ‖m_j‖², equal to leading order in D).

    **Arguments:** `m_prev`, `x` `(n, D)`, `J` `(n, n)`, `beta`, `R` (large-D convention
    R² = D/2 − 1), `solver` (default `solvers.Anderson()`, `solvers.fixed_point`'s default),
    `adjoint` (default `DEFAULT_ADJOINT`), `throw` as `solvers.fixed_point`.

    **Returns:** a `solvers.Solution`; its `value` holds the magnetizations at t, `(n, D)`.
    """
    _check_system("tap_step", m_prev, x, J)
    m_prev, x, J, beta, R = as_float(m_prev, x, J, beta, R)
    m0 = jax.lax.stop_gradient(_phi_large(x + J @ m_prev, beta, R))
    return solvers.fixed_point(_tap_map, m0, (m_prev, x, J, beta, R), solver=solver,
                               adjoint=adjoint, throw=throw)


#: The default solver of `tap_ness` and `mean_field_ness`.
NESS_SOLVER = solvers.Anderson(tol=1e-3)


def _ness(name, ness_map, x, J, beta, R, solver, adjoint, throw, m0):
    _check_system(name, m0, x, J)
    x, J, beta, R = as_float(x, J, beta, R)
    if m0 is None:
        m0 = _phi_large(x, beta, R)
    m0 = jax.lax.stop_gradient(jnp.asarray(m0, x.dtype))
    return solvers.fixed_point(ness_map, m0, (x, J, beta, R), solver=solver,
                               adjoint=DEFAULT_ADJOINT if adjoint is None else adjoint,
                               throw=throw)


def tap_ness(
    x: Spins, J: Matrix, *, beta: Scalar = 1.0, R: Scalar = 1.0,
    solver: solvers.AbstractSolver = NESS_SOLVER, adjoint: Adjoint = None, throw: bool = True,
    m0: Spins | None = None,
) -> solvers.Solution:
    """Non-equilibrium steady state of the second-order dynamics, solved as a fixed point.

    Instead of iterating `tap_step` until m_t stops changing, solve m = φ(θ(m; m_{t−1} = m))
    directly (Bal 2023, "Spin-transformer modules"), with implicit gradients by default
    (they do not depend on the iterations taken).

    **Arguments:**

    - `x`: fields `(n, D)`; `J`: couplings `(n, n)`; `beta`, `R` as `tap_step`.
    - `solver`: default `NESS_SOLVER` (pass e.g. `Anderson(tol=1e-6,
      norm=solvers.l2_norm)` for another stopping rule); `adjoint`: `None` (default) means
      `DEFAULT_ADJOINT`; `throw` as `solvers.fixed_point`.
    - `m0`: initial guess, default the decoupled response φ(x).

    **Returns:** a `solvers.Solution`; its `value` holds the steady state `(n, D)`.
    """
    return _ness("tap_ness", _ness_map, x, J, beta, R, solver, adjoint, throw, m0)


def mean_field_ness(
    x: Spins, J: Matrix, *, beta: Scalar = 1.0, R: Scalar = 1.0,
    solver: solvers.AbstractSolver = NESS_SOLVER, adjoint: Adjoint = None, throw: bool = True,
    m0: Spins | None = None,
) -> solvers.Solution:
    """Steady state of the first-order dynamics, m = φ(x + J m), solved as a fixed point.

    The fixed point of `mean_field_step` with m_{t−1} = m_t; arguments and return value as
    `tap_ness`.
    """
    return _ness("mean_field_ness", _mf_ness_map, x, J, beta, R, solver, adjoint, throw, m0)


# ----------------------------------------------------------------------------- non-equilibrium


def _cov_coeffs(m, R):
    """`(a, b)` of the large-D covariance a·1 − b·m mᵀ of spins with magnetizations m: a =
    1/(1+γ), b = 1/(R²γ), with γ recovered from m (γ = (R² + ‖m‖²)/(R² − ‖m‖²))."""
    g = _gamma_m(m, R)[..., 0]
    return 1.0 / (1.0 + g), 1.0 / (R**2 * g)


def covariance(
    m: Float[ArrayLike, "... D"], *, beta: Scalar = 1.0, R: Scalar = 1.0, large_d: bool = True
) -> Float[Array, "... D D"]:
    """Covariance of vector spins given their magnetizations (instead of their fields).

    - `large_d=True`: 1/(1+γ) − m mᵀ/(R²γ) with γ = (R² + ‖m‖²)/(R² − ‖m‖²), the
      large-D covariance (`variance`) written in terms of m; independent of β.
    - `large_d=False`: the exact covariance for D = m.shape[-1] of the field that produces m,
      `variance(inverse_magnetization(m, large_d=False), large_d=False)`.

    **Arguments:** `m` `(..., D)` with ‖m‖ < R; `beta`, `R` as `magnetization`.

    **Returns:** `(..., D, D)`.
    """
    _check_dim("covariance", m, "m")
    m, beta, R = as_float(m, beta, R)
    if large_d:
        a, b = _cov_coeffs(m, R)
        eye = jnp.eye(m.shape[-1], dtype=m.dtype)
        return a[..., None, None] * eye - b[..., None, None] * m[..., :, None] * m[..., None, :]
    theta = inverse_magnetization(m, beta=beta, R=R, large_d=False)
    flat = theta.reshape(-1, theta.shape[-1])
    cov = jax.vmap(lambda t: variance(t, beta=beta, R=R, large_d=False))(flat)
    return cov.reshape(*m.shape, m.shape[-1])


def delayed_correlations(
    m: Spins, m_prev: Spins, J: Matrix, *, beta: Scalar = 1.0, R: Scalar = 1.0,
    large_d: bool = True,
) -> Float[Array, "n n"]:
    r"""First-order Plefka[t−1,t] time-delayed correlations of vector spins,

    D_ij,t = ⟨(s_i,t − m_i,t)·(s_j,t−1 − m_j,t−1)⟩ ≈ β J_ij tr(V_i,t V_j,t−1),

    with V the covariance of a spin (`covariance`): to first order in J the fluctuation of
    s_j,t−1 moves the field of spin i by J_ij δs_j, and spin i responds with ∂m_i/∂θ_i = β V_i.
    In the large-D form V = a·1 − b·m mᵀ (a = 1/(1+γ), b = 1/(R²γ)), so

    tr(V_i V_j) = D a_i a_j − a_i b_j ‖m_j‖² − b_i a_j ‖m_i‖² + b_i b_j (m_i·m_j)².

    Since tr(V_i V_j) = a_i tr V_j − b_i m_iᵀV_j m_i, M. Bal, "Entropy Production in
    Non-Equilibrium Neural Networks" (2026), prints the same last two terms but
    a_i (R² − ‖m_j‖²) for the first two: the exact trace of a spin's covariance on the
    sphere, R² − ‖m_j‖², in place of the large-D trace D a_j − b_j ‖m_j‖² =
    (R² − ‖m_j‖²)(1 + 1/(R² + ‖m_j‖²)) (R² = D/2 − 1). That is not a double count but a
    partial finite-D correction: at m = 0 the exact, printed and large-D traces are
    R⁴/D = D/4 − 1 + 1/D, D/4 − 1/2 and D/4, and against Monte Carlo of the kinetics the
    printed form is about twice as close as the large-D one, while `large_d=False` is
    closer than both (experiments/results/nonequilibrium/monte_carlo.md). `large_d=True`
    keeps one covariance throughout, the
    consistent large-D limit; use `large_d=False` where the O(1/D) error matters.

    **Arguments:**

    - `m`: magnetizations at t, `(n, D)`; `m_prev`: at t−1, `(n, D)` (the same array in a
      steady state).
    - `J`: couplings `(n, n)`; `beta`: inverse temperature; `R`: spin radius.
    - `large_d`: large-D covariances (the attention's convention R² = D/2 − 1), or the exact
      ones for D = m.shape[-1] (for checks against sampling at small D).

    **Returns:** D_ij,t, `(n, n)`.
    """
    _check_system("delayed_correlations", m_prev, m, J)
    m, m_prev, J, beta, R = as_float(m, m_prev, J, beta, R)
    if large_d:
        D = m.shape[-1]
        a, b = _cov_coeffs(m, R)
        ap, bp = _cov_coeffs(m_prev, R)
        sq, sqp = jnp.sum(m * m, -1), jnp.sum(m_prev * m_prev, -1)
        overlap = m @ m_prev.T
        tr = (D * jnp.outer(a, ap) - jnp.outer(a, bp * sqp) - jnp.outer(b * sq, ap)
              + jnp.outer(b, bp) * overlap**2)
    else:
        V = covariance(m, beta=beta, R=R, large_d=False)
        Vp = covariance(m_prev, beta=beta, R=R, large_d=False)
        tr = jnp.einsum("iab,jba->ij", V, Vp)
    return beta * J * tr


def entropy_production(
    J: Matrix, D: Matrix, *, beta: Scalar = 1.0
) -> Float[Array, ""]:
    r"""Entropy production per time step, σ_t = β Σ_ij (J_ij − J_ji) D_ij,t.

    For the kinetics P(s_t | s_{t−1}) ∝ Π_i exp(β s_i,t·(x_i + Σ_j J_ij s_j,t−1)), σ_t is
    the mean log-ratio of the forward and time-reversed transition probabilities. In a
    steady state the field and normaliser terms cancel and
    σ = β Σ_ij (J_ij − J_ji) ⟨s_i,t·s_j,t−1⟩, where the disconnected part Σ (J_ij −
    J_ji) m_i·m_j vanishes (m_t = m_{t−1}), leaving the delayed correlations D. The inverse
    temperature multiplies the sum: M. Bal, "Entropy Production in Non-Equilibrium Neural
    Networks", drops it (harmless at β = 1, off by β otherwise; D itself carries another β,
    so σ ∝ β² to first order at fixed covariances, e.g. at x = 0 where m = 0, as Monte Carlo
    confirms).

    Sign: the exact stationary σ is a Kullback–Leibler divergence, ≥ 0. With the first-order
    D_ij = β J_ij c_ij (`delayed_correlations`, c_ij = tr(V_i,t V_j,t−1) ≥ 0),
    σ = β² Σ (J_ij − J_ji) J_ij c_ij = (β²/2) Σ (J_ij − J_ji)² c_ij ≥ 0 whenever c is
    symmetric — in a steady state, where V_t = V_{t−1} — and 0 for symmetric J. Off the
    steady state (m_t ≠ m_{t−1}) c is not symmetric and σ_t can be negative, and so can the
    exact β Σ (J_ij − J_ji) ⟨δs_i,t·δs_j,t−1⟩ (e.g. right after a field is switched on); there
    it is not the entropy production, since the field and normaliser terms of the
    log-ratio no longer cancel. For causal
    couplings (J_ji = 0 for j < i) σ = β² Σ_{j<i} J_ij² c_ij ≥ 0 always (the diagonal
    cancels).

    **Arguments:** `J` couplings `(n, n)`, `D` delayed correlations `(n, n)`
    (`delayed_correlations`, or measured), `beta` the inverse temperature.

    **Returns:** a scalar.
    """
    # the same sum as for binary spins: only the delayed correlations differ
    return kinetic.entropy_production(J, D, beta=beta)
