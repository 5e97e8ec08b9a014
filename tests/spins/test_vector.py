"""Vector spins: Bessel ratios, magnetizations, variances and the TAP dynamics/steady state."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.special as sp

from spinformer import solvers
from spinformer.spins import vector

from spin_helpers import sphere_moments_importance

NUS = np.array([-0.5, 0.0, 0.5, 1.0, 5.0, 50.0, 255.0, 500.0])
XS = np.logspace(-3, 4, 22)


def _reference_ratio(nu, x):
    """I_{ν+1}(x)/I_ν(x) from scipy: scaled Bessel functions, and where those underflow
    (large order, small argument) the power series x/(2(ν+1)) · ₀F₁(ν+2; x²/4)/₀F₁(ν+1; x²/4)."""
    nu, x = np.broadcast_arrays(np.asarray(nu, np.float64), np.asarray(x, np.float64))
    with np.errstate(all="ignore"):
        ref = np.atleast_1d(sp.ive(nu + 1, x) / sp.ive(nu, x))
    nu, x = np.atleast_1d(nu), np.atleast_1d(x)
    s = ~np.isfinite(ref) | (sp.ive(nu, x) < 1e-280)
    n_, x_ = nu[s], x[s]
    ref[s] = x_ / (2 * (n_ + 1)) * sp.hyp0f1(n_ + 2, x_**2 / 4) / sp.hyp0f1(n_ + 1, x_**2 / 4)
    assert np.all(np.isfinite(ref))
    return ref if ref.size > 1 else ref[0]


@pytest.fixture(scope="module")
def grid():
    N, X = np.meshgrid(NUS, XS, indexing="ij")
    return N, X, _reference_ratio(N, X)


def test_bessel_ratio_float64(grid, x64):
    N, X, ref = grid
    r = np.asarray(vector.bessel_ratio(jnp.asarray(N), jnp.asarray(X)))
    assert np.all(np.isfinite(r))
    np.testing.assert_allclose(r, ref, rtol=1e-10)


def test_bessel_ratio_float32(grid):
    N, X, ref = grid
    r = np.asarray(vector.bessel_ratio(jnp.asarray(N, jnp.float32), jnp.asarray(X, jnp.float32)))
    assert r.dtype == np.float32
    np.testing.assert_allclose(r, ref, rtol=2e-6)


def test_bessel_ratio_derivatives(grid, x64):
    """r' = 1 − r² − (2ν+1) r/x from the reference values; second derivative by differences."""
    N, X, ref = grid
    want = 1.0 - ref**2 - (2 * N + 1) / X * ref
    d = jax.vmap(jax.grad(vector.bessel_ratio, argnums=1))(jnp.asarray(N.ravel()),
                                                         jnp.asarray(X.ravel()))
    # (at x ≫ ν the derivative ~ (ν+½)/x² is resolved to ~1e-11 absolute)
    np.testing.assert_allclose(np.asarray(d).reshape(N.shape), want, rtol=1e-7, atol=1e-11)
    d2 = jax.grad(jax.grad(vector.bessel_ratio, argnums=1), argnums=1)
    for nu, x in [(0.0, 0.3), (3.0, 2.0), (50.0, 80.0)]:
        h = 1e-4 * x
        fd = (_reference_ratio(np.array(nu), np.array(x + h))
              - 2 * _reference_ratio(np.array(nu), np.array(x))
              + _reference_ratio(np.array(nu), np.array(x - h))) / h**2
        np.testing.assert_allclose(float(d2(nu, x)), fd, rtol=1e-3)
    with pytest.raises(ValueError, match="nu"):
        jax.grad(vector.bessel_ratio)(1.0, 2.0)


def test_exact_magnetization_closed_forms():
    beta, R = 0.8, 1.7
    # D = 1: a binary spin of size R, R tanh(βRθ)
    t = jnp.array([0.7])
    np.testing.assert_allclose(vector.magnetization(t, beta=beta, R=R, large_d=False),
                               R * np.tanh(beta * R * 0.7), rtol=1e-6)
    # D = 2: I1/I0; D = 3: the Langevin function coth κ − 1/κ
    rng = np.random.default_rng(0)
    for D, ratio in [(2, lambda k: sp.i1e(k) / sp.i0e(k)),
                     (3, lambda k: 1 / np.tanh(k) - 1 / k)]:
        t = rng.normal(size=D)
        k = beta * R * np.linalg.norm(t)
        want = R * ratio(k) * t / np.linalg.norm(t)
        np.testing.assert_allclose(vector.magnetization(jnp.asarray(t, jnp.float32), beta=beta,
                                                        R=R, large_d=False), want, rtol=2e-6)
    # smooth at θ = 0, with slope βR²/D (the variance of a uniform spin on the sphere)
    jac = jax.jacobian(lambda t: vector.magnetization(t, beta=beta, R=R, large_d=False))(
        jnp.zeros(4))
    np.testing.assert_allclose(jac, beta * R**2 / 4 * np.eye(4), rtol=1e-6)


