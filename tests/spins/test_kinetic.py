"""Kinetic Ising: Plefka[t-1,t] naive/TAP dynamics against exact enumeration and Monte Carlo."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spinformer import solvers
from spinformer.spins import kinetic

from spin_helpers import (
    kinetic_exact_trajectory,
    kinetic_monte_carlo,
    kinetic_one_step,
    kinetic_stationary,
)

BETA = 1.0


@jax.jit
def _one_step(m_prev, x, J):
    m_naive = kinetic.mean_field_step(m_prev, x, J, beta=BETA)
    m_tap = kinetic.tap_step(m_prev, x, J, beta=BETA,
                             solver=solvers.Anderson(tol=1e-7)).value
    C, D = kinetic.correlations(m_tap, m_prev, J, beta=BETA)
    return m_naive, m_tap, C, D


def test_one_step_against_enumeration():
    """From a factorized state, naive errors are O(J²) and TAP errors O(J³); the second-order
    C and D are off by O(J³) only."""
    rng = np.random.default_rng(0)
    n = 6
    J0 = rng.normal(size=(n, n)) / np.sqrt(n)
    x = rng.uniform(-0.5, 0.5, n)
    m_prev = rng.uniform(-0.6, 0.6, n)
    errs = {}
    for eps in (0.2, 0.1):
        J = eps * J0
        m, C, D = kinetic_one_step(m_prev, x, J, BETA)
        mn, mt, Ct, Dt = _one_step(*(jnp.asarray(a, jnp.float32) for a in (m_prev, x, J)))
        errs[eps] = [np.max(np.abs(np.asarray(a) - b)) for a, b in
                     ((mn, m), (mt, m), (Ct, C), (Dt, D))]
        # the delayed correlations themselves are O(J) and C's off-diagonal O(J²)
        assert errs[eps][3] < 0.1 * np.max(np.abs(D))
        assert errs[eps][2] < 0.1 * np.max(np.abs(C - np.diag(np.diag(C))))
    naive_ratio = errs[0.2][0] / errs[0.1][0]
    tap_ratio = errs[0.2][1] / errs[0.1][1]
    assert 3.0 < naive_ratio < 5.0  # ∝ J²
    assert tap_ratio > 6.0  # ∝ J³
    assert errs[0.1][1] < 0.1 * errs[0.1][0]


@pytest.fixture(scope="module")
def chain():
    """A small kinetic Ising chain, its exact trajectory and a Monte Carlo estimate."""
    rng = np.random.default_rng(1)
    n, steps = 5, 8
    J = rng.normal(size=(n, n)) * 0.7 / np.sqrt(n)
    x = rng.uniform(-0.5, 0.5, n)
    m0 = np.ones(n) * 0.8
    exact = kinetic_exact_trajectory(m0, x, J, BETA, steps)
    mc, se = kinetic_monte_carlo(rng, m0, x, J, BETA, steps, chains=40_000)

    @jax.jit
    def sims(m0, x, J):
        return (kinetic.simulate(m0, x, J, beta=BETA, steps=steps, method="mean_field"),
                kinetic.simulate(m0, x, J, beta=BETA, steps=steps, method="tap",
                                solver=solvers.Anderson(tol=1e-7)))

    naive, tap = sims(*(jnp.asarray(a, jnp.float32) for a in (m0, x, J)))
    return dict(exact=exact, mc=mc, se=se, naive=np.asarray(naive), tap=np.asarray(tap),
                m0=m0, x=x, J=J, steps=steps)


def test_monte_carlo_reference_is_sound(chain):
    z = np.abs(chain["mc"] - chain["exact"]) / chain["se"]
    assert np.max(z) < 5.0


def test_trajectories_against_monte_carlo(chain):
    """TAP trajectories track the sampled chain more closely than naive mean field."""
    mc, se = chain["mc"], chain["se"]
    err_naive = np.mean(np.abs(chain["naive"] - mc))
    err_tap = np.mean(np.abs(chain["tap"] - mc))
    assert err_tap < 0.6 * err_naive, (err_tap, err_naive)
    # and both are close to the truth at this weak coupling (statistical slack ~ 4 s.e.)
    assert np.max(np.abs(chain["tap"] - mc)) < 0.03 + 4 * np.max(se)


def test_simulate_matches_manual_steps_and_vmaps(chain):
    J = jnp.asarray(chain["J"], jnp.float32)
    x = jnp.asarray(chain["x"], jnp.float32)
    m = jnp.asarray(chain["m0"], jnp.float32)
    manual = []
    for _ in range(chain["steps"]):
        m = kinetic.mean_field_step(m, x, J, beta=BETA)
        manual.append(m)
    np.testing.assert_allclose(chain["naive"], np.stack(manual), atol=1e-6)
    # per-step fields, vmapped over initial states and over parameter samples
    steps = 3
    xs = jnp.broadcast_to(x, (steps, x.shape[0]))
    m0s = jnp.stack([jnp.asarray(chain["m0"], jnp.float32), -jnp.ones(5)])
    f = jax.vmap(lambda m0: kinetic.simulate(m0, xs, J, beta=BETA, steps=steps))
    assert f(m0s).shape == (2, steps, 5)
    g = jax.vmap(lambda s: kinetic.simulate(m0s[0], x, s * J, beta=BETA, steps=steps))
    assert g(jnp.array([0.5, 1.0, 2.0])).shape == (3, steps, 5)
    np.testing.assert_allclose(f(m0s)[0], chain["naive"][:steps], atol=1e-6)


def test_zero_coupling():
    x = jnp.array([0.3, -0.2, 1.0, 0.0, 0.5])
    J = jnp.zeros((5, 5))
    m_prev = jnp.zeros(5)
    mn, mt, C, D = _one_step(m_prev, x, J)
    want = np.tanh(BETA * np.asarray(x))
    np.testing.assert_allclose(mn, want, atol=1e-6)
    np.testing.assert_allclose(mt, want, atol=1e-6)
    np.testing.assert_allclose(D, 0.0, atol=1e-7)
    np.testing.assert_allclose(C, np.diag(1 - want**2), atol=1e-6)


def test_entropy_production_against_exact_stationary_chain():
    """σ = β Σ (J_ij − J_ji) D_ij equals the exact KL rate between forward and reversed
    transitions of the stationary chain; with the second-order D it is close to it."""
    rng = np.random.default_rng(2)
    n = 4
    J = rng.normal(size=(n, n)) * 0.2 / np.sqrt(n)
    x = rng.uniform(-0.3, 0.3, n)
    pi, W, S = kinetic_stationary(x, J, BETA)
    joint = W * pi[None, :]  # P(s_t = a, s_{t-1} = b)
    sigma_exact = np.sum(joint * (np.log(W) - np.log(W.T)))
    m = pi @ S
    D = S.T @ joint @ S - np.outer(m, m)  # ⟨s_i,t s_j,t−1⟩ − m_i m_j
    sigma = kinetic.entropy_production(jnp.asarray(J), jnp.asarray(D), beta=BETA)
    np.testing.assert_allclose(sigma, sigma_exact, rtol=1e-4)
    assert sigma_exact > 0
    # mean-field steady state and its second-order delayed correlations
    m_ss = kinetic.simulate(jnp.zeros(n), jnp.asarray(x, jnp.float32),
                            jnp.asarray(J, jnp.float32), beta=BETA, steps=60, method="tap")
    _, D_tap = kinetic.correlations(m_ss[-1], m_ss[-2], jnp.asarray(J, jnp.float32), beta=BETA)
    sigma_tap = kinetic.entropy_production(jnp.asarray(J, jnp.float32), D_tap, beta=BETA)
    assert abs(float(sigma_tap) - sigma_exact) < 0.1 * sigma_exact
    # symmetric couplings produce no entropy
    np.testing.assert_allclose(float(kinetic.entropy_production(J + J.T, D)), 0.0, rtol=0, atol=1e-12)


# GMRES with a full Krylov basis solves the (5 × 5) adjoint system essentially exactly; the
# default Anderson linear solver stops at its 1e-5 relative residual, too loose for rtol 1e-6.
# (a tight backward tolerance: GMRES stops where it is met, and the gradients are compared
# with central differences to 1e-6)
_GMRES_ADJOINT = solvers.Implicit(linear_solver=solvers.GMRES(restart=5), rtol=1e-10)


def test_tap_step_gradients_finite_differences(x64):
    rng = np.random.default_rng(3)
    n = 5
    m_prev = jnp.asarray(rng.uniform(-0.5, 0.5, n))
    x = jnp.asarray(rng.normal(size=n) * 0.5)
    J = jnp.asarray(rng.normal(size=(n, n)) * 0.6 / np.sqrt(n))
    w = jnp.asarray(rng.normal(size=n))

    def loss(m_prev, x, J):
        sol = kinetic.tap_step(m_prev, x, J, beta=0.9, solver=solvers.Anderson(tol=1e-13),
                               adjoint=_GMRES_ADJOINT)
        return jnp.dot(w, sol.value)

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(m_prev, x, J)
    batched = jax.jit(jax.vmap(loss))
    eps = 1e-6
    for k, a in enumerate((m_prev, x, J)):
        E = eps * np.eye(a.size).reshape((a.size,) + a.shape)
        args_p = [jnp.broadcast_to(b, (a.size,) + b.shape) for b in (m_prev, x, J)]
        args_m = list(args_p)
        args_p[k] = a + E
        args_m[k] = a - E
        fd = ((batched(*args_p) - batched(*args_m)) / (2 * eps)).reshape(a.shape)
        np.testing.assert_allclose(grads[k], fd, rtol=1e-6, atol=1e-9)


def test_errors():
    with pytest.raises(ValueError, match="method"):
        kinetic.simulate(jnp.zeros(3), jnp.zeros(3), jnp.zeros((3, 3)), steps=2, method="x")
    with pytest.raises(ValueError, match="x must have shape"):
        kinetic.simulate(jnp.zeros(3), jnp.zeros((4, 3)), jnp.zeros((3, 3)), steps=2)
    with pytest.raises(ValueError, match="steps"):
        kinetic.simulate(jnp.zeros(3), jnp.zeros(3), jnp.zeros((3, 3)), steps=0)
    with pytest.raises(ValueError, match="shape"):
        kinetic.tap_step(jnp.zeros(3), jnp.zeros(3), jnp.zeros((2, 2)))
    assert solvers.RESULTS.successful == 0
