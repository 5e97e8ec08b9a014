"""NeuroGame attention: Algorithm 1 against a NumPy re-implementation with the same draws, the
mean field against `spins.ising`, game values against brute force, gradients against finite
differences, masking, padding and normalisation."""

import itertools
import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spinformer import config as C
from spinformer import nn, solvers
from spinformer.nn._neurogame import PaperValues
from spinformer.spins import coalitions, ising

DIM, HEADS = 8, 2

# jitted calls shared by the tests (each module configuration compiles once)
call = eqx.filter_jit(lambda a, x, **kw: a(x, **kw))
pool = eqx.filter_jit(lambda a, x, **kw: a.pool(x, **kw))


def make(mode="pooled", estimator="exact", seed=0, **kw):
    return nn.NeuroGameAttention(DIM, HEADS, mode=mode, estimator=estimator,
                                 key=jax.random.key(seed), **kw)


def tokens(n, seed=1, scale=1.0):
    return scale * jax.random.normal(jax.random.key(seed), (n, DIM))


def heads_of(a, x, linear):
    return np.asarray(jax.vmap(linear)(x)).reshape(x.shape[0], HEADS, -1).transpose(1, 0, 2)


# --------------------------------------------------------------- Algorithm 1, as printed


def numpy_algorithm1(V, lam, draws, gamma, tol, T):
    """Algorithm 1 of the NGT paper for one head, in float64 NumPy, with given draws."""
    V = np.asarray(V, np.float64)
    n = V.shape[0]
    m = n
    K = draws.sizes.shape[1]

    def v(mask):
        return np.linalg.norm(np.asarray(mask, np.float64) @ V)

    def normalised(raw):
        raw = np.asarray(raw)
        return raw / raw.sum()

    phi, beta, J = np.zeros(n), np.zeros(n), np.zeros((n, n))
    for i in range(n):
        W, M = [], []
        for k in range(K):
            P = np.asarray(draws.prefixes[i, k])
            r = int(draws.sizes[i, k])
            assert P.sum() == r and not P[i]
            p = math.factorial(r) * math.factorial(m - 1 - r) / math.factorial(m - 1)
            with_i = P.copy()
            with_i[i] = True
            W.append(np.exp(v(P) / gamma) / p)
            M.append(v(with_i) - v(P))
        phi[i] = normalised(W) @ np.array(M)
        W, M = [], []
        for k in range(K):
            Cm = np.asarray(draws.coalitions[i, k])
            with_i = Cm.copy()
            with_i[i] = True
            W.append(np.exp(v(Cm) / gamma) * 2.0 ** (m - 1))
            M.append(v(with_i) - v(Cm))
        beta[i] = normalised(W) @ np.array(M)
    for p_idx, (i, j) in enumerate(zip(*np.triu_indices(n, 1))):
        W, D = [], []
        for k in range(K):
            Cm = np.asarray(draws.pair_coalitions[p_idx, k])
            ci, cj, cij = Cm.copy(), Cm.copy(), Cm.copy()
            ci[i] = cij[i] = True
            cj[j] = cij[j] = True
            W.append(np.exp(v(Cm) / gamma) * 2.0 ** (m - 2))
            D.append(v(cij) - v(ci) - v(cj) + v(Cm))
        J[i, j] = J[j, i] = normalised(W) @ np.array(D)
    field = lam * phi / np.abs(phi).sum() + (1 - lam) * beta / np.abs(beta).sum()
    s = np.zeros(n)
    for _ in range(T):
        s_old = s
        s = np.tanh((field + J @ s_old) / gamma)
        if np.max(np.abs(s - s_old)) < tol:
            break
    alpha = (1 + s) / 2
    return alpha @ V, alpha, field, J