@pytest.mark.parametrize("D", [3, 5])
def test_exact_moments_against_sampling(D):
    rng = np.random.default_rng(D)
    beta, R = 1.2, 1.5
    theta = rng.normal(size=D) * 0.8
    mean, cov, ess = sphere_moments_importance(rng, theta, beta, R, 400_000)
    se = R / np.sqrt(ess)  # crude standard error of each coordinate
    m = vector.magnetization(jnp.asarray(theta, jnp.float32), beta=beta, R=R, large_d=False)
    np.testing.assert_allclose(m, mean, atol=5 * se)
    V = vector.variance(jnp.asarray(theta, jnp.float32), beta=beta, R=R, large_d=False)
    np.testing.assert_allclose(V, cov, atol=5 * R * se)
    # the exact trace identity ⟨‖s‖²⟩ = R²
    np.testing.assert_allclose(np.trace(V) + np.sum(np.asarray(m) ** 2), R**2, rtol=1e-5)


def test_large_d_limit_approaches_exact():
    """With R² = D/2 − 1, the large-D φ approaches the Bessel one as D grows (error ∝ 1/D)."""
    beta = 1.0
    errs = []
    Ds = [8, 32, 128, 512]
    for D in Ds:
        R = np.sqrt(D / 2 - 1)
        u = np.ones(D) / np.sqrt(D)
        thetas = np.array([0.3, 1.0, 3.0])[:, None] * R * u  # fields of order R
        exact = vector.magnetization(jnp.asarray(thetas), beta=beta, R=R, large_d=False)
        large = vector.magnetization(jnp.asarray(thetas), beta=beta, R=R, large_d=True)
        errs.append(float(jnp.max(jnp.linalg.norm(exact - large, axis=-1))) / R)
    assert all(b < a for a, b in zip(errs, errs[1:]))
    assert errs[-1] < 5e-3
    assert errs[-1] * Ds[-1] < 4 * errs[0] * Ds[0]


def test_variance_and_inverse(x64):
    rng = np.random.default_rng(1)
    beta, D = 0.9, 6
    R = np.sqrt(D / 2 - 1)
    theta = jnp.asarray(rng.normal(size=D))
    for large_d in (True, False):
        jac = jax.jacobian(lambda t: vector.magnetization(t, beta=beta, R=R,
                                                          large_d=large_d))(theta)
        np.testing.assert_allclose(vector.variance(theta, beta=beta, R=R, large_d=large_d),
                                   jac / beta, atol=1e-12)
    m = vector.magnetization(theta, beta=beta, R=R)
    np.testing.assert_allclose(vector.inverse_magnetization(m, beta=beta, R=R), theta,
                               rtol=1e-12)
    # exact-D inverse: round trips over many decades of field strength, and its Jacobian is
    # the inverse of the magnetization's
    for Dk in (1, 3, 64):
        Rk = np.sqrt(max(Dk / 2 - 1, 0.5))
        u = jnp.asarray(rng.normal(size=Dk))
        u = u / jnp.linalg.norm(u)
        strengths = np.array([0.0, 1e-3, 0.1, 1.0, 5.0] + ([] if Dk == 1 else [1e2, 3e3]))
        th = jnp.asarray(strengths)[:, None] * u / (beta * Rk)
        mk = vector.magnetization(th, beta=beta, R=Rk, large_d=False)
        back = vector.inverse_magnetization(mk, beta=beta, R=Rk, large_d=False)
        np.testing.assert_allclose(back, th, rtol=1e-9, atol=1e-300)
    m_exact = vector.magnetization(theta, beta=beta, R=R, large_d=False)
    inv_jac = jax.jacobian(lambda m_: vector.inverse_magnetization(m_, beta=beta, R=R,
                                                                   large_d=False))(m_exact)
    np.testing.assert_allclose(inv_jac @ (beta * vector.variance(theta, beta=beta, R=R,
                                                                 large_d=False)),
                               np.eye(D), atol=1e-10)
    np.testing.assert_allclose(vector.variance(jnp.zeros(D), beta=beta, R=R, large_d=False),
                               R**2 / D * np.eye(D), atol=1e-12)


