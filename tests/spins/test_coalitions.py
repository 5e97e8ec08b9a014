"""Cooperative games: exact values against brute force, the axioms, closed forms, unbiased
Monte Carlo, and NGT's Algorithm 1 estimators against a plain NumPy transcription."""

import itertools
import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spinformer.spins import coalitions as co

# ----------------------------------------------------------------------------- numpy games


class TableGame(eqx.Module):
    """A JAX game from the values of all 2^n coalitions (bit i of the row = player i); a
    pytree, so that games of the same size share one compilation."""

    table: jax.Array

    def __call__(self, masks):
        n = int(np.log2(self.table.shape[0]))
        powers = jnp.asarray(2 ** np.arange(n), jnp.int32)
        return self.table[jnp.sum(masks.astype(jnp.int32) * powers, axis=-1)]


def table_game(table):
    return TableGame(jnp.asarray(table, jnp.float32))


def np_norm(V, f="identity"):
    """NumPy v(C) = f(‖Σ_{i∈C} V_i‖) on an iterable of players, float64."""
    V = np.asarray(V, np.float64)
    fn = {"identity": lambda x: x, "tanh": np.tanh, "relu": lambda x: max(x, 0.0)}[f]
    return lambda C: fn(np.linalg.norm(V[list(C)].sum(axis=0))) if len(C) else fn(0.0)


def np_table(table):
    return lambda C: float(table[sum(1 << i for i in C)])


def brute_shapley(v, players):
    """Average marginal contribution over all m! orders of `players` (a list)."""
    phi = {i: 0.0 for i in players}
    for order in itertools.permutations(players):
        before = []
        for i in order:
            phi[i] += v(before + [i]) - v(before)
            before.append(i)
    return {i: x / math.factorial(len(players)) for i, x in phi.items()}


def subsets(items):
    return itertools.chain.from_iterable(itertools.combinations(items, r)
                                         for r in range(len(items) + 1))


def brute_banzhaf(v, players):
    out = {}
    for i in players:
        others = [k for k in players if k != i]
        out[i] = sum(v(list(C) + [i]) - v(list(C)) for C in subsets(others)) / 2 ** len(others)
    return out


def delta2(v, C, i, j):
    C = list(C)
    return v(C + [i, j]) - v(C + [i]) - v(C + [j]) + v(C)


def brute_interactions(v, players, gamma=None):
    """Uniform (gamma None) or Gibbs-tilted average of Δ_ij over contexts of the players."""
    out = {}
    for i, j in itertools.combinations(players, 2):
        ctx = list(subsets([k for k in players if k not in (i, j)]))
        w = np.ones(len(ctx)) if gamma is None else np.exp([v(list(C)) / gamma for C in ctx])
        out[i, j] = out[j, i] = float(w @ [delta2(v, C, i, j) for C in ctx] / w.sum())
    return out


def dense(d, n, shape=1):
    out = np.zeros((n,) * shape)
    for k, x in d.items():
        out[k] = x
    return out


def random_norm_game(seed, n, d=3, f="tanh", scale=1.0, dtype=jnp.float32):
    V = np.random.default_rng(seed).normal(size=(n, d)) * scale
    return co.NormGame(jnp.asarray(V, dtype), f), V


_exact = eqx.filter_jit(lambda v, n, p: (co.shapley(v, n, players=p), co.banzhaf(v, n, players=p),
                                        co.interactions(v, n, players=p)))


_ngt = eqx.filter_jit(lambda v, n, key, K, gamma, p=None: co.ngt_estimates(
    v, n, key=key, num_samples=K, gamma=gamma, players=p))
_gibbs_jit = eqx.filter_jit(lambda v, n, gamma, p: (
    co.gibbs_banzhaf(v, n, gamma=gamma, players=p),
    co.gibbs_interactions(v, n, gamma=gamma, players=p)))


def _gibbs(v, n, gamma, p=None):  # gamma traced: one compilation per game size
    return _gibbs_jit(v, n, jnp.asarray(gamma, jnp.float32), p)


# ----------------------------------------------------------------------------- exact values


