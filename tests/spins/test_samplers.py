"""Samplers against exact enumeration (brute-force numpy), and the DQA simulator's limits."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spinformer.spins import ising, samplers

from spin_helpers import all_configs, ising_energy_terms, ising_exact, random_symmetric

N = 6
NUM_SAMPLES = 8000
BETAS = jnp.array([1.0, 0.6, 0.35, 0.2])

# shared jitted samplers (one compile per sampler and K/no-K)
_gibbs = jax.jit(lambda h, J, K, key: samplers.gibbs(h, J, key=key, num_samples=NUM_SAMPLES,
                                                     burn_in=100, K=K))
_pt = jax.jit(lambda h, J, K, key: samplers.parallel_tempering(
    h, J, key=key, betas=BETAS, num_samples=NUM_SAMPLES, burn_in=100, K=K,
    return_swap_rate=True))


def _problem(seed, three_body, scale=1.5):
    rng = np.random.default_rng(seed)
    h = rng.normal(size=N) * 0.5
    J = random_symmetric(rng, N, scale)
    K = rng.normal(size=(N, N, N)) * 0.3 if three_body else None
    f32 = lambda a: None if a is None else np.asarray(a, np.float32)  # noqa: E731
    return f32(h), f32(J), f32(K)


def _assert_matches(samples, m_exact):
    samples = np.asarray(samples)
    assert samples.shape == (NUM_SAMPLES, N)
    assert set(np.unique(samples)) <= {-1.0, 1.0}
    mean, err = samplers.batch_means(samples, num_batches=20)
    # 5 standard errors (batch means over 400-sweep batches), plus a floor for the noise of
    # the error estimate itself
    np.testing.assert_array_less(np.abs(mean - m_exact), 5 * np.asarray(err) + 5e-3)


@pytest.mark.parametrize("three_body", [False, True])
def test_gibbs_matches_exact(three_body, getkey):
    h, J, K = _problem(1 + three_body, three_body)
    _assert_matches(_gibbs(h, J, K, getkey()), ising_exact(h, J, 1.0, K)[1])


@pytest.mark.parametrize("three_body", [False, True])
def test_parallel_tempering_matches_exact(three_body, getkey):
    h, J, K = _problem(3 + three_body, three_body)
    samples, rate = _pt(h, J, K, getkey())
    _assert_matches(samples, ising_exact(h, J, 1.0, K)[1])
    assert rate.shape == (3,) and np.all((rate > 0.05) & (rate <= 1.0))


def test_parallel_tempering_crosses_barriers(getkey):
    """A strongly ferromagnetic system with a weak field: single-spin Gibbs at β = 1 is stuck
    in one of the two ordered states, tempering visits both in the right proportion."""
    J = np.full((N, N), 1.2, np.float32) / N * 4
    np.fill_diagonal(J, 0.0)
    h = np.full(N, 0.02, np.float32)
    m_exact = ising_exact(h, J, 1.0)[1]
    samples, _ = _pt(h, J, None, getkey())
    np.testing.assert_allclose(np.mean(samples, 0), m_exact, atol=0.12)


def test_gibbs_thinning_and_temperature(getkey):
    h, J, _ = _problem(5, False, scale=0.8)
    beta = 0.5
    s = samplers.gibbs(h, J, key=getkey(), num_samples=2000, burn_in=10, thin=3, beta=beta,
                       init=-np.ones(N, np.float32))
    assert s.shape == (2000, N)
    mean, err = samplers.batch_means(s)
    m_exact = ising_exact(h, J, beta)[1]
    np.testing.assert_array_less(np.abs(mean - m_exact), 5 * np.asarray(err) + 1e-2)


# ----------------------------------------------------------------------------- DQA

_H4 = np.array([0.3, -0.5, 0.8, 0.2], np.float32)
_J4 = np.zeros((4, 4), np.float32)
_J4[0, 1] = _J4[1, 0] = 0.5
_J4[2, 3] = _J4[3, 2] = -0.4


def _ground_index(h, J):
    """Index b of the lowest-energy configuration, with spin k = 1 − 2·bit_k(b)."""
    S = all_configs(len(h))  # itertools order: spin 0 is the most significant
    s = S[np.argmax(ising_energy_terms(S, h, J))]
    return int(sum(((1 - int(v)) // 2) << k for k, v in enumerate(s)))


_dqa_state = jax.jit(samplers.dqa_state, static_argnames="steps")


def test_dqa_slow_anneal_finds_ground_state():
    """Adiabatic limit: a slow anneal ends in the (unique) classical ground state."""
    p = np.abs(np.asarray(_dqa_state(_H4, _J4, steps=800, total_time=60.0))) ** 2
    assert p[_ground_index(_H4, _J4)] > 0.9


def test_dqa_no_time_is_uniform(getkey):
    p = np.abs(np.asarray(_dqa_state(_H4, _J4, steps=10, total_time=0.0))) ** 2
    np.testing.assert_allclose(p, np.full(16, 1 / 16), atol=1e-6)
    samples = np.asarray(samplers.dqa(_H4, _J4, key=getkey(), num_samples=4000, steps=10,
                                      total_time=0.0))
    assert set(np.unique(samples)) <= {-1.0, 1.0}
    counts = np.bincount(((samples < 0) * (1 << np.arange(4))).sum(1), minlength=16)
    sigma = np.sqrt(4000 * (1 / 16) * (15 / 16))
    assert np.all(np.abs(counts - 4000 / 16) < 5 * sigma)


def test_dqa_norm_and_fast_anneal_bias():
    """Unitary evolution keeps the norm; the seed's fast anneal (200 steps, τ = 5) already
    favours low energies, with the three-body term too."""
    h, J, K = _problem(7, True)
    psi = _dqa_state(h, J, steps=200, total_time=5.0, K=K)
    p = np.abs(np.asarray(psi, np.complex128)) ** 2
    np.testing.assert_allclose(p.sum(), 1.0, atol=1e-5)
    S = np.array([[1 - 2 * ((b >> k) & 1) for k in range(N)] for b in range(2**N)], float)
    neg_e = ising_energy_terms(S, h.astype(float), J.astype(float), K.astype(float))
    assert p @ neg_e > neg_e.mean() + 0.5 * neg_e.std()


def test_straight_through():
    est = jnp.array([0.5, -0.2])
    f = lambda x: samplers.straight_through(est, jnp.tanh(x))  # noqa: E731
    x = jnp.array([0.1, 0.3])
    np.testing.assert_allclose(f(x), est)
    np.testing.assert_allclose(jax.jacobian(f)(x), np.diag(1 - np.tanh(x) ** 2), rtol=1e-6)


def _mean_field_update_reference(m, h, J, beta, K=None):
    """tanh(β(h + J m + ½ Ks:mm)) in plain jnp, Ks the symmetric three-body tensor built entry
    by entry from K[j, k, l], j < k < l (zero on repeated indices)."""
    local = h + J @ m
    if K is not None:
        n = m.shape[0]
        Ks = jnp.zeros((n, n, n), K.dtype)
        for j, k, l in itertools.combinations(range(n), 3):
            for p in itertools.permutations((j, k, l)):
                Ks = Ks.at[p].set(K[j, k, l])
        local = local + 0.5 * jnp.einsum("jkl,k,l->j", Ks, m, m)
    return jnp.tanh(beta * local)


@pytest.mark.parametrize("three_body", [False, True])
def test_straight_through_mean_field(three_body, x64):
    """The value of the estimate, the derivatives (w.r.t. h, J and K) of one mean-field update
    at the estimate held fixed; no gradient reaches the estimate."""
    h, J, K = (None if a is None else jnp.asarray(a, jnp.float64)
               for a in _problem(8 + three_body, three_body, scale=0.8))
    est = jnp.asarray(np.random.default_rng(10).uniform(-0.9, 0.9, N))
    beta = 0.7

    def ours(h_, J_, K_, est_):
        return samplers.straight_through_mean_field(est_, h_, J_, beta=beta, K=K_)

    def ref(h_, J_, K_):
        return _mean_field_update_reference(est, h_, J_, beta, K_)

    # s + (estimate − s): equal to the estimate up to one rounding
    np.testing.assert_allclose(ours(h, J, K, est), est, rtol=0, atol=4e-16)
    np.testing.assert_allclose(ising.mean_field_update(est, h, J, beta=beta, K=K),
                               ref(h, J, K), rtol=1e-13, atol=1e-14)
    argnums = (0, 1, 2) if three_body else (0, 1)
    got = jax.jit(jax.jacobian(ours, argnums=argnums + (3,)))(h, J, K, est)
    want = jax.jit(jax.jacobian(ref, argnums=argnums))(h, J, K)
    for g, w_ in zip(got, want):
        assert g.shape == w_.shape
        np.testing.assert_allclose(g, w_, rtol=1e-13, atol=1e-14)
    assert np.any(np.asarray(want[1]) != 0.0)
    np.testing.assert_array_equal(got[-1], 0.0)  # the estimate's gradient is stopped
    if three_body:  # only K[j, k, l] with j < k < l is used
        j, k, l = np.meshgrid(*(np.arange(N),) * 3, indexing="ij")
        assert np.all(np.asarray(got[2])[:, ~((j < k) & (k < l))] == 0.0)
        assert np.any(np.asarray(got[2]) != 0.0)
    # under vmap over a batch of estimates and fields, as a sampler-trained layer calls it:
    # d Σ sin(m̃)/dh = cos(estimate) · ∂(mean-field update)/∂h
    ests = jnp.stack([est, -est, jnp.zeros(N)])
    hs = jnp.stack([h, 0.5 * h, -h])
    g = jax.grad(lambda h_: jnp.sum(jnp.sin(jax.vmap(
        lambda e, hq: ours(hq, J, K, e))(ests, h_))))(hs)
    g_ref = jax.grad(lambda h_: jnp.sum(jnp.cos(ests) * jax.vmap(
        lambda e, hq: _mean_field_update_reference(e, hq, J, beta, K))(ests, h_)))(hs)
    np.testing.assert_allclose(g, g_ref, rtol=1e-13, atol=1e-14)


def test_input_validation(getkey):
    h, J, K = _problem(0, True)
    with pytest.raises(ValueError, match="n <= 12"):
        samplers.dqa(np.zeros(13), np.zeros((13, 13)), key=getkey(), num_samples=2, steps=2)
    with pytest.raises(ValueError, match="num_samples"):
        samplers.gibbs(h, J, key=getkey(), num_samples=0, burn_in=1)
    with pytest.raises(ValueError, match="betas"):
        samplers.parallel_tempering(h, J, key=getkey(), betas=jnp.ones(1), num_samples=2)
    with pytest.raises(ValueError, match="J must have shape"):
        samplers.gibbs(h, J[:3, :3], key=getkey(), num_samples=2, burn_in=1)
    with pytest.raises(ValueError, match="K must have shape"):
        samplers.dqa_state(h, J, K=K[:2], steps=2, total_time=1.0)
    with pytest.raises(ValueError, match="same shape"):
        samplers.straight_through(jnp.ones(2), jnp.ones(3))


def test_vmap_over_queries(getkey):
    """One system per call; the caller vmaps over queries (fields) with one key each."""
    h = np.stack([_H4, -_H4, 0 * _H4])
    keys = jax.random.split(getkey(), 3)
    g = jax.jit(jax.vmap(lambda h_, k: samplers.gibbs(h_, _J4, key=k, num_samples=50,
                                                      burn_in=5)))(h, keys)
    d = jax.jit(jax.vmap(lambda h_, k: samplers.dqa(h_, _J4, key=k, num_samples=50, steps=5,
                                                    total_time=1.0)))(h, keys)
    for s in (g, d):
        assert s.shape == (3, 50, 4) and set(np.unique(np.asarray(s))) <= {-1.0, 1.0}