def test_hessian_contraction_closed_form(x64):
    """The closed form of ∇²φ : A used by the TAP equations, against autodiff."""
    rng = np.random.default_rng(2)
    D, beta = 6, 0.8
    R = np.sqrt(D / 2 - 1)
    theta = rng.normal(size=D)
    m_prev = rng.normal(size=(3, D)) * 0.5
    W = rng.uniform(0, 1, 3)
    a = 0.7
    A = a * np.eye(D) - np.einsum("j,jd,je->de", W, m_prev, m_prev)
    hess = jax.hessian(lambda t: vector.magnetization(t, beta=beta, R=R))(jnp.asarray(theta))
    want = np.einsum("abc,bc->a", hess, A)
    m = vector.magnetization(jnp.asarray(theta), beta=beta, R=R)[None]
    got = vector._hessian_contraction(m, vector._gamma_m(m, R), jnp.array([[a]]),
                                      jnp.asarray(W)[None], jnp.asarray(m_prev), beta, R)
    np.testing.assert_allclose(got[0], want, atol=1e-13)


def _system(rng, n, D, scale):
    R = np.sqrt(D / 2 - 1)
    x = rng.normal(size=(n, D))
    x = R * x / np.linalg.norm(x, axis=1, keepdims=True)
    J = rng.normal(size=(n, n)) * scale / np.sqrt(n)
    return x, J, R


def test_tap_step_against_gaussian_fluctuations(x64):
    """m_t is the average of φ over the fluctuating field Σ_j J_ij s_j,t−1, with s_j,t−1
    independent with the large-D means and covariances. TAP matches it to O(J⁴), naive
    mean field only to O(J²). Antithetic Monte Carlo removes the odd orders."""
    rng = np.random.default_rng(3)
    n, D, beta = 5, 8, 1.0
    x, J0, R = _system(rng, n, D, 1.0)
    m_prev = np.asarray(vector.magnetization(jnp.asarray(rng.normal(size=(n, D))), beta=beta,
                                             R=R))
    theta_prev = np.asarray(vector.inverse_magnetization(jnp.asarray(m_prev), beta=beta, R=R))
    L = np.stack([np.linalg.cholesky(np.asarray(vector.variance(jnp.asarray(t), beta=beta,
                                                                R=R))) for t in theta_prev])
    dev = np.einsum("jab,sjb->sja", L, rng.normal(size=(100_000, n, D)))
    phi = jax.jit(lambda t: vector.magnetization(t, beta=beta, R=R))
    step = jax.jit(lambda J: (vector.mean_field_step(m_prev, x, J, beta=beta, R=R),
                              vector.tap_step(m_prev, x, J, beta=beta, R=R,
                                              solver=solvers.Anderson(tol=1e-12)).value))
    errs = []
    for eps in (0.5, 0.25):
        J = eps * J0
        delta = np.einsum("ij,sjd->sid", J, dev)
        th0 = x + J @ m_prev
        truth = 0.5 * np.mean(np.asarray(phi(th0 + delta)) + np.asarray(phi(th0 - delta)), 0)
        naive, tap = step(jnp.asarray(J))
        errs.append((np.max(np.abs(np.asarray(naive) - truth)),
                     np.max(np.abs(np.asarray(tap) - truth))))
    (n1, t1), (n2, t2) = errs
    assert t1 < 0.2 * n1 and t2 < 0.05 * n2
    assert 3.0 < n1 / n2 < 5.0  # ∝ J²
    assert t1 / t2 > 8.0  # ∝ J⁴ (up to Monte Carlo noise)


N_SPINS, DIM, BETA = 8, 16, 1.0
RADIUS = float(np.sqrt(DIM / 2 - 1))
_step = jax.jit(lambda m_prev, x, J: vector.tap_step(m_prev, x, J, beta=BETA, R=RADIUS,
                                                     solver=solvers.Anderson(tol=1e-6)).value)
_ness = jax.jit(lambda x, J: vector.tap_ness(x, J, beta=BETA, R=RADIUS,
                                             solver=solvers.Anderson(tol=1e-6)))

# The adjoint solve the finite-difference checks need: GMRES converges far past the 1e-5
# relative residual at which the default Anderson linear solver stops (enough for training,
# too loose for rtol 1e-6).
# (a tight backward tolerance: GMRES stops where it is met, and the gradients are compared
# with central differences to 1e-6)
_GMRES_ADJOINT = solvers.Implicit(linear_solver=solvers.GMRES(restart=5), rtol=1e-10)


