"""Vector spins out of equilibrium: the von Mises–Fisher sampler against closed forms, and the
first-order Plefka[t−1,t] delayed correlations and entropy production (`vector`) against
Monte Carlo of the parallel kinetics (`samplers.simulate_vector_kinetics`)."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.special as sp
import scipy.stats

from spinformer.spins import samplers, vector

# long Monte Carlo chains: optimised code saves more than its compile costs
pytestmark = pytest.mark.usefixtures("optimized_compiles")
# ... except the short programs (one draw of every sampler, one step of the kinetics), which
# compile without them (`xla_optimizations(False)`): there the compile is the bulk (measured:
# the samplers' program 17 s unoptimised against 47 s optimised, one kinetics step 4 s
# against 10 s, runs included).

# ----------------------------------------------------------------------------- sampler

VMF_DIMS = (2, 3, 8, 16)
VMF_KAPPAS = np.array([0.0, 0.3, 2.0, 20.0, 1e4])
VMF_BETA, VMF_R = 1.3, 1.7
VMF_SAMPLES = 20_000


@jax.jit
def _vmf_batch(key, thetas):
    keys = jax.random.split(key, len(thetas))
    return [samplers.von_mises_fisher(k, t, beta=VMF_BETA, R=VMF_R, num_samples=VMF_SAMPLES)
            for k, t in zip(keys, thetas)]


def _directions(rng, D, k):
    u = rng.normal(size=(k, D))
    return u / np.linalg.norm(u, axis=1, keepdims=True)


@pytest.fixture(scope="module")
def vmf_samples(xla_optimizations):
    """For every D: fields of concentration κ = βR‖θ‖ ∈ VMF_KAPPAS in random directions,
    and `VMF_SAMPLES` spins in each, drawn in one compiled call."""
    rng = np.random.default_rng(0)
    thetas = [(_directions(rng, D, len(VMF_KAPPAS)) * VMF_KAPPAS[:, None] / (VMF_BETA * VMF_R))
              .astype(np.float32) for D in VMF_DIMS]
    with xla_optimizations(False):
        samples = _vmf_batch(jax.random.key(0), [jnp.asarray(t) for t in thetas])
    return {D: (t, np.asarray(s, np.float64)) for D, t, s in zip(VMF_DIMS, thetas, samples)}


def _bessel_mean(D, kappa, R=VMF_R):
    """R I_{D/2}(κ)/I_{D/2−1}(κ) from scipy (0 at κ = 0), float64."""
    with np.errstate(all="ignore"):
        r = sp.ive(D / 2.0, kappa) / sp.ive(D / 2.0 - 1.0, kappa)
    return R * np.where(kappa > 0, r, 0.0)


def test_vmf_mean_matches_bessel_ratio(vmf_samples):
    for D, (theta, s) in vmf_samples.items():
        mean = s.mean(axis=0)  # (K, D)
        se = s.std(axis=0) / np.sqrt(len(s))
        u = theta / np.maximum(np.linalg.norm(theta, axis=1, keepdims=True), 1e-30)
        exact = _bessel_mean(D, VMF_KAPPAS)[:, None] * u
        # 5 standard errors, plus float32 rounding of the samples (relevant at κ = 1e4,
        # where the spread along θ is ~1e-4 R)
        np.testing.assert_array_less(np.abs(mean - exact), 5 * se + 1e-6, err_msg=f"D={D}")
        lib = vector.magnetization(theta, beta=VMF_BETA, R=VMF_R, large_d=False)
        np.testing.assert_allclose(np.asarray(lib), exact, atol=2e-5 * VMF_R)


def _angle_cdf(D, kappa):
    """CDF of the angle φ between s and θ, density ∝ exp(κ(cos φ − 1)) sin^{D−2} φ on
    [0, π] (smooth for every D ≥ 2), by trapezoidal integration on a grid refined at φ = 0."""
    u = np.linspace(0.0, 1.0, 400_001)
    phi = np.pi * u**2
    dens = np.exp(kappa * (np.cos(phi) - 1.0)) * np.sin(phi) ** (D - 2) * (2 * np.pi * u)
    cdf = np.concatenate([[0.0], np.cumsum(0.5 * (dens[1:] + dens[:-1]) * np.diff(u))])
    cdf /= cdf[-1]
    return lambda a: np.interp(a, phi, cdf)


def test_vmf_angle_distribution_ks(vmf_samples):
    """The cosine w = cos φ has density ∝ exp(κw)(1 − w²)^((D−3)/2); test the angle φ
    (computed from the orthogonal part, accurate where w rounds to 1 at large κ)."""
    for D, (theta, s) in vmf_samples.items():
        u = theta / np.maximum(np.linalg.norm(theta, axis=1, keepdims=True), 1e-30)
        for k, kappa in enumerate(VMF_KAPPAS):
            if kappa == 0:  # any direction: use the first axis
                u_k = np.eye(D)[0]
            else:
                u_k = u[k]
            along = s[:, k] @ u_k
            perp = np.linalg.norm(s[:, k] - along[:, None] * u_k, axis=1)
            phi = np.arctan2(perp, along)
            p = scipy.stats.kstest(phi, _angle_cdf(D, kappa)).pvalue
            assert p > 1e-4, (D, kappa, p)


def test_vmf_norms_and_uniform_limit(vmf_samples):
    for D, (_, s) in vmf_samples.items():
        np.testing.assert_allclose(np.linalg.norm(s, axis=-1), VMF_R, rtol=2e-6)
        uniform = s[:, 0]  # κ = 0: uniform on the sphere, ⟨s sᵀ⟩ = R²/D · 1
        second = uniform.T @ uniform / len(uniform)
        np.testing.assert_allclose(second, VMF_R**2 / D * np.eye(D), atol=0.04 * VMF_R**2)


def test_kinetics_errors():
    x, J, key = jnp.ones((3, 4)), jnp.zeros((3, 3)), jax.random.key(0)
    for kw in [dict(x=jnp.ones((3, 1))), dict(J=jnp.zeros((2, 2))), dict(steps=0),
               dict(num_chains=1), dict(beta=-1.0), dict(s0=jnp.ones((2, 4))),
               dict(x=jnp.ones((5, 3, 4)))]:
        args = dict(key=key, x=x, J=J, steps=2, num_chains=4) | kw
        with pytest.raises(ValueError):
            samplers.simulate_vector_kinetics(args.pop("key"), args.pop("x"), args.pop("J"),
                                              **args)


def test_vmf_shapes_and_errors():
    key = jax.random.key(1)
    shape = lambda *a, **kw: jax.eval_shape(  # noqa: E731
        partial(samplers.von_mises_fisher, **kw), *a).shape
    assert shape(key, jnp.ones((2, 5, 4))) == (2, 5, 4)
    assert shape(key, jnp.ones(3), num_samples=7) == (7, 3)
    for theta, kw in [(jnp.float32(1.0), {}), (jnp.ones((4, 1)), {}),
                      (jnp.ones(3), {"beta": 0.0}), (jnp.ones(3), {"R": -1.0}),
                      (jnp.ones(3), {"num_samples": 0})]:
        with pytest.raises(ValueError):
            samplers.von_mises_fisher(key, theta, **kw)


# ----------------------------------------------------------------------------- kinetics

# (the weak couplings relax in a few steps: the tests' margins, over seeds, are those of
# 200 steps and a burn-in of 40 but for the noise, ~1.4x; the symmetric test pools two runs)
STEPS, BURN, CHAINS, GROUPS = 100, 20, 1024, 4
_STATIC = ("steps", "burn", "chains", "groups", "rao_blackwell")
# XLA's options for a program run once on small arrays (what `xla_optimizations(False)` sets),
# and for D = 32's chains: level 1 compiled them in 3 s against the default's 10 s (runs
# alike: 1.3 s)
UNOPTIMIZED = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
LEVEL_1 = {"xla_backend_optimization_level": 1}


def _stationary(key, x, J, beta, R, *, steps=STEPS, burn=BURN, chains=CHAINS, groups=GROUPS,
                rao_blackwell=True):
    """Stationary m and connected delayed correlations D_ij = ⟨δs_i,t·δs_j,t−1⟩ from `groups`
    independent runs (for error bars), each averaged over the steps after `burn`:
    `(groups, n, D)`, `(groups, n, n)`."""
    mo = jax.vmap(lambda k: samplers.simulate_vector_kinetics(
        k, x, J, beta=beta, R=R, steps=steps, num_chains=chains, rao_blackwell=rao_blackwell)
    )(jax.random.split(key, groups))
    return mo.mean[:, burn:].mean(axis=1), mo.delayed[:, burn:].mean(axis=1)


_STATIONARY = {None: jax.jit(_stationary, static_argnames=_STATIC),
               1: jax.jit(_stationary, static_argnames=_STATIC, compiler_options=LEVEL_1)}


def _mc(seed, x, J, beta=1.0, R=1.0, level=None, runs=1, **kw):
    """Monte Carlo summary: m, D, its standard error, σ_MC per group → (mean, se), over the
    groups of `runs` runs. `level`: XLA's optimisation level (None: as the module
    compiles)."""
    keys = jax.random.split(jax.random.key(seed), runs) if runs > 1 else [jax.random.key(seed)]
    m, D = zip(*(_STATIONARY[level](k, jnp.asarray(x, jnp.float32),
                                     jnp.asarray(J, jnp.float32), beta, R, **kw) for k in keys))
    m, D = np.concatenate(m, dtype=np.float64), np.concatenate(D, dtype=np.float64)
    sig = beta * np.sum((J - J.T) * D, axis=(1, 2))
    g = len(D)
    return dict(m=m.mean(0), D=D.mean(0), D_se=D.std(0, ddof=1) / np.sqrt(g),
                sigma=sig.mean(), sigma_se=sig.std(ddof=1) / np.sqrt(g))


@partial(jax.jit, static_argnames="large_d", compiler_options=UNOPTIMIZED)
def _first_order_jit(m, m_prev, J, beta, R, large_d):
    D = vector.delayed_correlations(m, m_prev, J, beta=beta, R=R, large_d=large_d)
    return D, vector.entropy_production(J, D, beta=beta)


def _first_order(m, J, beta=1.0, R=1.0, large_d=False, m_prev=None):
    """First-order D_ij and σ at magnetizations m (and m_prev, default m), as float64."""
    m_prev = m if m_prev is None else m_prev
    f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
    D, sigma = _first_order_jit(f32(m), f32(m_prev), f32(J), beta, R, large_d)
    return np.asarray(D, np.float64), float(sigma)


N, DIM = 4, 3
_rng = np.random.default_rng(3)
X = (0.7 * _rng.normal(size=(N, DIM))).astype(np.float32)
A = _rng.normal(size=(N, N)).astype(np.float32)  # asymmetric coupling pattern


def test_decoupled_kinetics(xla_optimizations):
    """J = 0: m = φ(x) (the exact Bessel mean) and no delayed correlations. Every step is
    stationary (θ = x whatever the previous spins): one step of the program of
    `test_transient_sigma_can_be_negative` (compiled once for both)."""
    with xla_optimizations(False):
        out = _mc(0, X, np.zeros((N, N), np.float32), **TRANSIENT)
    norm = np.linalg.norm(X, axis=1, keepdims=True)  # κ = βR‖x‖ = ‖x‖
    exact = _bessel_mean(DIM, norm, R=1.0) * X / norm
    np.testing.assert_allclose(out["m"], exact, atol=3e-3)
    np.testing.assert_allclose(out["D"], 0.0, atol=5 * out["D_se"].max() + 1e-4)


@pytest.fixture(scope="module")
def weak_couplings():
    """Stationary MC at couplings J = g·A for g = 0.5 and 0.25 (β = R = 1, D = 3)."""
    return {g: _mc(10, X, g * A) for g in (0.5, 0.25)}


def test_delayed_correlations_first_order_scaling(weak_couplings):
    """MC D_ij vs β J_ij tr(V_i V_j) with exact-D covariances at the MC magnetizations.

    The formula is the first order in J, so its error must be O((βJ)²): halving the couplings
    must shrink the Frobenius error at least ~4× (we require an exponent > 1.7, which leaves
    room for the MC noise; measured ≈ 2.6, since the J² term is proportional to the spins'
    third moments, which are small at these fields). Relative errors: measured 7.8 % at
    g = 0.5 and 2.4 % at g = 0.25; the noise is ~1/15 of the error at g = 0.25."""
    err = {}
    for g, out in weak_couplings.items():
        D1, _ = _first_order(out["m"], g * A)
        err[g] = np.linalg.norm(out["D"] - D1)
        rel = err[g] / np.linalg.norm(out["D"])
        assert rel < {0.5: 0.12, 0.25: 0.04}[g], (g, rel)
        noise = np.linalg.norm(out["D_se"])
        assert err[g] > 3 * noise, (g, err[g], noise)  # the error is resolved, not noise
    exponent = np.log2(err[0.5] / err[0.25])
    assert exponent > 1.7, exponent


def test_entropy_production_matches_and_is_positive(weak_couplings):
    """σ_MC = β Σ (J_ij − J_ji) D_ij^MC is the exact stationary entropy production (a KL
    divergence): positive for asymmetric J, and matched by the first-order formula to
    O(βJ) relative accuracy."""
    for g, out in weak_couplings.items():
        assert out["sigma"] > 10 * out["sigma_se"], (g, out["sigma"], out["sigma_se"])
        _, s1 = _first_order(out["m"], g * A)
        assert s1 > 0
        # measured 8.9 % and 2.8 %
        assert abs(s1 - out["sigma"]) < {0.5: 0.15, 0.25: 0.05}[g] * out["sigma"], (g, s1)


def test_symmetric_couplings_detailed_balance():
    """Symmetric J: the parallel dynamics is reversible, so D_ij = D_ji and every
    antisymmetric weighting of D (σ with J − Jᵀ is one, identically zero) vanishes to MC
    error, although the delayed correlations themselves are large."""
    Js = 0.3 * (A + A.T)
    out = _mc(11, X, Js, runs=2)
    anti = out["D"] - out["D"].T
    bound = 5 * np.sqrt(out["D_se"] ** 2 + out["D_se"].T ** 2) + 1e-4
    np.testing.assert_array_less(np.abs(anti), bound)
    assert np.abs(out["D"]).max() > 50 * bound.max()
    D1, s1 = _first_order(out["m"], Js)
    np.testing.assert_allclose(s1, 0.0, rtol=0, atol=1e-7)


def test_entropy_production_scales_as_beta_squared():
    """At x = 0 the steady state has m = 0 and V = R²/D, so to first order σ = β² Σ_ij
    (J_ij − J_ji) J_ij R⁴/D: doubling β multiplies σ by 4, up to relative corrections
    O((βJ)²) (measured ratio ≈ 3.8–4.0 at these couplings)."""
    x0 = np.zeros((N, DIM), np.float32)
    J = 0.25 * A
    s = {b: _mc(12, x0, J, beta=b) for b in (0.5, 1.0)}
    ratio = s[1.0]["sigma"] / s[0.5]["sigma"]
    ratio_se = ratio * np.hypot(s[1.0]["sigma_se"] / s[1.0]["sigma"],
                                s[0.5]["sigma_se"] / s[0.5]["sigma"])
    assert abs(ratio - 4.0) < 0.4 + 3 * ratio_se, (ratio, ratio_se)
    for b, out in s.items():
        np.testing.assert_allclose(out["m"], 0.0, atol=0.01)
        predicted = b**2 * np.sum((J - J.T) * J) / DIM
        assert abs(out["sigma"] - predicted) < 0.1 * predicted, (b, out["sigma"], predicted)


TRANSIENT = dict(steps=1, burn=0, chains=4096, groups=16)  # the first step alone


def _pad(a, rows, cols=None):
    """Zero-pad a 2-spin array to N spins (free extra spins contribute nothing to σ), to
    reuse the functions compiled for n = N."""
    return np.pad(a, ((0, N - rows), (0, 0 if cols is None else N - cols)))


def test_transient_sigma_can_be_negative(xla_optimizations):
    """Off the steady state σ_t = β Σ (J_ij − J_ji) D_ij,t is not the entropy production
    (the field and log-normaliser terms of the transition log-ratio no longer cancel), and
    it can be negative — in the first-order formula and in the exact (MC) delayed
    correlations alike. Two spins, J_12 = 1, J_21 = 0.9, uniform spins at t − 1 (m = 0) and
    a strong field on spin 1 at t: spin 1 fluctuates less at t than spin 2, so
    c_12 = tr(V_1,t V_2,t−1) < c_21 and σ_t = β²(J_12 − J_21)(J_12 c_12 − J_21 c_21) < 0.
    The steady state of the same system has σ > 0."""
    J = _pad(np.array([[0.0, 1.0], [0.9, 0.0]], np.float32), 2, 2)
    x = np.zeros((N, DIM), np.float32)
    x[0, 0] = 3.0
    with xla_optimizations(False):
        first = _mc(5, x, J, **TRANSIENT)  # m_1 and D_ij,1
        raw = _mc(6, x, J, **TRANSIENT, rao_blackwell=False)
    _, s_first = _first_order(first["m"], J, m_prev=np.zeros((N, DIM)))
    assert s_first < 0 and first["sigma"] < -10 * first["sigma_se"], (s_first, first)
    assert abs(s_first - first["sigma"]) < 0.1 * abs(first["sigma"])  # measured 3.5 %
    assert abs(raw["sigma"] - first["sigma"]) < 4 * np.hypot(raw["sigma_se"], first["sigma_se"])
    assert raw["sigma_se"] > 3 * first["sigma_se"]  # what the conditional means save
    steady = _mc(13, x, J)
    assert steady["sigma"] > 10 * steady["sigma_se"]
    _, s_steady = _first_order(steady["m"], J)
    assert s_steady > 0


def test_first_order_sigma_sign():
    """The formula with c_ij = tr(V_i,t V_j,t−1) ≥ 0: σ ≥ 0 in a steady state (c symmetric)
    and for causal couplings (J_ij = 0 for j > i) in any state; random transients of the
    nearly symmetric couplings above give some σ < 0."""
    rng = np.random.default_rng(7)

    def rand_m():
        v = rng.normal(size=(N, DIM))
        v /= np.linalg.norm(v, axis=-1, keepdims=True)
        return v * rng.uniform(0, 0.95, size=(N, 1))

    J_near = _pad(np.array([[0.0, 1.0], [0.9, 0.0]]), 2, 2)
    for large_d in (False, True):
        transient = []
        for _ in range(12):
            m_t, m_p, J = rand_m(), rand_m(), rng.normal(size=(N, N))
            assert _first_order(m_t, J, large_d=large_d)[1] > -1e-6
            assert _first_order(m_t, np.tril(J), m_prev=m_p, large_d=large_d)[1] > -1e-6
            transient.append(_first_order(m_t, J_near, m_prev=m_p, large_d=large_d)[1])
        assert min(transient) < -1e-3 < max(transient), (large_d, transient)


def test_large_d_form_at_dimension_32():
    """D = 32, R² = D/2 − 1 (the attention's convention): the exact-D first order stays
    within MC error, and the large-D covariances overestimate tr(V_i V_j) by ≈ 4/D (at m = 0:
    D/4 against R⁴/D = D/4 − 1 + 1/D), so the large-D D_ij is off by 5–16 % (measured ≈ 11 %)."""
    n, D = 3, 32
    R = float(np.sqrt(D / 2 - 1))
    rng = np.random.default_rng(4)
    x = (rng.normal(size=(n, D)) * np.sqrt(D) * 0.7 / R).astype(np.float32)
    J = (0.4 * rng.normal(size=(n, n)) / R**2).astype(np.float32)
    out = _mc(14, x, J, R=R, level=1, steps=120, burn=20, chains=256)
    D_exact, _ = _first_order(out["m"], J, R=R)
    D_large, _ = _first_order(out["m"], J, R=R, large_d=True)
    scale = np.linalg.norm(out["D"])
    rel_exact = np.linalg.norm(out["D"] - D_exact) / scale
    rel_large = np.linalg.norm(out["D"] - D_large) / scale
    noise = np.linalg.norm(out["D_se"]) / scale
    assert rel_exact < 0.02 + 3 * noise, (rel_exact, noise)
    assert 0.05 < rel_large < 0.16, rel_large
