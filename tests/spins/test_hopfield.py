"""Modern Hopfield networks (`spins.hopfield`) and Hopfield attention (`nn.HopfieldAttention`),
checked against the definitions, autodiff, softmax attention and the paper's regimes."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spinformer import nn, solvers
from spinformer.spins import hopfield as hp


@pytest.fixture
def patterns():
    X = jax.random.normal(jax.random.key(0), (8, 16), jnp.float64)
    xi = X[3] + 0.1 * jax.random.normal(jax.random.key(1), (16,), jnp.float64)
    return X, xi


def test_energy_matches_its_definition_and_its_gradient_is_the_update(x64, patterns):
    X, xi = patterns
    Xn = np.asarray(X)
    for beta in (0.05, 1.0, 8.0):
        z = beta * Xn @ np.asarray(xi)
        lse = (np.log(np.sum(np.exp(z - z.max()))) + z.max()) / beta
        M = np.max(np.linalg.norm(Xn, axis=1))
        want = -lse + 0.5 * xi @ xi + np.log(8) / beta + 0.5 * M**2
        np.testing.assert_allclose(hp.energy(xi, X, beta=beta), want, rtol=1e-12)
        # ∇E = ξ − f(ξ): the update is the fixed-point form of a stationary point
        np.testing.assert_allclose(jax.grad(hp.energy)(xi, X, beta=beta),
                                   xi - hp.update(xi, X, beta=beta), atol=1e-12)
    # a mask removes patterns: the same as deleting them
    mask = jnp.arange(8) % 2 == 0
    np.testing.assert_allclose(hp.energy(xi, X, beta=1.0, mask=mask),
                               hp.energy(xi, X[::2], beta=1.0), rtol=1e-12)
    np.testing.assert_allclose(hp.update(xi, X, beta=1.0, mask=mask),
                               hp.update(xi, X[::2], beta=1.0), rtol=1e-12)
    # several states at once equal one at a time (the attention's batched use)
    Z = jnp.stack([xi, X[1], -xi])
    M = jnp.stack([mask, ~mask, jnp.ones(8, bool)])
    np.testing.assert_allclose(hp.update(Z, X, beta=1.0, mask=M),
                               jnp.stack([hp.update(z, X, beta=1.0, mask=m)
                                          for z, m in zip(Z, M)]), rtol=1e-12)
    # a state that sees no pattern gets zero weights, not NaN
    assert np.all(np.asarray(hp.weights(xi, X, beta=1.0, mask=jnp.zeros(8, bool))) == 0)


def test_updates_never_raise_the_energy_and_it_stays_nonnegative(x64):
    """Theorem 1 (CCCP) and Lemma A1, on 20 random instances at three temperatures."""
    for seed in range(20):
        kx, kz = jax.random.split(jax.random.key(seed))
        X = jax.random.normal(kx, (12, 6), jnp.float64) * (1 + seed % 3)
        z = 3.0 * jax.random.normal(kz, (6,), jnp.float64)
        for beta in (0.1, 1.0, 10.0):
            es = []
            for _ in range(15):
                es.append(float(hp.energy(z, X, beta=beta)))
                z = hp.update(z, X, beta=beta)
            assert np.all(np.diff(es) <= 1e-9 * max(1.0, abs(es[0]))), (seed, beta, es)
            assert min(es) >= -1e-9


def test_retrieval_regimes_and_the_one_step_error_bound(x64, patterns):
    """Large β: one update retrieves the nearby pattern, within Theorem 4's bound; small β:
    the fixed point is a metastable average near the mean of all patterns (β → 0)."""
    X, xi = patterns
    assert float(hp.separation(X)[3]) > 10  # well separated
    one = hp.update(xi, X, beta=1.0)
    err = float(jnp.linalg.norm(one - X[3]))
    sol = hp.retrieve(xi, X, beta=1.0, solver=solvers.Picard(tol=1e-12))
    bound = float(hp.retrieval_error_bound(xi, X, 3, beta=1.0, fixed_point=sol.value))
    assert err < 1e-5 and err <= bound < 1e-2
    np.testing.assert_allclose(sol.value, X[3], atol=1e-5)
    small = hp.retrieve(xi, X, beta=0.01, solver=solvers.Picard(tol=1e-12)).value
    assert float(jnp.linalg.norm(small - X.mean(0))) < 0.05 * float(jnp.linalg.norm(X[3]))
    # the bound is a bound: checked on random states near each pattern
    for i in range(8):
        z = X[i] + 0.05 * jax.random.normal(jax.random.key(10 + i), (16,), jnp.float64)
        e = float(jnp.linalg.norm(hp.update(z, X, beta=2.0) - X[i]))
        assert e <= float(hp.retrieval_error_bound(z, X, i, beta=2.0)) + 1e-12


def test_retrieve_gradients_match_finite_differences(x64, patterns):
    X, xi = patterns

    def loss(X, adjoint):
        return jnp.sum(jnp.sin(hp.retrieve(xi, X, beta=0.3, adjoint=adjoint,
                                           solver=solvers.Picard(tol=1e-13)).value))

    g_imp = jax.grad(loss)(X, solvers.Implicit(linear_solver=solvers.GMRES(), rtol=1e-12))
    g_unr = jax.grad(loss)(X, solvers.Unrolled())
    np.testing.assert_allclose(g_imp, g_unr, atol=1e-8)
    d = jax.random.normal(jax.random.key(5), X.shape, jnp.float64)
    eps = 1e-6
    fd = (loss(X + eps * d, None) - loss(X - eps * d, None)) / (2 * eps)
    np.testing.assert_allclose(jnp.sum(g_imp * d), fd, rtol=1e-6)


def test_one_step_is_softmax_attention_with_the_same_projections(getkey):
    soft = nn.SoftmaxAttention(16, 4, causal=True, key=jax.random.key(3))
    hop = nn.HopfieldAttention(16, 4, causal=True, mode="one_step", key=jax.random.key(3))
    # the same four maps (both draw them from the same key the same way)
    for name in ("to_q", "to_k", "to_v", "to_out"):
        assert bool(eqx.tree_equal(getattr(soft, name), getattr(hop, name)))
    x = jax.random.normal(getkey(), (7, 16))
    mask = jax.random.bernoulli(getkey(), 0.7, (7, 7)) | jnp.eye(7, dtype=bool)
    np.testing.assert_allclose(hop(x, mask=mask), soft(x, mask=mask), atol=1e-6)
    ctx = jax.random.normal(getkey(), (5, 16))
    np.testing.assert_allclose(hop(x, context=ctx), soft(x, context=ctx), atol=1e-6)


def test_retrieval_attention_solves_each_query_and_stays_causal(getkey):
    tight = solvers.Picard(tol=1e-6, max_steps=500)
    attn = nn.HopfieldAttention(16, 2, causal=True, beta=2.0, solver=tight, key=getkey())
    x = jax.random.normal(getkey(), (6, 16))
    y, diag = attn(x, return_diagnostics=True)
    assert y.shape == (6, 16) and diag.weights.shape == (2, 6, 6)
    assert np.all(np.asarray(diag.solver.result) == 0) and diag.solver.num_steps.shape == (2,)
    np.testing.assert_allclose(jnp.triu(diag.weights[0], 1), 0.0)  # causal
    # each retrieved state is a fixed point of its query's update over its visible keys
    k = jax.vmap(attn.to_k)(x).reshape(6, 2, 8).transpose(1, 0, 2)
    for h in range(2):
        for i in range(6):
            xi = diag.magnetizations[h, i]
            f = hp.update(xi, k[h], beta=attn.head_beta, mask=jnp.arange(6) <= i)
            np.testing.assert_allclose(f, xi, atol=5e-4)
    # a later token does not change an earlier output
    x2 = x.at[5].set(jax.random.normal(getkey(), (16,)))
    np.testing.assert_allclose(attn(x2)[:5], y[:5], atol=1e-5)
    # steps mode with many steps approaches the fixed point
    many = nn.HopfieldAttention(16, 2, causal=True, beta=2.0, mode="steps", num_steps=60,
                                key=jax.random.key(0))
    fixed = nn.HopfieldAttention(16, 2, causal=True, beta=2.0, mode="fixed_point",
                                 solver=tight, key=jax.random.key(0))
    np.testing.assert_allclose(many(x), fixed(x), atol=1e-3)


def test_hopfield_gradients_and_decoding(getkey):
    attn = nn.HopfieldAttention(8, 2, causal=True, solver=solvers.Picard(tol=1e-6,
                                max_steps=500), adjoint=solvers.Implicit(
        linear_solver=solvers.GMRES(restart=5), rtol=1e-4), key=getkey())
    attn = solvers.record_backward(attn)  # its backward solves observed (as the trainer does)
    x = jax.random.normal(getkey(), (5, 8))
    grads = eqx.filter_grad(lambda a: jnp.sum(a(x) ** 2))(attn)
    g, records = solvers.backward_stats(grads)
    assert np.all(np.isfinite(g.to_q.weight)) and float(jnp.abs(g.to_k.weight).sum()) > 0
    assert len(records) == 1 and float(records[0][0]) == 2  # one backward solve per head
    cache = attn.decode_init(5)
    outs = []
    for t in range(5):
        y, cache = attn.decode(x[t], cache, jnp.asarray(t))
        outs.append(y)
    np.testing.assert_allclose(jnp.stack(outs), attn(x), atol=1e-4)
    assert int(cache["failures"]) == 0


def test_errors():
    with pytest.raises(ValueError, match="mode='fixd_point' is not one of"):
        nn.HopfieldAttention(8, 2, mode="fixd_point", key=jax.random.key(0))
    with pytest.raises(ValueError, match="beta=0"):
        nn.HopfieldAttention(8, 2, beta=0, key=jax.random.key(0))
    with pytest.raises(ValueError, match=r"shape \(d,\) = \(4,\)"):
        hp.energy(jnp.zeros(3), jnp.zeros((5, 4)), beta=1.0)