@pytest.mark.parametrize("n", [1, 2, 5, 7])
def test_exact_against_brute_force(n):
    """A random (non-monotone) game: every coalition value independent."""
    table = np.random.default_rng(n).normal(size=2**n)
    table[0] = 0.3  # v(∅) ≠ 0 is allowed
    phi, beta, J = _exact(table_game(jnp.asarray(table, jnp.float32)), n, None)
    v = np_table(table)
    players = list(range(n))
    np.testing.assert_allclose(phi, dense(brute_shapley(v, players), n), atol=2e-6)
    np.testing.assert_allclose(beta, dense(brute_banzhaf(v, players), n), atol=2e-6)
    np.testing.assert_allclose(J, dense(brute_interactions(v, players), n, 2), atol=2e-6)


def test_norm_game_against_brute_force():
    n = 6
    game, V = random_norm_game(0, n, f="relu")
    phi, beta, J = _exact(game, n, None)
    v = np_norm(V, "relu")
    np.testing.assert_allclose(phi, dense(brute_shapley(v, list(range(n))), n), atol=3e-6)
    np.testing.assert_allclose(beta, dense(brute_banzhaf(v, list(range(n))), n), atol=3e-6)
    np.testing.assert_allclose(J, dense(brute_interactions(v, list(range(n))), n, 2), atol=3e-6)
    # gibbs limits by brute force, and gamma = inf is the uniform average
    gamma = 0.7
    ref = dense(brute_interactions(v, list(range(n)), gamma), n, 2)
    tilt_b, tilt_J = _gibbs(game, n, gamma)
    np.testing.assert_allclose(tilt_J, ref, atol=3e-6)
    gb = []
    for i in range(n):
        ctx = list(subsets([k for k in range(n) if k != i]))
        w = np.exp([v(list(C)) / gamma for C in ctx])
        gb.append(w @ [v(list(C) + [i]) - v(list(C)) for C in ctx] / w.sum())
    np.testing.assert_allclose(tilt_b, gb, atol=3e-6)
    inf_b, inf_J = _gibbs(game, n, float("inf"))
    np.testing.assert_allclose(inf_b, beta, atol=1e-6)
    np.testing.assert_allclose(inf_J, J, atol=1e-6)


def test_axioms():
    n = 6
    rng = np.random.default_rng(1)
    t1, t2 = rng.normal(size=(2, 2**n))
    phi1, beta1, J1 = _exact(table_game(jnp.asarray(t1, jnp.float32)), n, None)
    # efficiency
    np.testing.assert_allclose(np.sum(phi1), t1[-1] - t1[0], rtol=1e-5)
    # linearity (additivity and scaling)
    both = _exact(table_game(jnp.asarray(2 * t1 - t2, jnp.float32)), n, None)
    single2 = _exact(table_game(jnp.asarray(t2, jnp.float32)), n, None)
    for a, b, c in zip(both, (phi1, beta1, J1), single2):
        np.testing.assert_allclose(a, 2 * np.asarray(b) - np.asarray(c), atol=1e-5)
    # symmetry and null player in a norm game: players 0 and 1 share a vector, 2 has none
    V = rng.normal(size=(n, 3))
    V[1] = V[0]
    V[2] = 0.0
    phi, beta, J = _exact(co.NormGame(jnp.asarray(V, jnp.float32)), n, None)
    np.testing.assert_allclose(phi[0], phi[1], rtol=0, atol=1e-6)
    np.testing.assert_allclose(beta[0], beta[1], rtol=0, atol=1e-6)
    np.testing.assert_allclose(np.delete(J[0], [0, 1]), np.delete(J[1], [0, 1]), atol=1e-6)
    np.testing.assert_allclose([phi[2], beta[2]], 0.0, atol=1e-6)
    np.testing.assert_allclose(J[2], 0.0, atol=1e-6)
    np.testing.assert_allclose(J, J.T)
    np.testing.assert_array_equal(np.diag(J), 0.0)


