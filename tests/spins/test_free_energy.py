"""Steepest-descent free energy of vector spins: closed forms vs autodiff, the saddle, log Z
vs numerical integration, magnetizations vs finite differences, stability and failures."""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.integrate as si
import scipy.special as sp

from spinformer import solvers
from spinformer.spins import free_energy as fe

DS = (3, 10, 30, 100)
TIGHT = fe.SaddleNewton(tol=1e-12)


# ----------------------------------------------------------------------------- references
# Independent numpy/scipy, float64; nothing here calls the module under test.


def random_instance(rng, n, D, scale=1.0, diag=False):
    A = rng.normal(size=(n, n)) * scale / np.sqrt(n)
    J = (A + A.T) / np.sqrt(2.0)
    if not diag:
        np.fill_diagonal(J, 0.0)
    H = rng.normal(size=(n, D))
    return H, J


def log_sphere_area(D):
    """ln of the area of the unit sphere S^{D−1} ⊂ ℝ^D, 2π^{D/2}/Γ(D/2)."""
    return math.log(2.0) + 0.5 * D * math.log(math.pi) - math.lgamma(0.5 * D)


def log_z1(kappa, D):
    """ln ∫ d^Dσ δ(D − |σ|²) exp(b·σ) with κ = √D |b|: ½ D^{(D−2)/2} ∫_{S^{D−1}} e^{κ u·Ω} dΩ
    and ∫ e^{κ u·Ω} dΩ = (2π)^{D/2} κ^{1−D/2} I_{D/2−1}(κ)."""
    pre = math.log(0.5) + 0.5 * (D - 2) * math.log(D)
    if kappa == 0.0:
        return pre + log_sphere_area(D)
    nu = 0.5 * D - 1.0
    return (pre + 0.5 * D * math.log(2 * math.pi) + (1 - 0.5 * D) * math.log(kappa)
            + math.log(sp.ive(nu, kappa)) + kappa)


def log_z2(h1, h2, j, beta, D):
    """Exact ln Z for two spins with J = [[0, j], [j, 0]] (E = −2j σ1·σ2 − h1·σ1 − h2·σ2) and
    parallel raw fields h1 e, h2 e (signed scalars): integrate σ2 in closed form (a von
    Mises–Fisher normaliser with κ2 = β√D|2j√D Ω + h2 e|), then σ1 over the angle θ to e."""
    sD = math.sqrt(D)

    def f(th):
        c = math.cos(th)
        k2 = beta * sD * math.sqrt(max(4 * j * j * D + h2 * h2 + 4 * j * sD * h2 * c, 0.0))
        return (D - 2) * math.log(max(math.sin(th), 1e-300)) + beta * sD * h1 * c + log_z1(k2, D)

    grid = np.linspace(1e-6, math.pi - 1e-6, 2001)
    vals = np.array([f(x) for x in grid])
    fmax, tmax = vals.max(), grid[vals.argmax()]
    integral, _ = si.quad(lambda x: math.exp(f(x) - fmax), 0.0, math.pi, points=[tmax],
                          limit=400, epsabs=0.0, epsrel=1e-12)
    pre = math.log(0.5) + 0.5 * (D - 2) * math.log(D)
    log_s = math.log(2.0) + 0.5 * (D - 1) * math.log(math.pi) - math.lgamma(0.5 * (D - 1))
    return pre + log_s + fmax + math.log(integral)


def np_phi(t, H, J, beta, c):
    V = np.diag(t) - (J + J.T) / 2
    sign, logdet = np.linalg.slogdet(V)
    assert sign > 0
    return beta * t.sum() - 0.5 * logdet + c * np.trace(H.T @ np.linalg.solve(V, H))


def post_hessian(t, H, J, beta):
    """The Hessian exactly as printed in the post (normalised convention)."""
    Vi = np.linalg.inv(np.diag(t) - J)
    B = Vi @ H @ H.T @ Vi
    eye = np.eye(len(t))
    return 0.5 * Vi * Vi + beta / 4 * (B @ Vi * eye) + beta / 4 * (Vi @ B * eye)