@pytest.fixture(scope="module")
def ness_problem():
    """A spin-transformer-like system: fields on the sphere, softmax couplings."""
    rng = np.random.default_rng(5)
    x, _, R = _system(rng, N_SPINS, DIM, 1.0)
    logits = rng.normal(size=(N_SPINS, N_SPINS))
    J = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
    return x, J


def test_zero_coupling_steps(ness_problem):
    x = jnp.asarray(ness_problem[0], jnp.float32)
    J = jnp.zeros((N_SPINS, N_SPINS))
    want = vector.magnetization(x, beta=BETA, R=RADIUS)
    m_prev = jnp.ones_like(x)
    np.testing.assert_allclose(vector.mean_field_step(m_prev, x, J, beta=BETA, R=RADIUS), want,
                               atol=1e-6)
    np.testing.assert_allclose(_step(m_prev, x, J), want, atol=1e-5)
    np.testing.assert_allclose(_ness(x, J).value, want, atol=1e-5)


def test_tap_ness_is_the_end_of_the_time_evolution(ness_problem):
    x, J = (jnp.asarray(a, jnp.float32) for a in ness_problem)
    sol = _ness(x, J)
    assert int(sol.result) == solvers.RESULTS.successful
    m = vector.magnetization(x, beta=BETA, R=RADIUS)
    for _ in range(40):
        m = _step(m, x, J)
    np.testing.assert_allclose(sol.value, m, atol=2e-5)


def test_tap_ness_agrees_with_jaxopt_and_finite_differences(ness_problem, x64):
    """Same steady state as an independent jaxopt.AndersonAcceleration solve of the same
    equations; implicit gradients match central differences."""
    jaxopt = pytest.importorskip("jaxopt")
    x, J = (jnp.asarray(a) for a in ness_problem)
    w = jnp.asarray(np.random.default_rng(6).normal(size=x.shape))

    def loss(x_, J_):
        m = vector.tap_ness(x_, J_, beta=BETA, R=RADIUS,
                            solver=solvers.Anderson(tol=1e-12, max_steps=60),
                            adjoint=_GMRES_ADJOINT).value
        return jnp.sum(w * m), m

    def fp(m, x_, J_):  # the steady-state map, for jaxopt
        return vector.ness_update(m, x_, J_, beta=BETA, R=RADIUS)

    ref = jaxopt.AndersonAcceleration(fixed_point_fun=fp, tol=1e-12, maxiter=200).run(
        vector.magnetization(x, beta=BETA, R=RADIUS), x, J).params
    (_, ours), (gx, gJ) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(x, J)
    np.testing.assert_allclose(ours, ref, atol=1e-8)
    # central differences along random directions, in one vmapped call
    rng = np.random.default_rng(7)
    k, eps = 4, 1e-6
    dx = jnp.asarray(rng.normal(size=(k,) + x.shape))
    dJ = jnp.asarray(rng.normal(size=(k,) + J.shape))
    batched = jax.jit(jax.vmap(lambda a, b: loss(a, b)[0]))
    fd = (batched(x + eps * dx, J + eps * dJ) - batched(x - eps * dx, J - eps * dJ)) / (2 * eps)
    want = jnp.einsum("kid,id->k", dx, gx) + jnp.einsum("kij,ij->k", dJ, gJ)
    np.testing.assert_allclose(fd, want, rtol=1e-6, atol=1e-9)


def _phi_numpy(theta, beta, R):
    """The large-D magnetization βθ/(1 + √(1 + β²‖θ‖²/R²)) in plain numpy."""
    g = np.sqrt(1.0 + beta**2 * np.sum(theta**2, axis=-1, keepdims=True) / R**2)
    return beta * theta / (1.0 + g)