def test_closed_forms():
    n = 6
    idx = np.arange(2**n)
    member = (idx[:, None] >> np.arange(n)) & 1
    w = np.random.default_rng(2).normal(size=n)
    phi, beta, J = _exact(table_game(jnp.asarray(member @ w, jnp.float32)), n, None)
    np.testing.assert_allclose(phi, w, atol=1e-5)
    np.testing.assert_allclose(beta, w, atol=1e-5)
    np.testing.assert_allclose(J, 0.0, atol=1e-5)
    T = [1, 3, 4]  # unanimity game u_T(C) = 1 if T ⊆ C
    u = np.all(member[:, T] == 1, axis=1).astype(np.float32)
    phi, beta, J = _exact(table_game(jnp.asarray(u)), n, None)
    inT = np.isin(np.arange(n), T)
    np.testing.assert_allclose(phi, np.where(inT, 1 / len(T), 0.0), atol=1e-6)
    np.testing.assert_allclose(beta, np.where(inT, 2.0 ** -(len(T) - 1), 0.0), atol=1e-6)
    pair = inT[:, None] & inT[None, :] & ~np.eye(n, dtype=bool)
    np.testing.assert_allclose(J, np.where(pair, 2.0 ** -(len(T) - 2), 0.0), atol=1e-6)


def test_players_mask():
    """Non-players are null: the players' values are those of the game on the players alone
    (brute force over the m! orders of the players), and padding changes nothing."""
    n, keep = 7, [0, 2, 3, 6]
    game, V = random_norm_game(3, n)
    players = np.isin(np.arange(n), keep)
    phi, beta, J = _exact(game, n, jnp.asarray(players))
    v = np_norm(V, "tanh")
    np.testing.assert_allclose(phi, dense(brute_shapley(v, keep), n), atol=3e-6)
    np.testing.assert_allclose(beta, dense(brute_banzhaf(v, keep), n), atol=3e-6)
    np.testing.assert_allclose(J, dense(brute_interactions(v, keep), n, 2), atol=3e-6)
    small = co.NormGame(game.vectors[np.array(keep)], "tanh")
    for big, sm in zip((phi, beta, J), _exact(small, len(keep), None)):
        np.testing.assert_allclose(np.asarray(big)[np.ix_(keep, keep)] if big.ndim == 2
                                   else np.asarray(big)[keep], sm, atol=2e-6)
    assert np.all(np.asarray(phi)[~players] == 0) and np.all(np.asarray(J)[~players] == 0)
    for full, sm in zip(_gibbs(game, n, 0.5, jnp.asarray(players)),
                        _gibbs(small, len(keep), 0.5)):
        sel = np.ix_(keep, keep) if full.ndim == 2 else keep
        np.testing.assert_allclose(np.asarray(full)[sel], sm, atol=2e-6)
    # players is dynamic (one compilation for every mask) and the function vmaps
    f = jax.jit(jax.vmap(lambda p: co.shapley(co.NormGame(game.vectors, "tanh"), n,
                                              players=p)))
    both = f(jnp.stack([jnp.asarray(players), jnp.ones(n, bool)]))
    np.testing.assert_allclose(both[0], phi, atol=1e-6)
    np.testing.assert_allclose(both[1], _exact(game, n, None)[0], atol=1e-6)


# ----------------------------------------------------------------------------- Monte Carlo

MC = {"shapley": co.shapley_mc, "banzhaf": co.banzhaf_mc, "interactions": co.interactions_mc}
_mc = eqx.filter_jit(lambda name, v, n, key, K, p: MC[name](v, n, key=key, num_samples=K,
                                                            players=p))


@pytest.mark.parametrize("name", list(MC))
def test_mc_unbiased_and_fast_path(name):
    """Within 4 standard errors of the exact value (fixed seed), for the NormGame fast path
    and the generic path; both paths see the same draws; a players mask gives exact zeros."""
    n, K = 6, 2048
    game, _ = random_norm_game(4, n)
    players = jnp.asarray(np.arange(n) != 2)
    generic = lambda m: game(m)  # noqa: E731  (any callable takes the generic path)
    exact = dict(zip(MC, _exact(game, n, players)))[name]
    key = jax.random.key(5)
    fast = _mc(name, game, n, key, K, players)
    slow = _mc(name, generic, n, key, K, players)
    np.testing.assert_allclose(fast.value, slow.value, atol=1e-5)
    np.testing.assert_allclose(fast.stderr, slow.stderr, atol=1e-6)
    keep = np.asarray(fast.stderr) > 0
    assert keep.sum() == (n - 1 if name != "interactions" else (n - 1) * (n - 2))
    assert np.all(np.asarray(fast.value)[~keep] == 0)
    z = np.abs(np.asarray(fast.value) - np.asarray(exact))[keep] / np.asarray(fast.stderr)[keep]
    assert z.max() < 4.0, z.max()
    assert z.mean() > 0.2  # the errors are not suspiciously small either


