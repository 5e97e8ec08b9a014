r"""Ratios of modified Bessel functions, I_{ν+1}(x)/I_ν(x), their derivatives and inverse.

The numerics behind `spinformer.spins.vector`: the mean of a vector spin on a sphere is a
Bessel ratio (M. Bal, "Spin-Model Transformers" (2023), mcbal.github.io, App. A.4), and the
exact (finite-D) magnetization, variance and inverse magnetization need the ratio, its
derivative and its inverse in pure JAX, finite and accurate where the Bessel functions
themselves over- or underflow.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero
from jaxtyping import Array, ArrayLike, Float

from ._common import as_float

# Backward-recurrence depth. The recurrence r_ν = x / (2(ν+1) + x r_{ν+1}) shrinks the error
# of the starting value by r_μ² per step; started from an Amos-type estimate at order ν + K it
# reaches float64 accuracy for x up to ~1e4 (and much faster for x ≲ ν).
_DEPTH = 320


def _ratio_loop(nu, x):
    """Returns (r, q, s): r = I_{ν+1}(x)/I_ν(x), q = r/x and s = 1 − r, for ν > −1, x ≥ 0.

    r and s are carried through the recurrence separately, so r is accurate where it is small
    (x ≪ ν) and s where r is close to one (x ≫ ν)."""
    mu = nu + _DEPTH
    # Amos-type estimate of r_μ, between the bounds x/(μ+½+√((μ+3/2)²+x²)) and
    # x/(μ+½+√((μ+½)²+x²)), exact to first order in 1/x.
    root = jnp.sqrt((mu + 1.0) ** 2 + x * x)
    den = mu + 0.5 + root
    r = x / den
    s = (mu + 0.5 + (mu + 1.0) ** 2 / (root + x)) / den  # 1 − r without cancellation

    def body(k, carry):
        r, s = carry
        two_order = 2.0 * (mu - k.astype(x.dtype))  # 2(order + 1) for order μ−1, …, ν+1
        inv = 1.0 / (two_order + x * r)
        return x * inv, (two_order - x * s) * inv

    r, s = jax.lax.fori_loop(0, _DEPTH - 1, body, (r, s))  # now r_{ν+1}, s_{ν+1}
    q = 1.0 / (2.0 * (nu + 1.0) + x * r)
    return x * q, q, (2.0 * (nu + 1.0) - x * s) * q


@jax.custom_jvp
def ratio(nu, x):
    return _ratio_loop(nu, x)


def ratio_derivatives(nu, x, r, q, s):
    """(r', q') for r = r_ν(x), using r' = 1 − r² − (2ν+1) r/x in cancellation-free forms:
    r' = s(1 + r) − (2ν+1) q where x > 2(ν+1), and r' = q² (2(ν+1) − x² r'_{ν+1}) below."""
    r1, q1, s1 = ratio(nu + 1.0, x)
    dr1 = jnp.where(x > 2.0 * (nu + 2.0), s1 * (1.0 + r1), 1.0 - r1 * r1) - (2.0 * nu + 3.0) * q1
    dq = -(q * q) * (r1 + x * dr1)
    dr = jnp.where(x > 2.0 * (nu + 1.0), s * (1.0 + r) - (2.0 * nu + 1.0) * q,
                   q * q * (2.0 * (nu + 1.0) - x * x * dr1))
    return dr, dq


def _ratio_jvp(primals, tangents):
    nu, x = primals
    dnu, dx = tangents
    if not isinstance(dnu, SymbolicZero):
        raise ValueError(
            "bessel_ratio is differentiable with respect to x only; the order nu must not "
            "carry a gradient. Wrap it in jax.lax.stop_gradient if it is traced."
        )
    r, q, s = ratio(nu, x)
    if isinstance(dx, SymbolicZero):
        z = jnp.zeros_like(r)
        return (r, q, s), (z, z, z)
    dr, dq = ratio_derivatives(nu, x, r, q, s)
    return (r, q, s), (dr * dx, dq * dx, -dr * dx)


ratio.defjvp(_ratio_jvp, symbolic_zeros=True)


def ratio_and_over_x(nu, x):
    nu, x = jnp.broadcast_arrays(*as_float(nu, x))
    return ratio(nu, x)[:2]


def bessel_ratio(nu: Float[ArrayLike, "..."], x: Float[ArrayLike, "..."]) -> Float[Array, "..."]:
    """The ratio I_{ν+1}(x) / I_ν(x) of modified Bessel functions of the first kind.

    Computed by the backward recurrence r_ν = x / (2(ν+1) + x r_{ν+1}) (the Gauss continued
    fraction) started from an Amos-type estimate at order ν + 320; pure JAX, finite and
    accurate for ν > −1 (orders up to several hundred) and 0 ≤ x ≲ 1e4, where the Bessel
    functions themselves over- or underflow. Derivatives with respect to x use
    r' = 1 − r² − (2ν+1) r / x in a cancellation-free form and can be taken to any order; the
    order ν is not differentiable. (Bal 2023, App. A.4.)

    **Arguments:**

    - `nu`: order ν > −1, any shape broadcastable with `x`.
    - `x`: argument x ≥ 0.

    **Returns:** the ratio, in [0, 1), with the broadcast shape of the inputs.
    """
    return ratio_and_over_x(nu, x)[0]



def inverse_ratio(nu, t):
    """x ≥ 0 with r_ν(x) = t, for 0 ≤ t < 1 and ν ≥ 0.

    Newton's method in u = log x on F(u) = −log(1 − r_ν(eᵘ)) + log(1 − t), which is increasing
    and convex in u (≈ eᵘ/(2ν+2) for small x, ≈ log x for large x, ≈ 2x when ν = −½), so the
    iteration converges monotonically after its first step. It starts from the inverse of the
    Amos-type estimate r ≈ x / (ν + ½ + √((ν+1)² + x²))."""
    tiny = jnp.finfo(t.dtype).tiny
    positive = t > 0
    # ‖m‖/R can round to ≥ 1 when the spin is saturated: keep the root finite
    t = jnp.clip(jnp.where(positive, t, 0.5), 0.0, 1.0 - jnp.finfo(t.dtype).eps)
    # (1−t²)x² − 2t(ν+½)x + t²((ν+½)² − (ν+1)²) = 0
    a = 1.0 - t * t
    b = t * (nu + 0.5)
    c = t * t * ((nu + 0.5) ** 2 - (nu + 1.0) ** 2)
    x0 = (b + jnp.sqrt(b * b - a * c)) / a

    def newton(u, t):
        x = jnp.exp(u)
        r, q, s = ratio(nu, x)
        dr, _ = ratio_derivatives(nu, x, r, q, s)
        s = jnp.maximum(s, tiny)
        F = jnp.log1p(-t) - jnp.log(s)
        dF = x * dr / s
        # The same slope for the Amos-type estimate r_A = x/den, den = ν+½+√((ν+1)²+x²):
        # within a factor 2 of the true one everywhere, and free of the cancellation
        # that limits r' in float32 when x ≫ ν. Used where the computed slope is off.
        root = jnp.sqrt((nu + 1.0) ** 2 + x * x)
        den = nu + 0.5 + root
        s_a = (nu + 0.5 + (nu + 1.0) ** 2 / (root + x)) / den
        dF_a = x * (nu + 0.5 + (nu + 1.0) ** 2 / root) / (den * den * s_a)
        ok = jnp.isfinite(dF) & (dF > 0.25 * dF_a) & (dF < 4.0 * dF_a)
        dF = jnp.maximum(jnp.where(ok, dF, dF_a), tiny)
        return u - jnp.clip(F / dF, -4.0, 4.0)  # at most a factor e⁴ in x per step

    # converge without tracing gradients, then one live step: its derivative with respect
    # to t is the implicit-function derivative of the converged root
    t_stop = jax.lax.stop_gradient(t)
    u = jnp.log(jnp.maximum(jax.lax.stop_gradient(x0), tiny))
    for _ in range(12):
        u = newton(u, t_stop)
    x = jnp.exp(newton(jax.lax.stop_gradient(u), t))
    return jnp.where(positive, x, 0.0)
