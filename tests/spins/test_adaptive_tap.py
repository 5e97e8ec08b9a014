"""Adaptive TAP for vector spins: couplings, single sites, cavity variances, exactness for the
Gaussian model, accuracy against exact enumeration for binary spins, failures, gradients.

References are independent of the module: float64 numpy linear algebra, the Boltzmann density
written out term by term, quadrature, and brute-force enumeration (`spin_helpers`)."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spinformer import solvers
from spinformer.spins import adaptive_tap as at
from spinformer.spins import ising

from spin_helpers import ising_exact

# ----------------------------------------------------------------------------- problems


def sym_couplings(rng, N, d, scale):
    """Random couplings with J_ii = 0, J_ji = J_ijᵀ (numpy, float64), entries ~ scale/√(N d)."""
    A = rng.normal(size=(N, N, d, d)) * scale / np.sqrt(N * d)
    J = 0.5 * (A + A.transpose(1, 0, 3, 2))
    J[np.arange(N), np.arange(N)] = 0.0
    return J


def to_matrix(J):
    """(N, N, d, d) -> (N d, N d), written independently of `at.block_matrix`."""
    N, _, d, _ = J.shape
    M = np.zeros((N * d, N * d))
    for i, j, a, b in itertools.product(range(N), range(N), range(d), range(d)):
        M[i * d + a, j * d + b] = J[i, j, a, b]
    return M


def gaussian_problem(seed, N, d, lam_max=0.6):
    """Symmetric couplings rescaled so that the largest eigenvalue of 𝐉 is `lam_max` (< 1, so
    I − 𝐉 is positive definite), and fields ~ N(0, 1)."""
    rng = np.random.default_rng(seed)
    J = sym_couplings(rng, N, d, 1.0)
    J *= lam_max / np.max(np.abs(np.linalg.eigvalsh(to_matrix(J))))
    X = rng.normal(size=(N, d))
    return X, J


def sk_problem(seed, N, beta, field=0.5):
    """SK couplings J_ij ~ N(0, β²/N) (d = 1) and fields ~ N(0, field²)."""
    rng = np.random.default_rng(seed)
    A = np.triu(rng.normal(size=(N, N)) * beta / np.sqrt(N), 1)
    J = A + A.T
    return rng.normal(size=N) * field, J


def f32(*a):
    return tuple(jnp.asarray(x, jnp.float32) for x in a)


def blocks_of(M, N, d):
    return np.stack([M[i * d:(i + 1) * d, i * d:(i + 1) * d] for i in range(N)])


# Shared compiled batch solvers (one compile per method, prior and shape).
def _batched(fn, prior):
    return jax.jit(jax.vmap(lambda X, J: fn(X, J, prior=prior, throw=False)))


BATCH = {(fn.__name__, prior): _batched(fn, prior)
         for fn in (at.adaptive_tap, at.tap, at.naive_mean_field)
         for prior in at.PRIORS}


def _batched_sus(prior):
    return jax.jit(jax.vmap(lambda s, X, J: at.susceptibility(s, X, J, prior=prior)))


SUS = {prior: _batched_sus(prior) for prior in at.PRIORS}


# ----------------------------------------------------------------------------- couplings


def test_block_matrix_quadratic_form():
    rng = np.random.default_rng(0)
    N, d = 4, 3
    J = sym_couplings(rng, N, d, 1.0)
    S = rng.normal(size=(N, d))
    literal = 0.5 * sum(S[i] @ J[i, j] @ S[j] for i in range(N) for j in range(N) if i != j)
    M = np.asarray(at.block_matrix(jnp.asarray(J)))
    np.testing.assert_allclose(M, to_matrix(J), rtol=1e-6)
    np.testing.assert_allclose(0.5 * S.ravel() @ to_matrix(J) @ S.ravel(), literal, rtol=1e-12)


@pytest.mark.parametrize("sites,internal,count", [
    (True, True, lambda N, d: N * (N - 1) // 2 * d * (d + 1) // 2),
    (True, False, lambda N, d: N * (N - 1) // 2 * d * d),
    (False, True, lambda N, d: N * (N - 1) * d * (d + 1) // 2),
    (False, False, lambda N, d: N * (N - 1) * d * d),
])
def test_symmetrize_couplings(sites, internal, count):
    N, d = 4, 3
    rng = np.random.default_rng(1)
    J = jnp.asarray(rng.normal(size=(N, N, d, d)), jnp.float32)
    S = np.asarray(at.symmetrize_couplings(J, sites=sites, internal=internal))
    np.testing.assert_array_equal(S[np.arange(N), np.arange(N)], 0.0)
    if sites:
        np.testing.assert_allclose(S, S.transpose(1, 0, 3, 2), atol=0)
    if internal:
        np.testing.assert_allclose(S, S.transpose(0, 1, 3, 2), atol=0)
    if sites and internal:  # then J_ji = J_ij = J_ijᵀ: a symmetric block matrix
        np.testing.assert_allclose(S, S.transpose(1, 0, 2, 3), atol=0)
        M = to_matrix(S)
        np.testing.assert_allclose(M, M.T, atol=0)
    # an orthogonal projection (idempotent, self-adjoint) onto a space of the stated dimension
    P = jax.jacfwd(lambda v: at.symmetrize_couplings(v.reshape(N, N, d, d), sites=sites,
                                                     internal=internal).ravel())(
        jnp.zeros(N * N * d * d))
    P = np.asarray(P, np.float64)
    np.testing.assert_allclose(P @ P, P, atol=1e-7)
    np.testing.assert_allclose(P, P.T, atol=0)
    assert np.linalg.matrix_rank(P) == count(N, d) == round(np.trace(P))
    # leading batch axes are allowed
    B = at.symmetrize_couplings(jnp.stack([J, 2 * J]), sites=sites, internal=internal)
    np.testing.assert_allclose(B[1], 2 * S, rtol=1e-6)


# ----------------------------------------------------------------------------- single site


def test_site_gaussian_against_quadrature():
    """Mean, covariance and log Z of ρ(S) exp(S·u + ½ SᵀVS), ρ = N(0, I), by quadrature (d = 1,
    2), and as the gradient/Hessian of `site_log_partition`."""
    # d = 1
    u, v = 0.7, 0.45
    s = np.linspace(-14, 14, 20001)
    w = np.exp(-0.5 * s**2 + u * s + 0.5 * v * s**2) / np.sqrt(2 * np.pi)
    Z = np.trapezoid(w, s)
    mean = np.trapezoid(w * s, s) / Z
    var = np.trapezoid(w * s**2, s) / Z - mean**2
    m, C = at.site_moments(jnp.array([u]), jnp.array([[v]]), prior="gaussian")
    np.testing.assert_allclose(m, [mean], rtol=1e-5)
    np.testing.assert_allclose(C, [[var]], rtol=1e-5)
    logz = at.site_log_partition(jnp.array([u]), jnp.array([[v]]), prior="gaussian")
    np.testing.assert_allclose(logz, np.log(Z), rtol=1e-5)
    # d = 2 on a grid
    u = np.array([0.4, -0.9])
    V = np.array([[0.3, 0.25], [0.25, -0.5]])
    g = np.linspace(-10, 10, 801)
    S1, S2 = np.meshgrid(g, g, indexing="ij")
    P = np.stack([S1, S2], -1)
    expo = (-0.5 * np.sum(P * P, -1) + P @ u + 0.5 * np.einsum("xya,ab,xyb->xy", P, V, P))
    w = np.exp(expo) / (2 * np.pi)
    dA = (g[1] - g[0]) ** 2
    Z = w.sum() * dA
    mean = np.einsum("xy,xya->a", w, P) * dA / Z
    cov = np.einsum("xy,xya,xyb->ab", w, P, P) * dA / Z - np.outer(mean, mean)
    m, C = at.site_moments(jnp.asarray(u), jnp.asarray(V), prior="gaussian")
    np.testing.assert_allclose(m, mean, rtol=1e-4)
    np.testing.assert_allclose(C, cov, rtol=1e-4)
    lz = lambda uu, VV: at.site_log_partition(uu, VV, prior="gaussian")  # noqa: E731
    uV = f32(u, V)
    np.testing.assert_allclose(jax.jit(lz)(*uV), np.log(Z), rtol=1e-5)
    np.testing.assert_allclose(jax.jit(jax.grad(lz))(*uV), m, rtol=1e-5)
    np.testing.assert_allclose(jax.jit(jax.hessian(lz))(*uV), C, rtol=1e-5)
    # I − V not positive definite: no distribution, log Z is NaN
    assert np.isnan(at.site_log_partition(jnp.array([0.1]), jnp.array([[1.5]])))


def test_site_binary_against_enumeration():
    rng = np.random.default_rng(2)
    for d in (1, 3):
        u = rng.normal(size=d)
        A = rng.normal(size=(d, d))
        V = A + A.T
        states = np.array(list(itertools.product([-1.0, 1.0], repeat=d)))
        w = np.exp(states @ u + 0.5 * np.einsum("sa,ab,sb->s", states, V, states))
        Z = w.mean()
        p = w / w.sum()
        mean = p @ states
        cov = (states * p[:, None]).T @ states - np.outer(mean, mean)
        m, C = at.site_moments(jnp.asarray(u, jnp.float32), jnp.asarray(V, jnp.float32),
                               prior="binary")
        np.testing.assert_allclose(m, mean, atol=2e-6)
        np.testing.assert_allclose(C, cov, atol=2e-6)
        lz = lambda uu, VV: at.site_log_partition(uu, VV, prior="binary")  # noqa: E731
        uV = f32(u, V)
        np.testing.assert_allclose(jax.jit(lz)(*uV), np.log(Z), rtol=1e-5)
        np.testing.assert_allclose(jax.jit(jax.grad(lz))(*uV), m, atol=2e-6)
        np.testing.assert_allclose(jax.jit(jax.hessian(lz))(*uV), C, atol=2e-6)
    # d = 1: V drops out; saturated spins keep a tiny positive variance, not 1 − 1 = 0 or NaN
    m, C = at.site_moments(jnp.array([12.0]), jnp.array([[5.0]]), prior="binary")
    np.testing.assert_allclose(C[0, 0], 1.0 / np.cosh(12.0) ** 2, rtol=1e-5)
    m, C = at.site_moments(jnp.array([-80.0]), jnp.array([[0.0]]), prior="binary")
    assert m[0] == -1.0 and np.isfinite(C[0, 0]) and C[0, 0] >= 0


# ----------------------------------------------------------------------------- cavity variances


def test_cavity_variances_self_consistency_and_schur():
    """For given local covariances C, the solved V makes [(Λ − 𝐉)⁻¹]_ii = C_i, and equals the
    covariance of the cavity field in the linear-response cavity system,
    V_i = 𝐉_{i,∖i} [(Λ − 𝐉)_{∖i∖i}]⁻¹ 𝐉_{∖i,i} (float64 numpy references)."""
    rng = np.random.default_rng(3)
    N, d = 5, 2
    J = sym_couplings(rng, N, d, 0.8)
    B = rng.normal(size=(N, d, d)) * 0.3
    C = np.einsum("iab,icb->iac", B, B) + 0.4 * np.eye(d)
    sol = at.cavity_variances(*f32(C, J), solver=solvers.Anderson(tol=1e-6))
    assert sol.result == solvers.RESULTS.successful
    V = np.asarray(sol.value, np.float64)
    Lam = V + np.linalg.inv(C)
    L = np.zeros((N * d, N * d))
    for i in range(N):
        L[i * d:(i + 1) * d, i * d:(i + 1) * d] = Lam[i]
    M = L - to_matrix(J)
    chi = np.linalg.inv(M)
    np.testing.assert_allclose(blocks_of(chi, N, d), C, atol=2e-5)
    for i in range(N):
        rest = [k for k in range(N * d) if k // d != i]
        here = list(range(i * d, (i + 1) * d))
        Jb = to_matrix(J)
        schur = Jb[np.ix_(here, rest)] @ np.linalg.solve(M[np.ix_(rest, rest)],
                                                         Jb[np.ix_(rest, here)])
        np.testing.assert_allclose(V[i], schur, atol=2e-5)
    # one update is an identity at the solution
    np.testing.assert_allclose(at.cavity_update(sol.value, *f32(C, J)), sol.value, atol=2e-5)


def test_gaussian_cavity_variances_one_step():
    """Gaussian prior: from any V, one update with C = (I − V)⁻¹ lands on the closed form."""
    X, J = gaussian_problem(4, 6, 2)
    G = np.linalg.inv(np.eye(12) - to_matrix(J))
    want = np.eye(2) - np.linalg.inv(blocks_of(G, 6, 2))
    np.testing.assert_allclose(at.gaussian_cavity_variances(*f32(J)), want, atol=1e-5)
    rng = np.random.default_rng(5)
    V = rng.normal(size=(6, 2, 2)) * 0.1
    V = V + V.transpose(0, 2, 1)
    C = np.linalg.inv(np.eye(2) - V)
    np.testing.assert_allclose(at.cavity_update(*f32(V, C, J)), want, atol=1e-5)


# ----------------------------------------------------------------------------- Gaussian: exact


@pytest.mark.parametrize("N,d", [(5, 1), (6, 2), pytest.param(8, 3, marks=pytest.mark.slow)])
def test_gaussian_exact(N, d):
    """Adaptive TAP reproduces the exact means (I − 𝐉)⁻¹X, the marginal covariances (diagonal
    blocks of (I − 𝐉)⁻¹) and, through `susceptibility`, the whole covariance."""
    X, J = gaussian_problem(10 * N + d, N, d)
    G = np.linalg.inv(np.eye(N * d) - to_matrix(J))
    m_exact = (G @ X.ravel()).reshape(N, d)
    sol = at.adaptive_tap(*f32(X, J))
    assert sol.result == solvers.RESULTS.successful
    np.testing.assert_allclose(sol.value.m, m_exact, atol=1e-4)
    np.testing.assert_allclose(sol.value.V, np.eye(d) - np.linalg.inv(blocks_of(G, N, d)),
                               atol=1e-4)
    C = at.covariances(sol.value, *f32(X, J))
    np.testing.assert_allclose(C, blocks_of(G, N, d), atol=1e-4)
    chi = np.asarray(at.block_matrix(at.susceptibility(sol.value, *f32(X, J))))
    np.testing.assert_allclose(chi, G, atol=1e-4)
    if d != 2:
        return
    # naive mean field: the same (exact) means, but the prior's covariances
    nmf = at.naive_mean_field(*f32(X, J))
    np.testing.assert_allclose(nmf.value.m, m_exact, atol=1e-4)
    np.testing.assert_array_equal(nmf.value.V, 0.0)
    np.testing.assert_allclose(at.covariances(nmf.value, *f32(X, J)),
                               np.broadcast_to(np.eye(d), (N, d, d)), atol=1e-6)
    err_nmf = np.abs(np.eye(d) - blocks_of(G, N, d)).max()
    assert err_nmf > 1e-2  # the couplings are strong enough for the difference to matter


def test_gaussian_convention_against_the_density():
    """The Boltzmann density p(S) ∝ Π_i N(S_i; 0, I) exp(½ Σ_{i≠j} S_iᵀJ_ijS_j + Σ_i X_i·S_i),
    written out term by term: its mean is its mode (one Newton step from 0 is exact for a
    quadratic log-density) and its covariance the inverse negative Hessian; for two coupled
    scalar spins also by quadrature. Any sign or factor-of-two slip in the convention would
    show here."""
    N, d = 6, 2
    X, J = gaussian_problem(7, N, d, lam_max=0.7)

    def log_density(S):
        out = -0.5 * jnp.sum(S * S)
        for i in range(N):
            for j in range(N):
                if i != j:
                    out = out + 0.5 * S[i] @ J[i, j] @ S[j]
        return out + jnp.sum(X * S)

    S0 = jnp.zeros((N, d), jnp.float32)
    H = np.asarray(jax.jit(jax.hessian(log_density))(S0), np.float64).reshape(N * d, N * d)
    g = np.asarray(jax.jit(jax.grad(log_density))(S0), np.float64).ravel()
    cov = np.linalg.inv(-H)
    mean = (cov @ g).reshape(N, d)
    sol = at.adaptive_tap(*f32(X, J))
    np.testing.assert_allclose(sol.value.m, mean, atol=1e-4)
    np.testing.assert_allclose(at.covariances(sol.value, *f32(X, J)), blocks_of(cov, N, d),
                               atol=1e-4)
    # two coupled scalar spins (plus three free, unit-field-free ones) by quadrature
    X2, J2 = np.zeros((5, 1)), np.zeros((5, 5, 1, 1))
    X2[:2, 0] = [0.8, -0.3]
    J2[0, 1] = J2[1, 0] = 0.6
    g = np.linspace(-12, 12, 1201)
    A, B = np.meshgrid(g, g, indexing="ij")
    w = np.exp(-0.5 * (A**2 + B**2) + 0.6 * A * B + 0.8 * A - 0.3 * B)
    Z = w.sum()
    m_q = np.array([(w * A).sum(), (w * B).sum()]) / Z
    var_q = np.array([(w * A**2).sum(), (w * B**2).sum()]) / Z - m_q**2
    sol = at.adaptive_tap(*f32(X2, J2))
    np.testing.assert_allclose(sol.value.m[:2, 0], m_q, rtol=1e-4)
    np.testing.assert_allclose(at.covariances(sol.value, *f32(X2, J2))[:2, 0, 0], var_q,
                               rtol=1e-4)


# ----------------------------------------------------------------------------- binary


def _errors(prior, Xs, Js, m_exact, C_exact, methods):
    """Mean |m − m_exact| per system for each method, and the error of the linear-response
    correlations max |𝛘 − C_exact| (None for classic TAP, whose V is not a linear response)."""
    out = {}
    for name in methods:
        sol = BATCH[(name, prior)](*f32(Xs, Js))
        assert np.all(np.asarray(sol.result) == solvers.RESULTS.successful), name
        m = np.asarray(sol.value.m).reshape(len(Xs), -1)
        chi_err = None
        if name != "tap":
            chi = np.asarray(at.block_matrix(SUS[prior](sol.value, *f32(Xs, Js))))
            chi_err = np.abs(chi - C_exact).max((1, 2))
        out[name] = (np.abs(m - m_exact).mean(1), chi_err)
    return out


def _sk_batch(beta, N=10, seeds=range(8)):
    probs = [sk_problem(s, N, beta) for s in seeds]
    exact = [ising_exact(h, J, 1.0) for h, J in probs]
    Xs = np.stack([h[:, None] for h, _ in probs])
    Js = np.stack([J[:, :, None, None] for _, J in probs])
    return probs, Xs, Js, np.stack([e[1] for e in exact]), np.stack([e[2] for e in exact])


@pytest.mark.parametrize("beta", [0.3, 0.6])
def test_binary_sk_against_enumeration(beta):
    """d = 1, SK couplings J_ij ~ N(0, β²/N), N = 10, eight seeds: exact marginals by brute
    force (float64, energy −(h·s + Σ_{i<j} J_ij s_i s_j), the convention defined here).
    Measured mean |m − m_exact| (naive / adaptive TAP), averaged over seeds: β = 0.3:
    2.1e-2 / 1.1e-3; β = 0.6: 1.2e-1 / 1.0e-2 (classic TAP, in the slow test: 2.0e-3, 2.2e-2);
    linear-response correlations max |𝛘 − C_exact|: β = 0.3: 0.11 / 0.010; β = 0.6:
    0.46 / 0.057."""
    _, Xs, Js, m_exact, C_exact = _sk_batch(beta)
    err = _errors("binary", Xs, Js, m_exact, C_exact, ("naive_mean_field", "adaptive_tap"))
    naive, adaptive = err["naive_mean_field"][0], err["adaptive_tap"][0]
    assert np.all(adaptive < naive)
    assert adaptive.mean() < 0.2 * naive.mean()
    # linear-response correlations: adaptive TAP's are closer to the exact connected ones
    assert err["adaptive_tap"][1].mean() < err["naive_mean_field"][1].mean()


@pytest.mark.slow
@pytest.mark.parametrize("beta", [0.3, 0.6])
def test_binary_sk_classic_tap(beta):
    """Classic TAP (V_i = Σ_j J_ij²(1 − m_j²)) lies between naive mean field and adaptive TAP
    on these small SK systems, and is `spins.ising.tap` at β = 1 (same convention)."""
    probs, Xs, Js, m_exact, C_exact = _sk_batch(beta)
    err = _errors("binary", Xs, Js, m_exact, C_exact, ("naive_mean_field", "tap",
                                                       "adaptive_tap"))
    naive, classic, adaptive = (err[k][0] for k in ("naive_mean_field", "tap", "adaptive_tap"))
    assert adaptive.mean() < classic.mean() < naive.mean()
    sol = at.tap(*f32(Xs[0], Js[0]), prior="binary")
    m_ising = ising.tap(*f32(*probs[0])).value
    np.testing.assert_allclose(sol.value.m[:, 0], m_ising, atol=1e-4)  # both solved to 1e-5


def test_binary_vector_sites_against_enumeration():
    """d = 2 binary sites (two ±1 components each, any 2 × 2 V through exact site sums): the
    model is the Ising model of N d = 10 spins with couplings 𝐉. Measured mean |m − m_exact|
    over six seeds: naive 4.2e-2, classic TAP 4.9e-3, adaptive 1.6e-3; linear-response
    correlations max |𝛘 − C_exact|: naive 0.23, adaptive 0.021."""
    N, d, seeds = 5, 2, range(6)
    Xs, Js, ms, Cs = [], [], [], []
    for s in seeds:
        rng = np.random.default_rng(100 + s)
        J = sym_couplings(rng, N, d, 0.6)
        X = rng.normal(size=(N, d)) * 0.5
        _, m, C = ising_exact(X.ravel(), to_matrix(J), 1.0)
        Xs.append(X), Js.append(J), ms.append(m), Cs.append(C)
    err = _errors("binary", np.stack(Xs), np.stack(Js), np.stack(ms), np.stack(Cs),
                  ("naive_mean_field", "adaptive_tap"))
    naive, adaptive = err["naive_mean_field"][0], err["adaptive_tap"][0]
    assert np.all(adaptive < naive)
    assert adaptive.mean() < 0.1 * naive.mean()
    assert err["adaptive_tap"][1].mean() < 0.2 * err["naive_mean_field"][1].mean()


def test_binary_self_consistency():
    """At an adaptive solution the diagonal blocks of the susceptibility equal the local
    covariances (the defining condition) and the solution is a fixed point of
    `adaptive_tap_update`; the binary cavity variances depend on the fields."""
    N, d = 5, 2
    rng = np.random.default_rng(11)
    J = sym_couplings(rng, N, d, 0.6)
    Xs, Js = f32(rng.normal(size=(6, N, d)), np.stack([J] * 6))  # batch shape as above
    sols = BATCH[("adaptive_tap", "binary")](Xs, Js)
    assert np.all(np.asarray(sols.result) == solvers.RESULTS.successful)
    chi = SUS["binary"](sols.value, Xs, Js)
    C = jax.jit(jax.vmap(lambda s_, X, J: at.covariances(s_, X, J, prior="binary")))(
        sols.value, Xs, Js)
    np.testing.assert_allclose(chi[:, np.arange(N), np.arange(N)], C, atol=2e-5)
    upd = jax.jit(jax.vmap(lambda s_, X, J: at.adaptive_tap_update(s_, X, J, prior="binary")))(
        sols.value, Xs, Js)
    np.testing.assert_allclose(upd.m, sols.value.m, atol=2e-5)
    np.testing.assert_allclose(upd.V, sols.value.V, atol=2e-5)
    assert np.abs(sols.value.V[0] - sols.value.V[1]).max() > 1e-3


# ----------------------------------------------------------------------------- errors, failures


def test_errors():
    X, J = f32(*gaussian_problem(0, 4, 2))
    with pytest.raises(ValueError, match=r"X must have shape \(N, d\)"):
        at.adaptive_tap(X[0], J)
    with pytest.raises(ValueError, match=r"J must have shape"):
        at.adaptive_tap(X, J[..., 0])
    with pytest.raises(ValueError, match=r"J must have shape"):
        at.adaptive_tap(X[:3], J)
    with pytest.raises(ValueError, match="prior='laplace' is not supported"):
        at.adaptive_tap(X, J, prior="laplace")
    with pytest.raises(ValueError, match="MAX_BINARY_DIM"):
        at.site_moments(jnp.zeros(13), jnp.zeros((13, 13)), prior="binary")
    Jbad = J.at[1, 1].set(0.1)
    with pytest.raises(ValueError, match=r"diagonal blocks J\[i, i\] must be zero"):
        at.adaptive_tap(X, Jbad)
    with pytest.raises(ValueError, match=r"diagonal blocks"):
        at.cavity_update(jnp.zeros((4, 2, 2)), jnp.zeros((4, 2, 2)), Jbad)
    with pytest.raises(Exception, match=r"diagonal blocks"):  # traced: raised at run time
        jax.jit(lambda J_: at.gaussian_cavity_variances(J_))(Jbad).block_until_ready()
    with pytest.raises(ValueError, match="state has m"):
        at.covariances(at.TAPState(X[:, :1], jnp.zeros((4, 1, 1))), X, J)
    with pytest.raises(ValueError, match="C must have shape"):
        at.cavity_variances(jnp.zeros((4, 2)), J)
    with pytest.raises(ValueError, match=r"J must have shape \(\.\.\., N, N, d, d\)"):
        at.symmetrize_couplings(jnp.zeros((3, 4, 2, 2)))


def test_failures_are_reported():
    """I − 𝐉 not positive definite (largest eigenvalue of 𝐉 = 1.5): no Gaussian model exists.
    From the default start adaptive TAP does not converge (reported, not raised, with
    throw=False); started at the fixed point of the equations (which exists: (I − 𝐉)⁻¹X and
    the closed-form V) it converges at once, and the solution is rejected."""
    X, J = gaussian_problem(2, 6, 2)
    J = J * 1.5 / np.linalg.eigvalsh(to_matrix(J)).max()
    G = np.linalg.inv(np.eye(12) - to_matrix(J))
    X, J = f32(X, J)
    sol = at.adaptive_tap(X, J, throw=False)
    assert sol.result != solvers.RESULTS.successful
    m_fixed = (G @ np.asarray(X, np.float64).ravel()).reshape(6, 2)
    V_fixed = at.gaussian_cavity_variances(J)
    np.testing.assert_allclose(V_fixed, np.eye(2) - np.linalg.inv(blocks_of(G, 6, 2)), atol=1e-4)
    fixed = at.TAPState(jnp.asarray(m_fixed, jnp.float32), V_fixed)
    sol = at.adaptive_tap(X, J, throw=False, init=fixed)
    assert sol.num_steps <= 1
    assert sol.result == solvers.RESULTS.nonfinite
    assert np.all(np.isnan(sol.value.m)) and np.all(np.isnan(sol.value.V))
    for fn in (at.adaptive_tap, at.naive_mean_field):
        with pytest.raises(Exception, match="I − J is not positive definite"):
            fn(X, J, init=fixed).value.m.block_until_ready()


# ----------------------------------------------------------------------------- gradients


def _grad_problem(prior, N, d):
    rng = np.random.default_rng(21)
    J = jnp.asarray(sym_couplings(rng, N, d, 0.6))
    X = jnp.asarray(rng.normal(size=(N, d)))
    w = jnp.asarray(rng.normal(size=(N, d)))
    D = jnp.asarray(sym_couplings(rng, N, d, 1.0))  # a direction with zero diagonal blocks
    E = jnp.asarray(rng.normal(size=(N, d)))
    solver = solvers.Anderson(tol=1e-13, max_steps=300)

    def loss(X, J, adjoint):
        sol = at.adaptive_tap(X, J, prior=prior, solver=solver, adjoint=adjoint)
        return jnp.sum(w * sol.value.m) + 0.1 * jnp.sum(sol.value.V**2)

    return X, J, w, D, E, loss


_IMPLICIT = solvers.Implicit(linear_solver=solvers.GMRES(restart=5), rtol=1e-12)


@pytest.mark.parametrize("prior,N,d", [
    ("binary", 4, 1), pytest.param("gaussian", 3, 3, marks=pytest.mark.slow)])
def test_gradients(prior, N, d, x64):
    """∂/∂X and ∂/∂J of a scalar of the solution (m and V) through the implicit adjoint,
    against central finite differences (float64); for the Gaussian also ∂/∂X against the
    closed form (I − 𝐉)⁻ᵀ w (V does not depend on X there)."""
    X, J, w, D, E, loss = _grad_problem(prior, N, d)
    vg = jax.jit(jax.value_and_grad(lambda X, J: loss(X, J, _IMPLICIT), argnums=(0, 1)))
    _, (gX, gJ) = vg(X, J)
    f = lambda X, J: vg(X, J)[0]  # noqa: E731  (one compiled function for every evaluation)
    eps = 1e-5
    fd_X = (f(X + eps * E, J) - f(X - eps * E, J)) / (2 * eps)
    fd_J = (f(X, J + eps * D) - f(X, J - eps * D)) / (2 * eps)
    np.testing.assert_allclose(jnp.sum(gX * E), fd_X, rtol=1e-6)
    np.testing.assert_allclose(jnp.sum(gJ * D), fd_J, rtol=1e-6)
    if prior == "gaussian":
        G = np.linalg.inv(np.eye(N * d) - to_matrix(np.asarray(J)))
        np.testing.assert_allclose(gX, (G.T @ np.asarray(w).ravel()).reshape(N, d), atol=1e-9)


@pytest.mark.slow
@pytest.mark.parametrize("prior,N,d", [("gaussian", 3, 2), ("binary", 4, 1)])
def test_gradients_implicit_vs_unrolled(prior, N, d, x64):
    X, J, _, _, _, loss = _grad_problem(prior, N, d)
    gX, gJ = jax.grad(lambda X, J: loss(X, J, _IMPLICIT), argnums=(0, 1))(X, J)
    uX, uJ = jax.grad(lambda X, J: loss(X, J, solvers.Unrolled()), argnums=(0, 1))(X, J)
    np.testing.assert_allclose(gX, uX, atol=1e-8)
    np.testing.assert_allclose(gJ, uJ, atol=1e-8)