@pytest.mark.parametrize("name", list(MC))
def test_mc_error_rate(name):
    """RMS error over 8 keys falls by about 4 when K grows 16-fold (the game and K = 2048
    of the test above, so that one of the two compilations is shared)."""
    n = 6
    game, _ = random_norm_game(4, n)
    players = jnp.ones(n, bool)
    exact = np.asarray(dict(zip(MC, _exact(game, n, players)))[name])
    keys = jax.random.split(jax.random.key(8), 8)
    rms = []
    for K in (128, 2048):
        est = np.stack([_mc(name, game, n, k, K, players).value for k in keys])
        rms.append(np.sqrt(np.mean((est - exact) ** 2)))
    assert 2.5 < rms[0] / rms[1] < 6.0, rms


def test_mc_gradients_and_float64_paths(x64):
    """d/dV of the MC estimates (fixed draws) against central finite differences; in float64
    the NormGame fast path equals the generic path to round-off."""
    n, K = 4, 16
    rng = np.random.default_rng(9)
    V0 = jnp.asarray(rng.normal(size=(n, 3)))
    weights = {"shapley": rng.normal(size=n), "banzhaf": rng.normal(size=n),
               "interactions": rng.normal(size=(n, n))}
    key = jax.random.key(10)
    eps = 1e-6
    values = {}
    for generic in (False, True):  # identity: the norm's kink at the empty coalition
        def loss(V, generic=generic):
            game = co.NormGame(V)
            v = (lambda m: game(m)) if generic else game
            est = {name: fn(v, n, key=key, num_samples=K) for name, fn in MC.items()}
            return sum(jnp.sum(weights[name] * est[name].value) for name in MC), est

        value_and_grad = jax.jit(jax.value_and_grad(loss, has_aux=True))
        (_, values[generic]), g = value_and_grad(V0)
        fd = np.zeros((n, 3))
        for a, b in itertools.product(range(n), range(3)):
            e = jnp.zeros((n, 3)).at[a, b].set(eps)
            fd[a, b] = (value_and_grad(V0 + e)[0][0] - value_and_grad(V0 - e)[0][0]) / (2 * eps)
        np.testing.assert_allclose(g, fd, rtol=1e-6, atol=1e-8)
    for name in MC:
        for a, b in zip(values[False][name], values[True][name]):
            np.testing.assert_allclose(a, b, atol=1e-12)


def test_mc_fast_path_gradients_match_generic_path(x64):
    """The NormGame fast paths (a hand-written reverse pass for the interactions) give the
    gradients autodiff gives through the generic path, for every nonlinearity, with a
    players mask, and through the standard errors as well as the values."""
    n, K = 7, 6
    rng = np.random.default_rng(3)
    V0 = jnp.asarray(rng.normal(size=(n, 4)))
    players = jnp.asarray([True, True, False, True, True, True, False])
    w = {name: jnp.asarray(rng.normal(size=(n,) if name != "interactions" else (n, n)))
         for name in MC}
    key = jax.random.key(4)
    for f in ("identity", "tanh", "relu"):
        grads = {}
        for generic in (False, True):
            def loss(V, generic=generic, f=f):
                game = co.NormGame(V, f)
                v = (lambda m: game(m)) if generic else game
                total = 0.0
                for name, fn in MC.items():
                    est = fn(v, n, key=key, num_samples=K, players=players)
                    total = total + jnp.sum(w[name] * est.value) + jnp.sum(jnp.sin(est.stderr))
                return total

            grads[generic] = jax.grad(loss)(V0)
        np.testing.assert_allclose(grads[False], grads[True], rtol=1e-9, atol=1e-11,
                                   err_msg=f)
        assert np.all(np.asarray(grads[False])[~np.asarray(players)] == 0.0)