def test_pooled_layer_matches_numpy_algorithm1():
    n, K, gamma = 6, 7, 1.0
    a = make("pooled", "paper", gamma=gamma, normalize="none",
             train_samples=K, solver=solvers.Picard(tol=1e-6, max_steps=25),
             adjoint=solvers.Unrolled())
    x = tokens(n, scale=0.5)
    key = jax.random.key(7)
    z, diag = pool(a, x, key=key, return_diagnostics=True)
    V = heads_of(a, x, a.to_v)
    lam = np.asarray(jax.nn.sigmoid(jax.vmap(a.gate_proj)(x))).T
    keys = jax.random.split(key, HEADS)
    zs = []
    for h in range(HEADS):
        draws = jax.tree.map(np.asarray, coalitions._ngt_draw(keys[h], n, K, jnp.ones(n, bool)))
        z_h, alpha, field, J = numpy_algorithm1(V[h], lam[h], draws, gamma, tol=1e-6, T=25)
        np.testing.assert_allclose(diag.fields[h, 0], field, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(diag.couplings[h, 0], J, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(diag.weights[h, 0], alpha, rtol=1e-4, atol=1e-5)
        zs.append(z_h)
    expected = np.asarray(a.to_out.weight) @ np.concatenate(zs)
    np.testing.assert_allclose(z, expected, rtol=1e-4, atol=1e-5)
    # the layer's output is the pooled z at every position
    np.testing.assert_allclose(call(a, x, key=key), np.broadcast_to(z, (n, DIM)), rtol=1e-5)


# --------------------------------------------------------------- game values and mean field


def brute_shapley(values, n):
    """Shapley values from a dict {frozenset: v}, by all n! orderings."""
    phi = np.zeros(n)
    for perm in itertools.permutations(range(n)):
        seen = frozenset()
        for i in perm:
            phi[i] += values[seen | {i}] - values[seen]
            seen = seen | {i}
    return phi / math.factorial(n)


def test_query_games_are_the_documented_games():
    """Query i's game is v(C) = ‖Σ_{j∈C} σ(q_i·k_j/√D_h) V_j‖ over the tokens it sees; its
    exact Shapley values (brute force over orderings), L1-normalised, are the diagnostics'."""
    n = 5
    a = make("query", "exact", causal=True)
    x = tokens(n)
    _, diag = call(a, x, return_diagnostics=True)
    q, k, V = heads_of(a, x, a.to_q), heads_of(a, x, a.to_k), heads_of(a, x, a.to_v)
    for h in range(HEADS):
        for i in (2, 4):
            rel = 1 / (1 + np.exp(-(k[h] @ q[h, i]) / math.sqrt(q.shape[-1])))
            U = rel[:, None] * V[h]
            seen = range(i + 1)  # causal: players j <= i
            values = {frozenset(c): np.linalg.norm(U[list(c)].sum(0)) if c else 0.0
                      for r in range(i + 2) for c in itertools.combinations(seen, r)}
            phi = brute_shapley(values, i + 1)
            np.testing.assert_allclose(diag.shapley[h, i, :i + 1], phi / np.abs(phi).sum(),
                                       rtol=2e-4, atol=1e-6)
            assert np.all(np.asarray(diag.weights[h, i, i + 1:]) == 0)  # future tokens
            assert np.all(np.asarray(diag.shapley[h, i, i + 1:]) == 0)


def test_mean_field_fixed_point_against_ising():
    a = make("pooled", "exact", gamma=0.5)
    x = tokens(7)
    _, d = call(a, x, return_diagnostics=True)
    for h in range(HEADS):
        field, J, m = d.fields[h, 0], d.couplings[h, 0], d.magnetizations[h, 0]
        gamma = float(d.gamma[h])
        assert int(d.solver.result[h, 0]) == solvers.RESULTS.successful
        # the fixed-point equation of the paper's eq. 16 (plain NumPy)
        mn = np.asarray(m, np.float64)
        resid = mn - np.tanh((np.asarray(field) + np.asarray(J) @ mn) / gamma)
        assert np.max(np.abs(resid)) < 5e-4
        # Newton on the same equations, started there, stays there (the equations can have
        # several fixed points, so a solve from elsewhere may find another one)
        ref = ising.mean_field(field, J, beta=1.0 / gamma, m0=m,
                               solver=solvers.Newton(tol=1e-6, max_steps=50)).value
        np.testing.assert_allclose(m, ref, atol=5e-4)
        np.testing.assert_allclose(d.weights[h, 0], (1 + m) / 2, atol=1e-7)
        assert np.allclose(np.diagonal(J), 0) and np.allclose(J, J.T, atol=1e-6)
        # the fields mix the L1-normalised Shapley and Banzhaf values through the gate
        lam = d.gate[h]
        np.testing.assert_allclose(field, lam * d.shapley[h, 0] + (1 - lam) * d.banzhaf[h, 0],
                                   rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(np.abs(d.shapley[h, 0]).sum(), 1.0, rtol=1e-5)


def test_ablations_gate_and_interactions():
    x = tokens(6)
    _, d1 = call(make("pooled", "exact", gate="shapley"), x, return_diagnostics=True)
    np.testing.assert_allclose(d1.fields, d1.shapley, rtol=1e-6)
    _, d0 = call(make("pooled", "exact", gate="banzhaf"), x, return_diagnostics=True)
    np.testing.assert_allclose(d0.fields, d0.banzhaf, rtol=1e-6)
    _, dn = call(make("pooled", "exact", interactions=False), x, return_diagnostics=True)
    assert np.all(np.asarray(dn.couplings) == 0)
    np.testing.assert_allclose(dn.magnetizations, np.tanh(dn.fields / dn.gamma[:, None, None]),
                               atol=3e-4)  # the solver's tolerance, 1e-4


# --------------------------------------------------------------- gradients


@pytest.mark.parametrize("mode,estimator", [
    ("pooled", "exact"),
    pytest.param("query", "mc", marks=pytest.mark.slow),
    pytest.param("pooled", "paper", marks=pytest.mark.slow),
])
def test_gradients_match_finite_differences(x64, mode, estimator):
    a = make(mode, estimator, gamma=1.0,
             solver=solvers.Newton(tol=1e-12, max_steps=100),
             adjoint=solvers.Implicit(linear_solver=solvers.GMRES(restart=8), rtol=1e-12))
    x = tokens(5, scale=0.5)
    _, d = call(a, x, key=jax.random.key(3), return_diagnostics=True)
    assert np.all(np.asarray(d.solver.result) == solvers.RESULTS.successful)
    w = jax.random.normal(jax.random.key(9), (5, DIM))
    key = jax.random.key(3)  # fixed draws: the estimate is a deterministic function

    @eqx.filter_jit
    def loss(a, x):
        return jnp.sum(w * a(x, key=key))

    grads = eqx.filter_jit(eqx.filter_grad(loss))(a, x)
    gx = eqx.filter_jit(jax.grad(lambda x: loss(a, x)))(x)
    for name, g, bump in (
        ("to_v", grads.to_v.weight, lambda a, e: eqx.tree_at(lambda m: m.to_v.weight, a,
                                                             a.to_v.weight + e)),
        ("log_gamma", grads.log_gamma, lambda a, e: eqx.tree_at(lambda m: m.log_gamma, a,
                                                                a.log_gamma + e)),
    ):
        d = jax.random.normal(jax.random.key(11), g.shape)
        eps = 1e-5
        fd = (loss(bump(a, eps * d), x) - loss(bump(a, -eps * d), x)) / (2 * eps)
        np.testing.assert_allclose(jnp.sum(g * d), fd, rtol=1e-5, atol=1e-8, err_msg=name)
    d = jax.random.normal(jax.random.key(12), x.shape)
    fd = (loss(a, x + 1e-5 * d) - loss(a, x - 1e-5 * d)) / 2e-5
    np.testing.assert_allclose(jnp.sum(gx * d), fd, rtol=1e-5, atol=1e-8)


def test_unrolled_and_implicit_gradients_agree():
    x = tokens(6, scale=0.5)
    common = dict(gamma=1.0, solver=solvers.Picard(tol=1e-7, max_steps=200))
    grads = []
    for adjoint in (solvers.Unrolled(),
                    solvers.Implicit(linear_solver=solvers.GMRES(restart=6), rtol=1e-7),
                    solvers.Implicit(rtol=1e-7)):  # the default's linear solver (Anderson)
        a = make("pooled", "exact", adjoint=adjoint, **common)
        grads.append(eqx.filter_jit(eqx.filter_grad(lambda a: jnp.sum(a(x) ** 2)))(a).to_v.weight)
    for g in grads[1:]:
        np.testing.assert_allclose(grads[0], g, rtol=2e-3, atol=1e-6)


def test_implicit_gradients_stay_finite_when_a_mean_field_fails():
    """A game whose mean field did not converge passes no gradient through ⟨s⟩ (the implicit
    function theorem needs a fixed point) instead of making every gradient NaN; the games
    that converged keep theirs, equal to those of a call where every game converged."""
    x = tokens(6)
    strong = dict(gamma=0.05, solver=solvers.Picard(tol=1e-8, max_steps=2))

    @eqx.filter_jit
    @eqx.filter_value_and_grad(has_aux=True)
    def grad(a):  # the gradient and the solver results in one compiled program
        y, d = a(x, return_diagnostics=True)
        return jnp.sum(y ** 2), d.solver.result

    a = make("query", "mc", **strong)  # the default adjoint: implicit
    assert isinstance(a.adjoint, solvers.Implicit)
    (_, result), g = grad(a)
    failed = np.asarray(result) != solvers.RESULTS.successful
    assert failed.any()
    for leaf in jax.tree.leaves(eqx.filter(g, eqx.is_inexact_array)):
        assert np.all(np.isfinite(np.asarray(leaf)))
    # with every game failing, nothing flows through the mean field: the temperature, which
    # acts only there, gets exactly zero gradient
    b = make("pooled", "mc", **strong)
    (_, result), gb = grad(b)
    assert np.all(np.asarray(result) != solvers.RESULTS.successful)
    np.testing.assert_array_equal(gb.log_gamma, 0.0)
    assert np.all(np.isfinite(np.asarray(gb.to_v.weight)))


# --------------------------------------------------------------- masks, padding, keys


@pytest.mark.parametrize("mode", ["pooled", "query"])
def test_padding_is_invisible(mode):
    """Padded tokens are never players: the valid positions' outputs are those of the
    unpadded sequence (exact values), whatever the padded tokens hold."""
    n, pad = 5, 3
    a = make(mode, "exact")
    x = tokens(n)
    y = call(a, x)
    junk = 5.0 * jax.random.normal(jax.random.key(4), (pad, DIM))
    xp = jnp.concatenate([x, junk])
    valid = jnp.arange(n + pad) < n
    mask = jnp.broadcast_to(valid[None, :], (n + pad, n + pad))
    yp, d = call(a, xp, mask=mask, return_diagnostics=True)
    np.testing.assert_allclose(yp[:n], y, rtol=1e-4, atol=1e-6)
    assert np.all(np.asarray(d.weights[..., n:]) == 0)
    # Monte Carlo: at a fixed length and key the padded tokens' content does not matter
    b = make(mode, "mc")
    junk2 = -3.0 * jax.random.normal(jax.random.key(5), (pad, DIM))
    y1 = call(b, xp, mask=mask, key=jax.random.key(1))
    y2 = call(b, jnp.concatenate([x, junk2]), mask=mask, key=jax.random.key(1))
    np.testing.assert_allclose(y1[:n], y2[:n], rtol=1e-5, atol=1e-6)


def test_causal_query_games_ignore_the_future():
    a = make("query", "mc", causal=True)
    x = tokens(7)
    x2 = x.at[5:].set(3.0)
    y1, y2 = call(a, x, key=jax.random.key(0)), call(a, x2, key=jax.random.key(0))
    np.testing.assert_allclose(y1[:5], y2[:5], rtol=1e-5, atol=1e-6)
    assert not np.allclose(y1[5:], y2[5:])
    with pytest.raises(ValueError, match="pooled"):
        make("pooled", causal=True)


def test_evaluation_is_deterministic_and_training_samples():
    a = make("query", "mc", train_samples=3, eval_samples=5)
    x = tokens(6)
    np.testing.assert_array_equal(call(a, x), call(a, x))  # the fixed evaluation key
    y1, y2 = call(a, x, key=jax.random.key(1)), call(a, x, key=jax.random.key(2))
    assert not np.allclose(y1, y2)  # fresh draws in training
    assert not np.allclose(call(a, x), y1)


def test_normalisation_of_alpha():
    """"players": a mean of values weighted by α ∈ [0, 1] (bounded by the largest value);
    "none" (the paper's) grows with the number of tokens; "sum": a convex combination."""
    x = tokens(12)
    outs = {}
    for norm in ("players", "none", "sum"):
        a = make("pooled", "mc", normalize=norm)
        a = eqx.tree_at(lambda m: m.to_out.weight, a, jnp.eye(DIM))  # read the heads directly
        y, d = call(a, x, return_diagnostics=True)
        z = y[0]  # pooled: every row is z
        outs[norm] = z
        V = heads_of(a, x, a.to_v)
        alpha = np.asarray(d.weights[:, 0])  # (H, n)
        denom = {"players": 12.0, "none": 1.0}.get(norm, alpha.sum(-1, keepdims=True))
        np.testing.assert_allclose(z.reshape(HEADS, -1),
                                   np.einsum("hn,hnk->hk", alpha / denom, V), rtol=1e-4,
                                   atol=1e-6)
        if norm == "players":
            assert np.all(np.linalg.norm(z.reshape(HEADS, -1), axis=-1)
                          <= np.linalg.norm(V, axis=-1).max(-1) + 1e-6)
    np.testing.assert_allclose(outs["none"], 12.0 * outs["players"], rtol=1e-5)


def test_errors_and_config():
    with pytest.raises(ValueError, match="estimator"):
        make(estimator="exactly")
    # the switches are strings, checked where they are stored
    with pytest.raises(ValueError, match="gate='shaply' .*Did you mean 'shapley'"):
        make(gate="shaply")
    with pytest.raises(ValueError, match="mode='pooled'.*causal"):
        nn.NeuroGameAttention(DIM, HEADS, causal=True, mode="pooled", key=jax.random.key(0))
    with pytest.raises(ValueError, match="pool='max'"):
        nn.PairClassifier(10, 3, DIM, 1, pool="max", key=jax.random.key(0))
    ngt = nn.NeuroGameConfig(train_samples=3)  # the config's pooled head: its settings
    assert nn.pool_settings(ngt) == ("ngt", nn.get_attention("neurogame").kwargs_from(ngt))
    assert nn.pool_settings(nn.MeanPool()) == ("mean", None)
    assert nn.pool_settings(nn.ClsPool()) == ("cls", None)
    with pytest.raises(ValueError, match="at most 16"):
        make("pooled", "exact")(tokens(17))
    # a mean field that does not converge says so (here: 2 iterations at strong coupling)
    a = make("query", "mc", gamma=0.05, solver=solvers.Picard(tol=1e-8, max_steps=2))
    _, d = call(a, tokens(6), return_diagnostics=True)
    assert np.any(np.asarray(d.solver.result) != solvers.RESULTS.successful)
    with pytest.raises(ValueError, match="damping"):
        make(solver=solvers.Picard(damping=1.0))
    # strongly typed: a weak type turns strong after the first update and recompiles the step
    assert not make().log_gamma.weak_type
    cfg = C.load_config(None, ["model.attention=neurogame", "model.attention.estimator=paper",
                               "model.attention.adjoint.name=unrolled", "model.dim=8",
                               "model.num_heads=2"])
    reg = nn.get_attention("neurogame")
    kw = reg.kwargs_from(cfg.model.attention)
    assert kw["estimator"] == PaperValues() and isinstance(kw["adjoint"], solvers.Unrolled)
    with pytest.raises(C.ConfigError, match="damping"):
        C.load_config(None, ["model.attention=neurogame", "model.attention.solver.damping=1.5"])
    # a stacked model trains through it (Transformer + scan)
    model = nn.Tagger(vocab_size=5, num_classes=3, dim=DIM, depth=1, num_heads=HEADS,
                      max_len=6, attention="neurogame", attention_kwargs=kw, key=jax.random.key(0))
    toks = jnp.array([1, 2, 3, 4, 0, 1])
    g = eqx.filter_jit(eqx.filter_grad(lambda m: jnp.sum(m(toks, key=jax.random.key(1)) ** 2)))(
        model)
    assert np.isfinite(np.asarray(g.transformer.blocks.attention.to_v.weight)).all()