def test_mean_field_ness_is_the_fixed_point_of_the_mean_field_step(ness_problem):
    """m = φ(x + J m) to the solver's tolerance, and the end of the first-order time
    evolution from φ(x). The softmax J is row-stochastic and the large-D φ is 1/2-Lipschitz
    at β = 1, so the step contracts by at least 1/2: the iteration converges and the solve's
    distance to the true fixed point is at most twice its residual."""
    x32, J32 = (jnp.asarray(a, jnp.float32) for a in ness_problem)
    tol = 1e-6
    sol = jax.jit(lambda x_, J_: vector.mean_field_ness(
        x_, J_, beta=BETA, R=RADIUS, solver=solvers.Anderson(tol=tol)))(x32, J32)
    assert int(sol.result) == solvers.RESULTS.successful
    m = np.asarray(sol.value)
    assert m.shape == (N_SPINS, DIM) and m.dtype == np.float32
    resid = np.max(np.abs(np.asarray(vector.mean_field_step(sol.value, x32, J32, beta=BETA,
                                                             R=RADIUS)) - m))
    assert resid <= tol
    assert float(sol.residual) <= tol
    np.testing.assert_allclose(float(sol.residual), resid, atol=2e-7)
    # plain float64 iteration of the mean-field step from the decoupled response φ(x)
    x, J = ness_problem
    m_iter = _phi_numpy(x, BETA, RADIUS)
    for _ in range(200):
        m_iter = _phi_numpy(x + J @ m_iter, BETA, RADIUS)
    np.testing.assert_allclose(m, m_iter, atol=2 * tol + 1e-6)
    # the same through the library's step
    step = jax.jit(lambda m_: vector.mean_field_step(m_, x32, J32, beta=BETA, R=RADIUS))
    m_lib = vector.magnetization(x32, beta=BETA, R=RADIUS)
    for _ in range(60):
        m_lib = step(m_lib)
    np.testing.assert_allclose(m, m_lib, atol=2 * tol + 1e-6)
    # the default solver (Anderson, tol 1e-3 in the ∞-norm)
    default = vector.mean_field_ness(x32, J32, beta=BETA, R=RADIUS)
    assert float(default.residual) <= 1e-3
    np.testing.assert_allclose(default.value, m_iter, atol=2e-3 + 1e-6)


def test_mean_field_ness_gradients(ness_problem, x64):
    """Implicit gradients w.r.t. x against backpropagation through the iterations and central
    differences; the default adjoint agrees to its 1e-5 relative linear-solve tolerance."""
    x, J = (jnp.asarray(a) for a in ness_problem)
    w = jnp.asarray(np.random.default_rng(8).normal(size=x.shape))
    solver = solvers.Anderson(tol=1e-12)

    def loss(x_, adjoint, solver=solver):
        sol = vector.mean_field_ness(x_, J, beta=BETA, R=RADIUS, solver=solver, adjoint=adjoint)
        return jnp.sum(w * sol.value)

    def grad(adjoint, solver=solver):
        return np.asarray(jax.jit(jax.grad(lambda x_: loss(x_, adjoint, solver)))(x))

    g_implicit = grad(solvers.Implicit(rtol=1e-10))
    # the reference backpropagates through Picard's iterations (another algorithm to the same
    # fixed point; its unrolled loop compiles in a quarter of Anderson's time)
    g_unrolled = grad(solvers.Unrolled(), solvers.Picard(tol=1e-12, max_steps=500))
    g_default = grad(None)
    scale = np.max(np.abs(g_unrolled))
    np.testing.assert_allclose(g_implicit, g_unrolled, rtol=1e-8, atol=1e-9 * scale)
    np.testing.assert_allclose(g_default, g_unrolled, rtol=1e-4, atol=1e-4 * scale)
    # central differences along random directions, in one vmapped call
    rng = np.random.default_rng(9)
    k, eps = 4, 1e-6
    dx = jnp.asarray(rng.normal(size=(k,) + x.shape))
    batched = jax.jit(jax.vmap(lambda a: loss(a, solvers.Implicit(rtol=1e-10))))
    fd = (batched(x + eps * dx) - batched(x - eps * dx)) / (2 * eps)
    want = np.einsum("kid,id->k", np.asarray(dx), g_implicit)
    np.testing.assert_allclose(fd, want, rtol=1e-6, atol=1e-9)


def test_errors():
    with pytest.raises(ValueError, match=r"\(n, D\)"):
        vector.tap_ness(jnp.zeros(4), jnp.zeros((4, 4)))
    with pytest.raises(ValueError, match=r"\(n, D\)"):
        vector.mean_field_ness(jnp.zeros(4), jnp.zeros((4, 4)))
    with pytest.raises(ValueError, match="shape"):
        vector.mean_field_step(jnp.zeros((3, 4)), jnp.zeros((3, 4)), jnp.zeros((2, 2)))
    with pytest.raises(ValueError, match="m_prev"):
        vector.tap_step(jnp.zeros((3, 5)), jnp.zeros((3, 4)), jnp.zeros((3, 3)))
    with pytest.raises(ValueError, match="variance"):
        vector.variance(jnp.zeros((2, 3)))