def test_mc_cost():
    """One batched call of v: K(n+1) masks for shapley/banzhaf, K n² 4 for interactions."""
    n, K = 4, 3
    game, _ = random_norm_game(11, n)
    shapes = []

    def v(masks):
        shapes.append(masks.shape)
        return game(masks)

    def run(key):  # traced only (eval_shape): the shapes v sees, nothing compiled
        co.shapley_mc(v, n, key=key, num_samples=K)
        co.banzhaf_mc(v, n, key=key, num_samples=K)
        co.interactions_mc(v, n, key=key, num_samples=K)
        co.shapley(v, n)

    jax.eval_shape(run, jax.random.key(0))
    assert shapes == [(K, n + 1, n), (K, n + 1, n), (K, n, n, 4, n), (2**n, n)]


# ----------------------------------------------------------------------------- NGT

def algorithm1_numpy(v, draws, gamma, players):
    """Algorithm 1 transcribed literally (loops, plain exp, float64) on the given draws."""
    prefixes, sizes, coalitions, pair_coalitions = (np.asarray(x) for x in draws)
    n = len(players)
    m = int(players.sum())
    K = sizes.shape[1]
    phi, beta, J = np.zeros(n), np.zeros(n), np.zeros((n, n))

    def snis(W, M):
        W = np.asarray(W)
        return (W / W.sum()) @ np.asarray(M)

    members = lambda mask: list(np.flatnonzero(mask))  # noqa: E731
    for i in np.flatnonzero(players):
        W, M = [], []
        for k in range(K):
            P = members(prefixes[i, k])
            s = len(P)
            assert s == sizes[i, k] < m and i not in P and all(players[P])
            p = math.factorial(s) * math.factorial(m - 1 - s) / math.factorial(m - 1)
            W.append(np.exp(v(P) / gamma) / p)
            M.append(v(P + [i]) - v(P))
        phi[i] = snis(W, M)
        W, M = [], []
        for k in range(K):
            C = members(coalitions[i, k])
            assert i not in C and all(players[C])
            W.append(np.exp(v(C) / gamma) / 2.0 ** -(m - 1))
            M.append(v(C + [i]) - v(C))
        beta[i] = snis(W, M)
    for p_idx, (i, j) in enumerate(zip(*np.triu_indices(n, 1))):
        if not (players[i] and players[j]):
            continue
        W, D = [], []
        for k in range(K):
            C = members(pair_coalitions[p_idx, k])
            assert i not in C and j not in C and all(players[C])
            W.append(np.exp(v(C) / gamma) / 2.0 ** -(m - 2))
            D.append(delta2(v, C, i, j))
        J[i, j] = J[j, i] = snis(W, D)
    return phi, beta, J


def test_ngt_matches_numpy_algorithm1():
    """Same draws, with and without a players mask, NormGame and generic paths."""
    n, K, gamma = 6, 12, 0.5
    game, V = random_norm_game(12, n)
    from_draws = eqx.filter_jit(lambda v, d, p: co._ngt_from_draws(v, d, gamma, p))
    draw = jax.jit(lambda key, p: co._ngt_draw(key, n, K, p))
    generic = lambda m: game(m)  # noqa: E731
    for players in (np.ones(n, bool), np.arange(n) != 1):
        pj = jnp.asarray(players)
        draws = draw(jax.random.key(13), pj)
        ref = algorithm1_numpy(np_norm(V, "tanh"), draws, gamma, players)
        for v in (game, generic):
            for a, b in zip(from_draws(v, draws, pj), ref):
                np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-6)


def test_ngt_converges_to_gibbs_limits_not_shapley():
    """At K = 2^14 both the Shapley and the Banzhaf branch sit on the Gibbs-tilted average
    and miss the Shapley value and the Banzhaf index by far more than their noise."""
    n, K, gamma = 5, 2**14, 0.5
    game, _ = random_norm_game(14, n, f="identity")
    est = _ngt(game, n, jax.random.key(15), K, gamma)
    tilt_b, tilt_J = (np.asarray(x) for x in _gibbs(game, n, gamma))
    phi, beta, J = (np.asarray(x) for x in _exact(game, n, None))
    off = ~np.eye(n, dtype=bool)
    assert np.abs(est.shapley - tilt_b).max() < 0.02
    assert np.abs(est.banzhaf - tilt_b).max() < 0.02
    assert np.abs(est.interactions - tilt_J)[off].max() < 0.02
    assert np.abs(est.shapley - phi).max() > 0.2
    assert np.abs(est.banzhaf - beta).max() > 0.2
    assert np.abs(est.interactions - J)[off].max() > 0.2
    # far from the tilt (gamma large) the limits are the Banzhaf values
    big_b, big_J = _gibbs(game, n, 1e5)
    np.testing.assert_allclose(big_b, beta, atol=1e-4)
    np.testing.assert_allclose(big_J, J, atol=1e-4)