# ----------------------------------------------------------------------------- closed forms


@pytest.mark.parametrize("normalized", [False, True])
def test_closed_forms_match_autodiff_and_numpy(normalized, x64):
    rng = np.random.default_rng(0)
    n, D, beta = 6, 5, 0.7
    H, J = random_instance(rng, n, D, diag=True)
    J = J + 0.3 * rng.normal(size=(n, n))  # asymmetric: only the symmetric part counts
    Js = (J + J.T) / 2
    t = np.linalg.eigvalsh(Js)[-1] + 0.2 + rng.uniform(size=n)
    c = beta / 4 if normalized else beta / (4 * D)
    kw = dict(beta=beta, normalized=normalized)


    @jax.jit
    def everything(t):
        def f(t):
            return fe.phi(t, H, J, **kw)

        return (f(t), fe.phi_grad(t, H, J, **kw), jax.grad(f)(t),
                fe.phi_hessian(t, H, J, **kw), jax.hessian(f)(t))

    f, g, g_ad, h, h_ad = everything(jnp.asarray(t))
    np.testing.assert_allclose(f, np_phi(t, H, J, beta, c), rtol=1e-13)
    np.testing.assert_allclose(g, g_ad, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(h, h_ad, rtol=1e-11, atol=1e-13)
    assert np.all(np.linalg.eigvalsh(np.asarray(h)) > 0)  # strictly convex
    if normalized:  # the post's Hessian (field part only on the diagonal) is wrong
        assert np.abs(post_hessian(t, H, Js, beta) - np.asarray(h_ad)).max() > 1e-2


def test_closed_forms_float32_and_outside_domain():
    rng = np.random.default_rng(1)
    H, J = random_instance(rng, 5, 4)
    t = np.linalg.eigvalsh(J)[-1] + 0.5 + rng.uniform(size=5)

    @jax.jit
    def everything(t):
        return (fe.phi(t, H, J, beta=1.0), fe.phi_grad(t, H, J, beta=1.0),
                jax.grad(lambda t: fe.phi(t, H, J, beta=1.0))(t), fe.phi_hessian(t, H, J, beta=1.0))

    _, g, g_ad, _ = everything(jnp.asarray(t, jnp.float32))
    assert g.dtype == jnp.float32
    np.testing.assert_allclose(g, g_ad, rtol=1e-4, atol=1e-5)
    bad = everything(jnp.zeros(5, jnp.float32))  # V = −J has negative eigenvalues (tr J = 0)
    assert all(np.all(np.isnan(x)) for x in bad)


# ----------------------------------------------------------------------------- the saddle


@pytest.fixture(scope="module")
def batch_saddle():
    """jit(vmap(saddle)) over a batch of random instances, compiled once."""

    @jax.jit
    def run(H, J, beta):
        return jax.vmap(lambda H, J, b: fe.saddle(H, J, beta=b, throw=False))(H, J, beta)

    return run


def test_saddle_meets_spherical_constraint(batch_saddle):
    """At t*, the saddle's Gaussian (mean ½V⁻¹h_α, covariance V⁻¹/2β per component) has
    Σ_α ⟨σ_iα²⟩ = D A_ii/(2β) + ¼|[AH]_i|² = D; checked in float64 numpy from t*."""
    rng = np.random.default_rng(2)
    n, D, B = 12, 24, 12
    Hs, Js, betas = [], [], []
    for k in range(B):
        scale = [0.3, 1.0, 3.0][k % 3]
        H, J = random_instance(rng, n, D, scale=scale)
        Hs.append(H * rng.uniform(0.0, 3.0))
        Js.append(J)
        betas.append([0.1, 1.0, 10.0, 1e3][k % 4])
    Hs, Js, betas = (np.asarray(a, np.float32) for a in (Hs, Js, betas))
    sol = batch_saddle(Hs, Js, betas)
    assert np.all(np.asarray(sol.result) == solvers.RESULTS.successful)
    assert np.all(np.asarray(sol.num_steps) <= 15)
    for k in range(B):
        t = np.asarray(sol.value[k], np.float64)
        V = np.diag(t) - Js[k].astype(np.float64)
        assert np.all(np.linalg.eigvalsh(V) > 0)
        A = np.linalg.inv(V)
        H = Hs[k].astype(np.float64)
        second_moment = D * np.diag(A) / (2 * betas[k]) + 0.25 * np.sum((A @ H) ** 2, axis=1)
        np.testing.assert_allclose(second_moment, D, rtol=2e-4)


def test_saddle_is_the_minimum_of_phi(x64):
    """t* minimises φ: no random PD perturbation lowers it; J = 0 gives the closed form."""
    rng = np.random.default_rng(3)
    H, J = random_instance(rng, 5, 7)
    sol = fe.saddle(H, J, beta=2.0, solver=TIGHT)
    t = np.asarray(sol.value)
    f0 = float(fe.phi(t, H, J, beta=2.0))
    moved = t + 1e-3 * rng.normal(size=(20, 5))
    f = np.asarray(jax.jit(jax.vmap(lambda t: fe.phi(t, H, J, beta=2.0)))(moved))
    assert np.all(f > f0 - 1e-12)
    # uncoupled: β t² − t/2 − |h|²/(4D) = 0
    beta, D = 2.0, 7
    t_unc = (1 + np.sqrt(1 + 4 * beta**2 * np.sum(H**2, 1) / D)) / (4 * beta)
    np.testing.assert_allclose(fe.saddle(H, np.zeros((5, 5)), beta=beta, solver=TIGHT).value,
                               t_unc, rtol=1e-12)


# ----------------------------------------------------------------------------- log Z


@pytest.fixture(scope="module")
def exact_cases():
    """Exact log Z of the test systems (normalised fields |h| = O(1)), float64 scipy."""
    beta = 1.3
    out = {}
    for D in DS:
        sD = math.sqrt(D)
        h = 0.8
        out[("one", D)] = log_z1(beta * sD * (sD * h), D)
        # two spins: coupling j (normalised like the post, j ~ 1/√D), parallel fields
        out[("two", D)] = log_z2(0.9 * sD, -0.4 * sD, 0.5 / sD, beta, D)
    return beta, out


def _approx(H, J, beta, fluctuations):
    return float(fe.log_partition(H, J, beta=beta, normalized=True, fluctuations=fluctuations,
                                  solver=TIGHT))


def test_log_partition_vs_exact(exact_cases, x64):
    """The steepest-descent ln Z against the exact ln Z of the δ(D − |σ|²) measure, for one
    spin (a von Mises–Fisher normaliser) and two coupled spins (quadrature). The per-D error
    shrinks with D; with the fluctuation term the error of ln Z itself is O(1/D)."""
    beta, exact = exact_cases
    for case in ("one", "two"):
        per_d, fluct = [], []
        for D in DS:
            e = np.zeros(D)
            e[0] = 1.0
            if case == "one":
                H, J = 0.8 * e[None, :], np.zeros((1, 1))
            else:
                H = np.stack([0.9 * e, -0.4 * e])
                J = np.array([[0.0, 0.5], [0.5, 0.0]]) / math.sqrt(D)
            ref = exact[(case, D)]
            per_d.append((_approx(H, J, beta, False) - ref) / D)
            fluct.append(_approx(H, J, beta, True) - ref)
        per_d, fluct = np.abs(per_d), np.abs(fluct)
        assert np.all(np.diff(per_d) < 0), (case, per_d)
        n = 1 if case == "one" else 2
        assert per_d[-1] < 0.04 * n  # measured 0.035 (one), 0.070 (two) at D = 100
        assert np.all(np.diff(fluct) < 0), (case, fluct)
        # measured D·error = 0.17 per spin for every D (the 1/(6D) of Stirling's series)
        assert np.all(fluct * np.asarray(DS) < 0.2 * n), (case, fluct)


def test_free_energy_is_the_large_d_limit(exact_cases, x64):
    """−βf (the post's boxed formula) = lim D⁻¹ ln(Z/Z₀), Z₀ = (π^{D/2}D^{(D−2)/2}/Γ(D/2))^N."""
    beta, exact = exact_cases
    gaps = []
    for D in DS:
        e = np.zeros(D)
        e[0] = 1.0
        H = np.stack([0.9 * e, -0.4 * e])
        J = np.array([[0.0, 0.5], [0.5, 0.0]]) / math.sqrt(D)
        f = float(fe.free_energy(H, J, beta=beta, normalized=True, solver=TIGHT))
        gaps.append(f - (exact[("two", D)] - fe.log_measure(2, D)) / D)
    gaps = np.abs(gaps)
    assert np.all(np.diff(gaps) < 0) and gaps[-1] < 0.02, gaps


def test_log_measure():
    """∫ d^Dσ e^{−a|σ|²} = (π/a)^{D/2} = ∫_0^∞ du e^{−au} m(u) with m(u) the mass of
    δ(u − |σ|²); log_measure(1, D) = ln m(D). The post's normaliser is off by ½ ln D."""
    for D in (1, 2, 3, 7, 20):
        def mass(u):
            return math.exp(fe.log_measure(1, D) + 0.5 * (D - 2) * math.log(u / D))

        a = 0.37
        integral, _ = si.quad(lambda u: math.exp(-a * u) * mass(u), 0, np.inf, epsrel=1e-12)
        np.testing.assert_allclose(integral, (math.pi / a) ** (D / 2), rtol=1e-8)
        post = 0.5 * D * math.log(math.pi) + 0.5 * (D - 1) * math.log(D) - math.lgamma(D / 2)
        np.testing.assert_allclose(post - fe.log_measure(1, D), 0.5 * math.log(D), atol=1e-12)
    np.testing.assert_allclose(fe.log_measure(3, 5), 3 * fe.log_measure(1, 5))


def test_magnetization_approaches_exact_single_spin(x64):
    """One spin: the exact mean is √D I_{D/2}(κ)/I_{D/2−1}(κ) along h; the steepest-descent
    ½ h/t* (unit spins, normalised h) approaches it as D grows."""
    beta, h = 1.3, 0.8
    errs = []
    for D in DS:
        e = np.zeros(D)
        e[0] = 1.0
        m = fe.magnetizations(h * e[None, :], np.zeros((1, 1)), beta=beta, normalized=True)
        kappa = beta * D * h
        exact = sp.ive(D / 2, kappa) / sp.ive(D / 2 - 1, kappa)  # ⟨σ⟩/√D
        errs.append(abs(float(m[0, 0]) - exact))
        np.testing.assert_allclose(np.asarray(m)[0, 1:], 0.0, atol=1e-15)
    assert np.all(np.diff(errs) < 0) and errs[-1] < 2e-3, errs


# ----------------------------------------------------------------------------- magnetizations


def _central_diff(f, x, eps):
    """Central differences of a scalar jax function f at x, every entry at once (one
    jitted vmapped call)."""
    x = np.asarray(x, np.float64)
    k = x.size
    E = eps * np.eye(k).reshape((k,) + x.shape)
    vals = np.asarray(jax.jit(jax.vmap(f))(jnp.asarray(np.concatenate([x + E, x - E]))))
    return ((vals[:k] - vals[k:]) / (2 * eps)).reshape(x.shape)


def test_magnetizations_fixed_j_vs_finite_differences(x64):
    """⟨σ_i⟩ = β⁻¹ ∂ln Z/∂h_i (raw) = ½ Σ_j [V⁻¹]_ij h_j, no β prefactor; the normalised
    convention is the raw one with H ← √D·H and spins divided by √D."""
    rng = np.random.default_rng(4)
    n, D, beta = 4, 3, 0.8
    H, J = random_instance(rng, n, D, scale=0.7)
    kw = dict(beta=beta, solver=TIGHT)

    def log_z(x, normalized=False):
        return fe.log_partition(x, J, normalized=normalized, **kw)

    diag = rng.normal(size=n)

    @jax.jit
    def run(x):
        sol = fe.saddle(x, J, **kw)
        m = fe.magnetizations(x, J, saddle=sol, **kw)
        y = x / math.sqrt(D)
        m_norm = fe.magnetizations(y, J, normalized=True, **kw)
        m_call = fe.magnetizations(x, lambda _: J, **kw)  # the callable path, raw fields
        lz_diag = fe.log_partition(x, J + jnp.diag(diag), **kw)
        return m, sol.value, m_norm, m_call, log_z(x), log_z(y, True), lz_diag

    m, t, m_norm, m_call, lz, lz_norm, lz_diag = run(H)
    fd = _central_diff(log_z, H, 1e-5) / beta
    np.testing.assert_allclose(m, fd, rtol=1e-7, atol=1e-9)
    np.testing.assert_allclose(m, 0.5 * np.linalg.solve(np.diag(t) - J, H), rtol=1e-12)
    np.testing.assert_allclose(m_norm * math.sqrt(D), m, rtol=1e-12)
    np.testing.assert_allclose(m_call, m, rtol=1e-12)
    np.testing.assert_allclose(lz_norm, lz, rtol=1e-13)
    # a diagonal of J is the constant energy −D Tr J: it adds β D Tr J to ln Z
    np.testing.assert_allclose(lz_diag - lz, beta * D * diag.sum(), rtol=1e-10)


def test_magnetizations_callable_couplings_vs_finite_differences(x64):
    """J(H): the magnetization is the total derivative of ln Z, including ∂J/∂H."""
    rng = np.random.default_rng(5)
    n, D, k, beta = 4, 3, 2, 1.5
    H = rng.normal(size=(n, D))
    Q, K = rng.normal(size=(D, k)), rng.normal(size=(D, k))

    def couplings(x):
        return fe.tanh_couplings(x, Q, K)

    kw = dict(beta=beta, normalized=True, solver=TIGHT)

    def log_z(x):
        return fe.log_partition(x, couplings, **kw)

    m, m_fixed = jax.jit(lambda x: (fe.magnetizations(x, couplings, **kw),
                                    fe.magnetizations(x, couplings(x), **kw)))(H)
    fd = _central_diff(log_z, H, 1e-5)
    np.testing.assert_allclose(m, fd / (beta * D), rtol=1e-7, atol=1e-9)
    ad = jax.jit(jax.grad(log_z))(jnp.asarray(H))
    np.testing.assert_allclose(m, ad / (beta * D), rtol=1e-9, atol=1e-11)
    # the J(H) term matters: the fixed-J formula at the same J misses it
    assert np.abs(np.asarray(m) - np.asarray(m_fixed)).max() > 1e-2


def test_tanh_couplings():
    rng = np.random.default_rng(6)
    n, D, k = 5, 4, 3
    H, Q, K = rng.normal(size=(n, D)), rng.normal(size=(D, k)), rng.normal(size=(D, k))
    J = np.asarray(fe.tanh_couplings(H, Q, K), np.float64)
    raw = np.tanh(H @ Q @ K.T @ H.T * math.sqrt(D)) / math.sqrt(n * D)
    want = (raw + raw.T) / 2
    np.fill_diagonal(want, 0.0)
    np.testing.assert_allclose(J, want, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="Q and K"):
        fe.tanh_couplings(H, Q, K[:, :2])


# ----------------------------------------------------------------------------- gradients


@pytest.mark.parametrize(
    "all_adjoints", [False, pytest.param(True, marks=pytest.mark.slow)]
)
def test_gradients_of_magnetizations_implicit_unrolled_fd(all_adjoints, x64):
    """A scalar loss of the magnetizations, differentiated with respect to H, J and β through
    t*: the default adjoint (dense solve with the closed-form Hessian) against the
    matrix-free implicit adjoint, unrolling the Newton iterations, and finite differences."""
    rng = np.random.default_rng(7)
    n, D, beta = 4, 3, 1.2
    H, J = random_instance(rng, n, D, scale=0.8)
    W = rng.normal(size=(n, D))
    sizes = np.cumsum([H.size, J.size])

    def loss(p, adjoint=None):  # p = (H, J, β) flattened, for the differences
        Hp, Jp, bp = jnp.split(p, sizes)
        m = fe.magnetizations(Hp.reshape(n, D), Jp.reshape(n, n), beta=bp[0], solver=TIGHT,
                              adjoint=adjoint)
        return jnp.sum(W * m) + jnp.sum(m**2)

    p = np.concatenate([H.ravel(), J.ravel(), [beta]])
    g_imp = jax.jit(jax.grad(loss))(jnp.asarray(p))
    fd = _central_diff(loss, p, 1e-6)
    np.testing.assert_allclose(g_imp, fd, rtol=1e-6, atol=1e-8)
    others = []
    if all_adjoints:  # unrolling the Newton iterations, and the matrix-free implicit adjoint
        others = [solvers.Unrolled(),
                  solvers.Implicit(linear_solver=solvers.GMRES(restart=20), rtol=1e-12)]
    for adjoint in others:
        g = jax.jit(jax.grad(lambda p: loss(p, adjoint)))(jnp.asarray(p))
        np.testing.assert_allclose(g_imp, g, rtol=1e-9, atol=1e-11)


@pytest.mark.slow
def test_gradients_through_callable_couplings(x64):
    """Gradients with respect to the parameters of J(H) (here Q) through the magnetizations."""
    rng = np.random.default_rng(8)
    n, D, k, beta = 3, 3, 2, 1.0
    H = rng.normal(size=(n, D))
    Q, K = rng.normal(size=(D, k)), rng.normal(size=(D, k))
    W = rng.normal(size=(n, D))

    def loss(Q):
        m = fe.magnetizations(H, lambda x: fe.tanh_couplings(x, Q, K), beta=beta,
                              normalized=True, solver=TIGHT)
        return jnp.sum(W * m)

    g = jax.jit(jax.grad(loss))(jnp.asarray(Q))
    fd = _central_diff(loss, Q, 1e-6)
    np.testing.assert_allclose(g, fd, rtol=1e-6, atol=1e-8)


def test_float32_gradients_and_vmap():
    """The default float32 path: vmapped magnetizations match one-at-a-time calls, and the
    implicit gradient matches the float64 one (itself checked against differences above)."""
    rng = np.random.default_rng(9)
    B, n, D = 3, 5, 8
    Hs = rng.normal(size=(B, n, D)).astype(np.float32) / np.sqrt(D)
    _, J = random_instance(rng, n, D, scale=0.5)
    J = J.astype(np.float32)

    def batch(J, Hs):
        def one(H):
            sol = fe.saddle(H, J, beta=2.0, normalized=True)
            return fe.magnetizations(H, J, beta=2.0, normalized=True, saddle=sol), sol

        m, sol = jax.vmap(one)(Hs)
        return m, sol.value

    @jax.jit
    def run(J, Hs):
        m, t = batch(J, Hs)
        return m, t, jax.grad(lambda J: jnp.sum(batch(J, Hs)[0] ** 2))(J)

    m, t, g32 = (np.asarray(a) for a in run(jnp.asarray(J), Hs))
    assert g32.dtype == np.float32
    for b in range(B):  # each example of the vmapped batch, checked in float64 numpy
        A = np.linalg.inv(np.diag(t[b].astype(np.float64)) - J)
        H = Hs[b].astype(np.float64)
        np.testing.assert_allclose(np.diag(A) / 4.0 + 0.25 * np.sum((A @ H) ** 2, 1), 1.0,
                                   rtol=1e-4)  # 1 − ∇φ/β at β = 2, normalised
        np.testing.assert_allclose(m[b], 0.5 * A @ H, rtol=1e-4, atol=1e-6)
    with jax.enable_x64(True):
        _, _, g64 = run(jnp.asarray(J, jnp.float64), Hs.astype(np.float64))
    g64 = np.asarray(g64)
    # measured: max |g32 − g64| = 5e-6 · max |g64|
    np.testing.assert_allclose(g32, g64, rtol=1e-4, atol=1e-4 * np.abs(g64).max())


# ----------------------------------------------------------------------------- stability


def test_is_stable_needs_positive_definite_not_positive_determinant():
    rng = np.random.default_rng(10)
    Qm, _ = np.linalg.qr(rng.normal(size=(3, 3)))
    V = Qm @ np.diag([-1.0, -2.0, 3.0]) @ Qm.T  # det = 6 > 0, two negative eigenvalues
    t = np.diag(V).copy()
    J = np.diag(t) - V  # zero diagonal, symmetric
    assert np.linalg.det(np.diag(t) - J) > 0
    assert not bool(fe.is_stable(t, J))
    assert bool(fe.is_stable(t + 2.5, J))  # eigenvalues 1.5, 0.5, 5.5
    assert not bool(fe.is_stable(t + 1.5, J))  # 0.5, −0.5, 4.5: det < 0 as well
    assert np.isnan(fe.phi(t, np.ones((3, 2)), J, beta=1.0))


def test_failures_are_reported_never_silent():
    rng = np.random.default_rng(11)
    n, D = 6, 8
    H, J = random_instance(rng, n, D)
    # a start outside the positive-definite region
    t_bad = np.zeros(n)
    sol = fe.saddle(H, J, beta=1.0, t0=t_bad, throw=False)
    assert int(sol.result) == solvers.RESULTS.nonfinite
    assert np.isnan(fe.log_partition(H, J, beta=1.0, t0=t_bad, throw=False))
    assert np.isnan(fe.log_partition(H, J, beta=1.0, saddle=sol))  # a failed saddle reused
    with pytest.raises(ValueError, match="saddle.value has shape"):
        fe.log_partition(H[:-1], J[:-1, :-1], beta=1.0, saddle=sol)
    assert np.all(np.isnan(fe.magnetizations(H, J, beta=1.0, t0=t_bad, throw=False)))
    with pytest.raises(eqx.EquinoxRuntimeError, match="t0 does not make V"):
        fe.saddle(H, J, beta=1.0, t0=t_bad)
    # plain Newton from far away steps out of the PD region: detected, not a NaN value
    far = np.full(n, 50.0)
    sol = fe.saddle(H, J, beta=1.0, t0=far, solver=solvers.Newton(), throw=False)
    assert int(sol.result) == solvers.RESULTS.nonfinite
    with pytest.raises(eqx.EquinoxRuntimeError, match="not positive definite"):
        fe.magnetizations(H, J, beta=1.0, t0=far, solver=solvers.Newton())
    # SaddleNewton from the same start converges
    assert int(fe.saddle(H, J, beta=1.0, t0=far).result) == solvers.RESULTS.successful
    # out of steps
    sol = fe.saddle(H, J, beta=1.0, solver=fe.SaddleNewton(max_steps=1), throw=False)
    assert int(sol.result) == solvers.RESULTS.max_steps_reached
    with pytest.raises(eqx.EquinoxRuntimeError, match="max_steps"):
        fe.free_energy(H, J, beta=1.0, solver=fe.SaddleNewton(max_steps=1))
    # pathological inputs: an overflowing β, a NaN field
    sol = fe.saddle(H, J, beta=1e30, throw=False)
    assert int(sol.result) != solvers.RESULTS.successful
    Hn = H.copy()
    Hn[0, 0] = np.nan
    assert int(fe.saddle(Hn, J, beta=1.0, throw=False).result) != solvers.RESULTS.successful


@pytest.mark.parametrize("power_steps", [fe._POWER_STEPS, 0])
def test_default_start_is_positive_definite_and_near_lambda_max(monkeypatch, power_steps):
    """The default start estimates λ_max(J) by power iteration on J + cI; it must keep V
    positive definite, also for couplings whose most negative eigenvalue is the largest in
    modulus (where plain power iteration finds that one), and fall back to Gershgorin's start
    when the estimate is short (0 power steps: the Rayleigh quotient of the flat vector)."""
    monkeypatch.setattr(fe, "_POWER_STEPS", power_steps)
    rng = np.random.default_rng(7)
    n, D, beta = 24, 8, 2.0
    kappa = 0.25 / D
    steps = np.zeros(2, int)  # Newton steps from the default start, from λ_max's
    for k in range(12):
        H, J = random_instance(rng, n, D, scale=0.5 + k)
        if k % 2:
            J = J - 3.0 * (k + 1) * np.outer(np.ones(n), np.ones(n)) / n  # λ_min dominant
            np.fill_diagonal(J, 0.0)
        lam = np.linalg.eigvalsh(J)
        G = H @ H.T
        t_unc = (1 + np.sqrt(1 + 16 * beta**2 * kappa * np.diag(G))) / (4 * beta)
        t0 = np.asarray(fe._default_t0(jnp.asarray(G, jnp.float32), jnp.asarray(J, jnp.float32),
                                       beta, kappa))
        assert np.linalg.eigvalsh(np.diag(t0) - J)[0] > 0  # V(t0) ≻ 0
        gersh = np.abs(J).sum(1) + t_unc
        # a Rayleigh quotient never exceeds λ_max; otherwise it is Gershgorin's start
        assert np.all(t0 <= lam[-1] + t_unc + 1e-4) or np.allclose(t0, gersh, rtol=1e-5)
        Hj, Jj = jnp.asarray(H, jnp.float32), jnp.asarray(J, jnp.float32)
        sol = fe.saddle(Hj, Jj, beta=beta)
        exact = fe.saddle(Hj, Jj, beta=beta, t0=jnp.asarray(lam[-1] + t_unc, jnp.float32))
        assert int(sol.result) == 0
        np.testing.assert_allclose(sol.value, exact.value, rtol=1e-4)
        steps += np.array([int(sol.num_steps), int(exact.num_steps)])
    if power_steps:  # as close to the saddle as the exact λ_max's start, over the instances
        assert steps[0] <= 1.1 * steps[1], steps


def test_large_beta_float32_is_solved():
    """Deep in the condensed regime (t* just above λ_max(J)) float32 still converges."""
    rng = np.random.default_rng(12)
    H, J = random_instance(rng, 10, 16)
    for beta in (1e2, 1e4, 1e6):
        sol = fe.saddle(H / 4, J, beta=beta, normalized=True)
        assert int(sol.result) == solvers.RESULTS.successful
        assert bool(fe.is_stable(sol.value, J))


def test_backward_failure_raises():
    rng = np.random.default_rng(13)
    H, J = random_instance(rng, 8, 4)
    starved = solvers.Implicit(linear_solver=solvers.GMRES(restart=1), max_steps=1, rtol=1e-9)

    def loss(H):
        return jnp.sum(fe.magnetizations(H, J, beta=1.0, adjoint=starved) ** 2)

    with pytest.raises(eqx.EquinoxRuntimeError, match="gradient through the saddle"):
        eqx.filter_jit(jax.grad(loss))(jnp.asarray(H, jnp.float32))


def test_input_errors():
    H, J = np.ones((3, 2)), np.zeros((3, 3))
    with pytest.raises(ValueError, match="shape \\(n, D\\)"):
        fe.saddle(np.ones(3), J, beta=1.0)
    with pytest.raises(ValueError, match="\\(3, 3\\)"):
        fe.log_partition(H, np.zeros((2, 2)), beta=1.0)
    with pytest.raises(ValueError, match="callable"):
        fe.magnetizations(H, lambda x: np.zeros((2, 2)), beta=1.0)
    with pytest.raises(ValueError, match="beta"):
        fe.saddle(H, J, beta=0.0)
    with pytest.raises(ValueError, match="t0"):
        fe.saddle(H, J, beta=1.0, t0=np.ones(2))
    with pytest.raises(ValueError, match="full_step"):
        fe.SaddleNewton(full_step=1.5)
