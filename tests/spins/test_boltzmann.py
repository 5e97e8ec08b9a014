"""Exact Boltzmann-attention marginals against brute-force numpy and `ising.exact_marginals`."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from spinformer.spins import ising
from spinformer.spins import _boltzmann
from spinformer.spins._boltzmann import boltzmann_marginals

from spin_helpers import ising_exact, random_symmetric

_jit = jax.jit(boltzmann_marginals, static_argnames="causal")


def _problem(seed, Q, T, three_body, dtype=np.float32):
    rng = np.random.default_rng(seed)
    h = rng.normal(size=(Q, T))
    J = random_symmetric(rng, T, 1.5)
    K = rng.normal(size=(T, T, T)) * 0.3 if three_body else None
    return h.astype(dtype), J.astype(dtype), None if K is None else K.astype(dtype)


def _reference(h, J, causal, K=None):
    """Per query, a plain numpy loop over the configurations of its visible positions."""
    Q, T = h.shape
    out = np.zeros((Q, T))
    for q in range(Q):
        n = min(q + 1, T) if causal else T
        Kq = None if K is None else K[:n, :n, :n]
        out[q, :n] = ising_exact(h[q, :n], J[:n, :n], 1.0, Kq)[1]
    return out


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("three_body", [False, True])
def test_matches_brute_force(causal, three_body):
    Q = 6 if causal else 4
    h, J, K = _problem(1 + causal + 2 * three_body, Q, 6, three_body)
    got = _jit(h, J, causal=causal, K=K)
    np.testing.assert_allclose(got, _reference(h, J, causal, K), atol=2e-6)
    if causal:  # invisible positions are exactly 0
        assert np.all(np.asarray(got)[np.triu_indices(6, 1)] == 0.0)


def test_chunked_and_vmapped_against_numpy():
    """T = 14 > 12 goes through several levels of chunks; jitted and vmapped (batch 2)
    against plain numpy (guards against XLA CPU miscompiling broadcast-and-reduce code)."""
    T = 14
    h, J, _ = _problem(5, T, T, False)
    h2 = np.stack([h, -0.5 * h])
    f = jax.jit(jax.vmap(lambda h_: boltzmann_marginals(h_, J, causal=True)))
    got = np.asarray(f(h2))
    for b in range(2):
        np.testing.assert_allclose(got[b], _reference(h2[b], J, True), atol=5e-6)
    # non-causal, fewer queries than positions
    got = _jit(h[:3], J, causal=False)
    np.testing.assert_allclose(got, _reference(h[:3], J, False), atol=5e-6)


def test_agrees_with_ising_exact_marginals():
    """Query q's magnetizations are those of the Ising model on its visible positions
    (ising's convention: E = −(h·s + ½ sᵀJs + Σ K sss), weight exp(−E), β = 1)."""
    T = 7
    h, J, K = _problem(7, T, T, True)
    got = np.asarray(_jit(h, J, causal=True, K=K))
    for q in [0, 3, 6]:
        n = q + 1
        want = jax.jit(ising.exact_marginals)(h[q, :n], J[:n, :n], K=K[:n, :n, :n])
        np.testing.assert_allclose(got[q, :n], want, atol=2e-6)


def test_zero_couplings_is_sigmoid_attention():
    """J = 0 factorises: ⟨s_j⟩ = tanh(h_j) (seed Eq. 7, α = σ(2h))."""
    h, _, _ = _problem(3, 5, 5, False)
    got = _jit(h, np.zeros((5, 5), np.float32), causal=False)
    np.testing.assert_allclose(got, np.tanh(h), atol=1e-6)


def test_gradients_match_finite_differences(x64):
    T = 5
    h, J, K = _problem(11, T, T, True, np.float64)
    w = np.random.default_rng(0).normal(size=(T, T))

    @jax.jit
    def loss(h_, J_, K_):
        return jnp.sum(w * jnp.sin(boltzmann_marginals(h_, J_, causal=True, K=K_)))

    check_grads(loss, (h, J, K), order=1, modes=["rev"], eps=1e-6, atol=1e-6, rtol=1e-6)
    # fluctuation–dissipation: ∂⟨s_j⟩/∂h_k is the connected correlation (seed Eq. 10)
    jac = jax.jit(jax.jacobian(lambda hq: boltzmann_marginals(hq[None], J, causal=False)[0]))
    np.testing.assert_allclose(jac(h[2]), ising_exact(h[2], J, 1.0)[2], atol=1e-10)
    # invisible fields get no gradient
    g = jax.jit(jax.grad(lambda h_: jnp.sum(boltzmann_marginals(h_, J, causal=True))))(h)
    assert np.all(np.asarray(g)[np.triu_indices(T, 1)] == 0.0)


@pytest.mark.parametrize("Q", [8, 5, 11])
def test_small_tables_exercise_tiers_and_blocks(monkeypatch, x64, Q):
    """With tables of at most 2^4 rows in tiers of 2 bits and blocks of 2 columns, T = 8
    goes through every path of the layout: causal queries below the smallest tier (masked
    rows), several tiers, several columns per query, padded blocks under `lax.map`, queries
    past T (Q = 11), three-body couplings (Q = 8); values, and gradients."""
    monkeypatch.setattr(_boltzmann, "_ROW_BITS", 4)
    monkeypatch.setattr(_boltzmann, "_TIER_STEP", 2)
    monkeypatch.setattr(_boltzmann, "_BLOCK_ENTRIES", 32)
    n_vis = np.minimum(np.arange(Q) + 1, 8)
    plan = _boltzmann._column_plan(n_vis, 8)
    assert [r for r, *_ in plan] == [2, 4]
    assert len(plan[0][1]) == 1 + 1 + 2  # n = 1 (masked), 2, 3
    assert len(plan[1][1]) == sum(2 ** (n - 4) for n in n_vis if n >= 4)
    assert np.all(plan[0][3] == [2, 4, 4, 4])  # rows: 2^1 for n = 1, then all 2^2
    T = 8
    h, J, K = _problem(Q, Q, T, Q == 8, np.float64)
    for causal in (True, False):
        f = jax.jit(lambda h_, J_, K_: boltzmann_marginals(h_, J_, causal=causal, K=K_))
        np.testing.assert_allclose(f(h, J, K), _reference(h, J, causal, K), atol=1e-12)
    if Q != 5:
        w = np.random.default_rng(1).normal(size=(Q, T))
        loss = jax.jit(lambda h_, J_, K_: jnp.sum(w * jnp.sin(boltzmann_marginals(
            h_, J_, causal=True, K=K_))))
        check_grads(loss, (h, J, K), order=1, modes=["rev"], eps=1e-6, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("causal", [True, False])
def test_vmap_shares_tables_across_the_batch(monkeypatch, x64, causal):
    """Under vmap with shared couplings the batch's columns go into shared tables (groups of
    instances, the last one padded); with per-instance couplings it is a plain vmap. Values
    and gradients (h, J, K) against one call per instance."""
    monkeypatch.setattr(_boltzmann, "_BLOCK_ENTRIES", 2**9)  # groups of a few instances
    B, T = 5, 10
    rng = np.random.default_rng(3)
    hs = rng.normal(size=(B, T, T))
    _, J, K = _problem(4, T, T, True, np.float64)
    Js = np.stack([J * (1 + 0.1 * i) for i in range(B)])
    w = rng.normal(size=(B, T, T))

    def one(h_, J_, K_):
        return boltzmann_marginals(h_, J_, causal=causal, K=K_)

    def loss_shared(h_, J_, K_):
        return jnp.sum(w * jnp.sin(jax.vmap(one, (0, None, None))(h_, J_, K_)))

    def loss_each(h_, J_, K_):
        return sum(jnp.sum(w[i] * jnp.sin(one(h_[i], J_, K_))) for i in range(B))

    got = jax.jit(jax.vmap(one, (0, None, None)))(hs, J, K)
    want = np.stack([_reference(hs[i], J, causal, K) for i in range(B)])
    np.testing.assert_allclose(got, want, atol=1e-12)
    g_shared = jax.jit(jax.grad(loss_shared, argnums=(0, 1, 2)))(hs, J, K)
    g_each = jax.jit(jax.grad(loss_each, argnums=(0, 1, 2)))(hs, J, K)
    for a, b in zip(g_shared, g_each):
        np.testing.assert_allclose(a, b, atol=1e-11)
    # per-instance couplings (as heads are): an ordinary vmap, same values
    got = jax.jit(jax.vmap(lambda h_, J_: one(h_, J_, None)))(hs, Js)
    for i in range(B):
        np.testing.assert_allclose(got[i], _reference(hs[i], Js[i], causal), atol=1e-12)


def _twenty():
    T = 20
    h, J, _ = _problem(20, T, T, False)
    return 0.5 * h, J


def test_twenty_positions_chunked():
    """T = 20 (2^20 configurations × 20 queries) runs in chunks: XLA's temporary memory stays
    far below the 80 MiB a materialised table of weights would take, and float32 stays
    accurate (chunked log-sum-exps)."""
    h, J = _twenty()
    fwd = jax.jit(lambda h_, J_: boltzmann_marginals(h_, J_, causal=True)).lower(h, J).compile()
    mem = fwd.memory_analysis()
    if mem is not None:
        assert mem.temp_size_in_bytes < 32 * 2**20
    got = np.asarray(fwd(h, J))
    np.testing.assert_allclose(got[19], jax.jit(ising.exact_marginals)(h[19], J), atol=1e-5)
    np.testing.assert_allclose(got[13, :14], ising_exact(h[13, :14], J[:14, :14], 1.0)[1],
                               atol=1e-5)
    assert np.all(got[12, 13:] == 0.0)


@pytest.mark.slow
def test_twenty_positions_backward_memory():
    """The backward pass rematerialises chunks, so it stays memory-bounded too."""
    h, J = _twenty()
    grad = jax.jit(jax.grad(lambda h_, J_: jnp.sum(jnp.sin(boltzmann_marginals(h_, J_))),
                            argnums=(0, 1))).lower(h, J).compile()
    mem = grad.memory_analysis()
    if mem is not None:
        assert mem.temp_size_in_bytes < 32 * 2**20
    gh, gJ = grad(h, J)
    assert np.all(np.isfinite(gh)) and np.all(np.isfinite(gJ))


def test_input_validation():
    h, J, K = _problem(0, 4, 4, True)
    with pytest.raises(ValueError, match=r"shape \(Q, T\)"):
        boltzmann_marginals(h[0], J)
    with pytest.raises(ValueError, match="J must have shape"):
        boltzmann_marginals(h, J[:3, :3])
    with pytest.raises(ValueError, match="K must have shape"):
        boltzmann_marginals(h, J, K=K[:3])
    with pytest.raises(ValueError, match="mean_field"):
        boltzmann_marginals(np.zeros((2, 25), np.float32), np.zeros((25, 25), np.float32))