def test_ngt_k1_shapley_branch_is_unbiased_for_shapley():
    """With one draw the self-normalised weight is 1: the Shapley branch is plain
    permutation sampling (its mean over keys is φ) — the bias appears as K grows."""
    n, R = 4, 20000
    game, _ = random_norm_game(16, n)
    keys = jax.random.split(jax.random.key(17), R)
    est = jax.jit(jax.vmap(lambda k: co.ngt_estimates(game, n, key=k, num_samples=1,
                                                      gamma=0.25).shapley))(keys)
    est = np.asarray(est)
    err = est.mean(0) - np.asarray(_exact(game, n, None)[0])
    z = np.abs(err) / (est.std(0, ddof=1) / np.sqrt(R))
    assert z.max() < 4.0, z


def test_ngt_log_space_weights_n40():
    n, gamma = 40, 0.25
    game, _ = random_norm_game(18, n, d=8, f="identity")
    # e^{v/γ}/p overflows float32 here: v(N)/γ + (n − 1) log 2 > 88
    assert float(game(jnp.ones(n, bool))) / gamma + (n - 1) * np.log(2) > 89
    est = _ngt(game, n, jax.random.key(19), 4, gamma)
    for x in est:
        assert np.all(np.isfinite(np.asarray(x)))


def test_errors():
    game, _ = random_norm_game(20, 3)
    key = jax.random.key(0)
    with pytest.raises(ValueError, match="shapley_mc"):
        co.shapley(lambda m: jnp.sum(m, -1) * 1.0, co.MAX_EXACT + 1)
    with pytest.raises(ValueError, match="MAX_EXACT"):
        co.gibbs_interactions(lambda m: jnp.sum(m, -1) * 1.0, 17, gamma=1.0)
    with pytest.raises(ValueError, match="players must be a boolean mask"):
        co.banzhaf(game, 3, players=jnp.ones(4, bool))
    with pytest.raises(ValueError, match="num_samples"):
        co.shapley_mc(game, 3, key=key, num_samples=1)
    with pytest.raises(ValueError, match="num_samples"):
        co.interactions_mc(game, 3, key=key, num_samples=2.5)
    with pytest.raises(ValueError, match="num_samples"):
        co.ngt_estimates(game, 3, key=key, num_samples=0, gamma=1.0)
    with pytest.raises(ValueError, match="gamma"):
        co.ngt_estimates(game, 3, key=key, num_samples=4, gamma=0.0)
    with pytest.raises(ValueError, match="n = vectors.shape"):
        co.banzhaf_mc(game, 4, key=key, num_samples=4)
    with pytest.raises(ValueError, match="values of shape"):
        co.shapley(lambda m: jnp.sum(m, -1, keepdims=True) * 1.0, 3)
    with pytest.raises(ValueError, match="positive Python int"):
        co.interactions(game, 0)
    with pytest.raises(ValueError, match="f='softplus'"):
        co.NormGame(jnp.ones((3, 2)), "softplus")
    with pytest.raises(ValueError, match=r"shape \(n, d\)"):
        co.NormGame(jnp.ones(3))


def test_norm_game_gradient_at_empty_coalition():
    V = jnp.asarray(np.random.default_rng(21).normal(size=(3, 2)), jnp.float32)
    masks = jnp.asarray([[False] * 3, [True, False, False]])
    g = jax.jit(jax.jacobian(lambda V_: co.NormGame(V_)(masks)))(V)
    assert np.all(np.isfinite(g)) and np.all(g[0] == 0)
    np.testing.assert_allclose(g[1, 0], V[0] / jnp.linalg.norm(V[0]), rtol=1e-6)
