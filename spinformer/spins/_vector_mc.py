"""Monte Carlo of vector spins: exact von Mises–Fisher draws on the sphere and the parallel
kinetics of M. Bal, "Spin-Model Transformers" (2023) and "Entropy Production in
Non-Equilibrium Neural Networks" (2026), mcbal.github.io. Public through
`spinformer.spins.samplers` (`von_mises_fisher`, `simulate_vector_kinetics`).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Float, PRNGKeyArray

from ._common import HIGHEST, Scalar, as_float
from ._common import check_int as _check_int


# ----------------------------------------------------------------------------- vector spins
#
# Vector spins s ∈ ℝ^D on the sphere of radius R with density ∝ exp(β s·θ) (`vector`), and
# the parallel kinetics P(s_t | s_{t−1}) = Π_i p(s_i,t | θ_i = x_i + Σ_j J_ij s_j,t−1) of
# M. Bal, "Spin-Model Transformers" (2023) and "Entropy Production in Non-Equilibrium Neural
# Networks" (2026), mcbal.github.io.

_VMF_MAX_ROUNDS = 200  # Wood's acceptance rate exceeds 0.65 for every D and κ
_VMF_CHI2_MAX_DIM = 33  # Beta draws from normals up to this D, from gammas above


def _is_concrete(value):
    return not isinstance(value, jax.core.Tracer)


def _check_positive(name, what, value):
    if _is_concrete(value) and np.any(np.asarray(value) <= 0):
        raise ValueError(f"{name}: {what} must be > 0, got {value!r}.")


def _check_vector_field(name, what, theta):
    if jnp.ndim(theta) < 1:
        raise ValueError(f"{name}: {what} must have a trailing vector dimension D, got a "
                         "scalar.")
    if jnp.shape(theta)[-1] < 2:
        raise ValueError(f"{name}: spins on a sphere need D >= 2 components, got D = "
                         f"{jnp.shape(theta)[-1]} ({what} of shape {jnp.shape(theta)}); "
                         "D = 1 is the binary Ising case (`gibbs`).")


def _symmetric_beta(key, D, shape, dt):
    """Beta((D−1)/2, (D−1)/2) variates: X/(X+Y) with X, Y ~ χ²_{D−1} as sums of squared
    normals for small D (far cheaper than JAX's gamma sampler), from gammas otherwise."""
    if D <= _VMF_CHI2_MAX_DIM:
        g = jax.random.normal(key, (2, D - 1) + shape, dt) ** 2
        x, y = jnp.sum(g[0], axis=0), jnp.sum(g[1], axis=0)
        return x / (x + y)
    half = (D - 1.0) / 2.0
    return jax.random.beta(key, half, half, shape, dt)


def _wood_cosine(key, kappa, D):
    """The cosine w = s·μ/R of von Mises–Fisher samples with concentrations `kappa` (a 1-d
    array) on the sphere S^{D−1}, by Wood's (1994) rejection sampler.

    Wood proposes w = (1 − (1+b)z)/(1 − (1−b)z), z ~ Beta((D−1)/2, (D−1)/2),
    b = (D−1)/(2κ + √(4κ² + (D−1)²)), and accepts when
    κw + (D−1) log(1 − x₀w) − c ≥ log u (x₀ = (1−b)/(1+b), c = κx₀ + (D−1) log(1 − x₀²)).
    With q = 1 − (1−b)z, 1 − w = 2bz/q, 1 + w = 2(1−z)/q and 1 − x₀w = 2b/((1+b)q), so the
    test is κ(2b/(1+b) − 2bz/q) + (D−1) log((1+b)/(2q)) ≥ log u: every term is O(1) and free
    of cancellations however large κ is.

    Every spin gets one proposal; the rejected ones (about a third) are then gathered into a
    buffer of N/8 slots and proposed again until none is left, so the work stays ≈ 1.5N
    proposals where re-proposing for all N spins until the last is accepted would cost
    ~log N rounds of N. Returns `(w, 1 − w, 1 + w)`, NaN where nothing was accepted within
    `_VMF_MAX_ROUNDS` rounds (only for non-finite κ).
    """
    (N,) = kappa.shape
    dt = kappa.dtype
    d1 = jnp.asarray(D - 1.0, dt)
    b = d1 / (2.0 * kappa + jnp.sqrt(4.0 * kappa**2 + d1**2))

    def propose(key, k, b_):
        k_z, k_u = jax.random.split(key)
        z = _symmetric_beta(k_z, D, k.shape, dt)
        log_u = jnp.log(jax.random.uniform(k_u, k.shape, dt))
        q = 1.0 - (1.0 - b_) * z
        log_ratio = k * (2.0 * b_ / (1.0 + b_) - 2.0 * b_ * z / q) + d1 * jnp.log(
            (1.0 + b_) / (2.0 * q))
        return z, log_ratio >= log_u

    key, k_first = jax.random.split(key)
    z, done = propose(k_first, kappa, b)
    K = max(1, N // 8)

    def cond(state):
        _, rounds, done, _ = state
        return (rounds < _VMF_MAX_ROUNDS) & ~jnp.all(done)

    def body(state):
        key, rounds, done, z = state
        key, k_round = jax.random.split(key)
        (idx,) = jnp.nonzero(~done, size=K, fill_value=N)  # N: an empty slot
        take = lambda a: jnp.take(a, idx, mode="clip")  # noqa: E731 (an empty slot reads N − 1)
        z_new, accept = propose(k_round, take(kappa), take(b))
        z = z.at[idx].set(z_new, mode="drop")  # empty slots are dropped
        done = done.at[idx].set(accept, mode="drop")
        return key, rounds + 1, done, z

    _, _, done, z = jax.lax.while_loop(cond, body, (key, jnp.zeros((), jnp.int32), done, z))
    z = jnp.where(done, z, jnp.nan)
    q = 1.0 - (1.0 - b) * z
    return (1.0 - (1.0 + b) * z) / q, 2.0 * b * z / q, 2.0 * (1.0 - z) / q


def _vmf(key, theta, beta, R):
    """Samples with the shape of `theta` (..., D); no checks."""
    D = theta.shape[-1]
    sq = jnp.sum(theta * theta, axis=-1)
    pos = sq > 0
    norm = jnp.where(pos, jnp.sqrt(jnp.where(pos, sq, 1.0)), 0.0)
    e1 = jnp.zeros((D,), theta.dtype).at[0].set(1.0)
    mu = jnp.where(pos[..., None], theta / jnp.where(pos, norm, 1.0)[..., None], e1)
    k_w, k_v = jax.random.split(key)
    kappa = (beta * R * norm).reshape(-1)
    w, one_minus_w, one_plus_w = (a.reshape(norm.shape) for a in _wood_cosine(k_w, kappa, D))
    # a uniform direction orthogonal to μ: project a Gaussian vector and normalise it
    # (projected twice: when the Gaussian lies close to ±μ — often in D = 2 — one projection
    # leaves a parallel rounding error that normalising magnifies)
    v = jax.random.normal(k_v, theta.shape, theta.dtype)
    for _ in range(2):
        v = v - jnp.sum(v * mu, axis=-1, keepdims=True) * mu
        v = v / jnp.sqrt(jnp.sum(v * v, axis=-1, keepdims=True))
    sin = jnp.sqrt(jnp.maximum(one_minus_w * one_plus_w, 0.0))
    return R * (w[..., None] * mu + sin[..., None] * v)


def von_mises_fisher(
    key: PRNGKeyArray,
    theta: Float[ArrayLike, "... D"],
    *,
    beta: Scalar = 1.0,
    R: Scalar = 1.0,
    num_samples: int | None = None,
) -> Float[Array, "... D"]:
    """Exact samples of vector spins on the sphere of radius R in ℝ^D with density
    ∝ exp(β s·θ), one independent spin per leading index of θ.

    This is the von Mises–Fisher distribution with mean direction θ/‖θ‖ and concentration
    κ = βR‖θ‖; its mean is `vector.magnetization(theta, beta=beta, R=R, large_d=False)`
    (M. Bal, "Spin-Model Transformers" (2023), App. A.2). The cosine w between s and θ,
    whose density is ∝ exp(κw)(1 − w²)^((D−3)/2) on [−1, 1], is drawn by Wood's rejection
    algorithm (A. T. A. Wood, "Simulation of the von Mises Fisher distribution",
    Communications in Statistics — Simulation and Computation 23, 157 (1994)), with the
    acceptance test rearranged so it stays exact for large κ (tested up to κ = 10⁴ in float32);
    all spins are proposed in parallel and the loop runs until every one is accepted (about
    two rounds on average). The component orthogonal to θ is a uniform direction scaled by
    √(1 − w²). θ = 0 gives the uniform distribution on the sphere.

    **Arguments:**

    - `key`: a PRNG key.
    - `theta`: fields `(..., D)`, D ≥ 2 (D = 1 is the Ising case).
    - `beta`: inverse temperature > 0; `R`: sphere radius > 0 (scalars).
    - `num_samples`: if given, that many independent samples of every spin.

    **Returns:** spins of shape `theta.shape`, or `(num_samples, *theta.shape)`; each has
    norm R (to rounding).
    """
    name = "von_mises_fisher"
    _check_vector_field(name, "theta", theta)
    _check_positive(name, "beta", beta)
    _check_positive(name, "R", R)
    if num_samples is not None:
        _check_int(name, "num_samples", num_samples, 1)
    theta, beta, R = as_float(theta, beta, R)
    if jnp.ndim(beta) or jnp.ndim(R):
        raise ValueError(f"{name}: beta and R must be scalars, got shapes {jnp.shape(beta)} "
                         f"and {jnp.shape(R)}.")
    if num_samples is not None:
        theta = jnp.broadcast_to(theta, (num_samples,) + theta.shape)
    return _vmf(key, theta, beta, R)


class KineticsMoments(NamedTuple):
    """Ensemble averages over parallel chains of the vector kinetics, one row per step
    (`simulate_vector_kinetics`).

    - `mean`: `(steps, n, D)`, the magnetizations m_i,t = ⟨s_i,t⟩.
    - `delayed`: `(steps, n, n)`, the connected delayed correlations
      D_ij,t = ⟨(s_i,t − m_i,t)·(s_j,t−1 − m_j,t−1)⟩, as the unbiased sample covariance
      across chains (centred on the chains' own means, so the noise of those means drops out).
    - `final`: `(num_chains, n, D)`, the last configuration of every chain (to continue).
    """

    mean: Float[Array, "steps n D"]
    delayed: Float[Array, "steps n n"]
    final: Float[Array, "chains n D"]


def simulate_vector_kinetics(
    key: PRNGKeyArray,
    x: Float[ArrayLike, "n D"] | Float[ArrayLike, "steps n D"],
    J: Float[ArrayLike, "n n"],
    *,
    beta: Scalar = 1.0,
    R: Scalar = 1.0,
    steps: int,
    num_chains: int,
    s0: Float[ArrayLike, "n D"] | Float[ArrayLike, "chains n D"] | None = None,
    rao_blackwell: bool = True,
) -> KineticsMoments:
    """Monte Carlo of the kinetic vector-spin model: `num_chains` independent chains of

        P(s_t | s_{t−1}) = Π_i p(s_i,t | θ_i,t),  θ_i,t = x_i,t + Σ_j J_ij s_j,t−1,

    with p(s | θ) ∝ exp(β s·θ) on the sphere of radius R (`von_mises_fisher`): every spin is
    redrawn at once from the previous configuration (a parallel, Little-type update), the
    dynamics whose first-order Plefka[t−1,t] mean field is `vector.mean_field_step` (M. Bal,
    "Spin-Model Transformers" (2023); "Entropy Production in Non-Equilibrium Neural
    Networks" (2026)). Only ensemble averages are kept, one row per step (the trajectory
    itself would take steps·chains·n·D numbers).

    With `rao_blackwell=True` (default) the averages use the exact conditional mean of the
    new spin, E[s_i,t | s_{t−1}] = φ(θ_i,t) (`vector.magnetization(..., large_d=False)`),
    in place of the sampled s_i,t: m_i,t = ⟨φ(θ_i,t)⟩ and ⟨s_i,t·s_j,t−1⟩ = ⟨φ(θ_i,t)·s_j,t−1⟩
    hold exactly, and the estimates have far lower variance (at weak coupling φ(θ_i,t)
    varies by O(βJ) where s_i,t varies by O(R)). The chains themselves always evolve by
    exact sampling. A stationary estimate averages the rows after a burn-in.

    **Arguments:**

    - `key`: a PRNG key.
    - `x`: fields `(n, D)`, constant in time, or `(steps, n, D)`, the field of every step.
    - `J`: couplings `(n, n)` (any matrix); `beta` > 0, `R` > 0: scalars.
    - `steps`: number of updates (Python int ≥ 1); `num_chains`: parallel chains (≥ 2).
    - `s0`: initial configuration `(n, D)` shared by all chains or `(num_chains, n, D)`, on
      the sphere of radius R; default independent uniform spins.
    - `rao_blackwell`: average conditional means (see above) or the sampled spins.

    **Returns:** a `KineticsMoments` with rows t = 1..steps (row 0 is the first update).
    Independent runs (vmap over keys) give independent estimates, hence error bars.
    """
    name = "simulate_vector_kinetics"
    if jnp.ndim(x) not in (2, 3):
        raise ValueError(f"{name}: x must have shape (n, D) or (steps, n, D), got "
                         f"{jnp.shape(x)}.")
    _check_vector_field(name, "x", x)
    n, D = jnp.shape(x)[-2:]
    if jnp.shape(J) != (n, n):
        raise ValueError(f"{name}: J must have shape ({n}, {n}) for x of shape "
                         f"{jnp.shape(x)}, got {jnp.shape(J)}.")
    _check_int(name, "steps", steps, 1)
    _check_int(name, "num_chains", num_chains, 2)
    if jnp.ndim(x) == 3 and jnp.shape(x)[0] != steps:
        raise ValueError(f"{name}: time-dependent x must have steps = {steps} rows, got "
                         f"{jnp.shape(x)[0]}.")
    _check_positive(name, "beta", beta)
    _check_positive(name, "R", R)
    x, J, beta, R = as_float(x, J, beta, R)
    if jnp.ndim(beta) or jnp.ndim(R):
        raise ValueError(f"{name}: beta and R must be scalars, got shapes {jnp.shape(beta)} "
                         f"and {jnp.shape(R)}.")
    from .vector import magnetization

    k0, k_run = jax.random.split(key)
    if s0 is None:
        s = _vmf(k0, jnp.zeros((num_chains, n, D), x.dtype), beta, R)
    else:
        if jnp.shape(s0) not in ((n, D), (num_chains, n, D)):
            raise ValueError(f"{name}: s0 must have shape ({n}, {D}) or ({num_chains}, {n}, "
                             f"{D}), got {jnp.shape(s0)}.")
        s = jnp.broadcast_to(jnp.asarray(s0, x.dtype), (num_chains, n, D))
    xs = jnp.broadcast_to(x, (steps, n, D)) if x.ndim == 2 else x

    def step(s_prev, inp):
        k, x_t = inp
        theta = x_t + jnp.einsum("ij,cjd->cid", J, s_prev, precision=HIGHEST)
        s_new = _vmf(k, theta, beta, R)
        est = magnetization(theta, beta=beta, R=R, large_d=False) if rao_blackwell else s_new
        mean, mean_prev = est.mean(axis=0), s_prev.mean(axis=0)
        raw = jnp.einsum("cid,cjd->ij", est, s_prev, precision=HIGHEST) / num_chains
        delayed = (raw - mean @ mean_prev.T) * (num_chains / (num_chains - 1.0))
        return s_new, (mean, delayed)

    final, (mean, delayed) = jax.lax.scan(step, s, (jax.random.split(k_run, steps), xs))
    return KineticsMoments(mean=mean, delayed=delayed, final=final)
