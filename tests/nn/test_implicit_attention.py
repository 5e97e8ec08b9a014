"""Deep Implicit Attention and the image classifier: the fixed point against a dense linear
solve, gradients against unrolled backprop and finite differences, the spectral-radius
diagnostic against the dense Jacobian, the Jacobian penalty in the loss, failures reported."""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spinformer import nn, solvers
from spinformer.nn._implicit import symmetrize_blocks
from spinformer.train import loss_fn

DIM, N = 6, 5

call = eqx.filter_jit(lambda a, x, **kw: a(x, **kw))


def make(seed=0, **kw):
    kw.setdefault("max_len", N)
    return nn.ImplicitAttention(DIM, key=jax.random.key(seed), **kw)


def tokens(n=N, seed=1):
    return jax.random.normal(jax.random.key(seed), (n, DIM))


def dense(J):
    """The coupling tensor (H, n, n, dh, dh) as one (n·d, n·d) matrix (heads block-diagonal
    in the internal dimension)."""
    H, n, _, dh, _ = J.shape
    big = np.zeros((n, H, dh, n, H, dh))
    Jn = np.asarray(J, np.float64)
    for h in range(H):
        big[:, h, :, :, h, :] = Jn[h].transpose(0, 2, 1, 3)
    return big.reshape(n * H * dh, n * H * dh)


@pytest.mark.parametrize("heads,couplings", [(1, "explicit"), (2, "explicit"), (2, "softmax")])
def test_naive_fixed_point_is_the_linear_solve(heads, couplings):
    """With onsager="none" the fixed point of m = Jm + X is (I − J)⁻¹ X."""
    a = nn.ImplicitAttention(DIM, heads, max_len=N, couplings=couplings, onsager="none",
                             solver=solvers.Anderson(tol=1e-6, max_steps=100),
                             key=jax.random.key(3))
    x = tokens()
    if couplings == "explicit":  # stronger couplings than the init: spectral radius 0.8
        rho = np.abs(np.linalg.eigvals(dense(a.coupling_blocks(x)))).max()
        a = eqx.tree_at(lambda t: t.J, a, 0.8 / rho * a.J)
    m, d = call(a, x, return_diagnostics=True)
    J = dense(a.coupling_blocks(x))
    X = np.asarray(a.fields(x), np.float64).reshape(-1)
    want = np.linalg.solve(np.eye(J.shape[0]) - J, X).reshape(N, DIM)
    assert int(d.solver.result) == solvers.RESULTS.successful
    np.testing.assert_allclose(np.asarray(m), want, atol=2e-5)
    assert np.abs(want - np.asarray(a.fields(x))).max() > 1e-3  # the couplings matter


def test_coupling_structure():
    J = jax.random.normal(jax.random.key(0), (2, 4, 4, 3, 3))
    both = symmetrize_blocks(J, sites=True, internal=True)
    assert np.allclose(np.asarray(both)[:, np.arange(4), np.arange(4)], 0)
    np.testing.assert_allclose(both, jnp.swapaxes(both, 3, 4), atol=1e-6)
    np.testing.assert_allclose(both, jnp.swapaxes(jnp.swapaxes(both, 1, 2), 3, 4), atol=1e-6)
    internal = symmetrize_blocks(J, sites=False, internal=True)
    assert not np.allclose(internal, jnp.swapaxes(jnp.swapaxes(internal, 1, 2), 3, 4))
    # causal: no coupling to later sites; fewer tokens than sites uses the first ones
    a = make(causal=True)
    Jc = a.coupling_blocks(tokens(3))
    assert Jc.shape == (1, 3, 3, DIM, DIM)
    assert np.allclose(np.asarray(Jc)[:, np.triu_indices(3, 1)[0], np.triu_indices(3, 1)[1]], 0)
    # the initial scale of the post: variance 1/(N d²)
    big = nn.ImplicitAttention(16, max_len=64, key=jax.random.key(1))
    assert abs(float(jnp.var(big.J)) * 64 * 16**2 - 1) < 0.05


def test_mlp_fixed_point_and_gradients():
    """The MLP Onsager model: the solution satisfies its update; implicit gradients match
    backprop through many unrolled iterations and central finite differences."""
    a = make(onsager="mlp", solver=solvers.Anderson(tol=1e-6, max_steps=100),
             adjoint=solvers.Implicit(rtol=1e-7))
    x = tokens()
    m = call(a, x)
    X = a.fields(x)
    J = a.coupling_blocks(x)
    np.testing.assert_allclose(a.update(m, (X, J, None)), m, atol=1e-5)

    def loss(mod, xx):
        return jnp.sum(jnp.sin(mod(xx)))

    g_imp = eqx.filter_jit(eqx.filter_grad(loss))(a, x)
    unrolled = eqx.tree_at(lambda t: t.adjoint, a, solvers.Unrolled(),
                           is_leaf=lambda z: z is None)
    unrolled = eqx.tree_at(lambda t: t.solver, unrolled, solvers.Picard(tol=1e-7, max_steps=300))
    g_unr = eqx.filter_jit(eqx.filter_grad(loss))(unrolled, x)
    for got, want in ((g_imp.J, g_unr.J), (g_imp.onsager_mlp.layers[0].weight,
                                          g_unr.onsager_mlp.layers[0].weight)):
        np.testing.assert_allclose(got, want, atol=2e-4 * float(jnp.abs(want).max()) + 1e-6)
    # finite differences along a random direction in the input
    v = jax.random.normal(jax.random.key(9), x.shape)
    gx = eqx.filter_jit(jax.grad(lambda xx: loss(a, xx)))(x)
    eps = 1e-2
    fd = (loss(a, x + eps * v) - loss(a, x - eps * v)) / (2 * eps)
    assert abs(float(jnp.vdot(gx, v)) - float(fd)) < 2e-3 * max(1.0, abs(float(fd)))


def test_spectral_radius_matches_the_dense_jacobian():
    a = make(onsager="mlp", spectral_steps=200, solver=solvers.Anderson(tol=1e-6,
                                                                        max_steps=100))
    a = eqx.tree_at(lambda t: t.J, a, 6.0 * a.J)
    x = tokens()
    m, d = call(a, x, return_diagnostics=True)
    args = (a.fields(x), a.coupling_blocks(x), None)
    jac = jax.jacfwd(lambda z: a.update(z.reshape(N, DIM), args).reshape(-1))(m.reshape(-1))
    rho = np.abs(np.linalg.eigvals(np.asarray(jac, np.float64))).max()
    assert abs(float(d.spectral_radius) - rho) < 0.03 * rho
    assert make().__call__(x, return_diagnostics=True)[1].spectral_radius is None


def test_jacobian_penalty_enters_the_loss():
    base = nn.ImageClassifier((8, 8), 3, dim=DIM, attention="implicit", residual=False,
                              embed="patch", patch=4, key=jax.random.key(0),
                              attention_kwargs=dict(jacobian_penalty=0.5))
    off = nn.ImageClassifier((8, 8), 3, dim=DIM, attention="implicit", residual=False,
                             embed="patch", patch=4, key=jax.random.key(0))
    batch = {"inputs": jax.random.normal(jax.random.key(2), (4, 8, 8)),
             "targets": jnp.array([0, 1, 2, 0]), "mask": jnp.ones(4)}
    key = jax.random.key(5)
    loss_on, met_on = eqx.filter_jit(loss_fn)(base, batch, key)
    loss_off, met_off = eqx.filter_jit(loss_fn)(off, batch, key)
    assert "penalty" in met_on and "penalty" not in met_off
    assert float(met_on["penalty"]) > 0
    np.testing.assert_allclose(float(met_on["loss"]), float(met_off["loss"]), rtol=1e-5)
    np.testing.assert_allclose(float(loss_on), float(met_on["loss"] + met_on["penalty"]),
                               rtol=1e-5)
    # the penalty is ‖∂F/∂m‖_F² / (n d) in expectation: compare with the dense Jacobian
    attn = jax.tree.map(lambda z: z[0] if eqx.is_array(z) else z, base.layers.attention)
    x = base.sites(batch["inputs"][0])
    args = (attn.fields(x), attn.coupling_blocks(x), None)
    m = attn(x)
    jac = jax.jacfwd(lambda z: attn.update(z.reshape(x.shape), args).reshape(-1))(m.reshape(-1))
    exact = 0.5 * float(jnp.sum(jac**2)) / m.size
    penalty = eqx.filter_jit(jax.vmap(
        lambda k: attn(x, key=k, return_diagnostics=True)[1].penalty, in_axes=(0,)))
    est = np.asarray(penalty(jax.random.split(jax.random.key(0), 64)))
    assert abs(np.mean(est) - exact) < 4 * np.std(est) / math.sqrt(64) + 1e-6


def test_failed_solves_are_reported_or_raised():
    a = make(solver=solvers.Anderson(tol=1e-9, max_steps=2))
    a = eqx.tree_at(lambda t: t.J, a, 10.0 * a.J)
    _, d = call(a, tokens(), return_diagnostics=True)
    assert int(d.solver.result) != solvers.RESULTS.successful
    loud = make(solver=solvers.Anderson(tol=1e-9, max_steps=2), throw=True)
    loud = eqx.tree_at(lambda t: t.J, loud, 10.0 * loud.J)
    with pytest.raises(Exception, match="(?i)max|steps|converge"):
        jax.block_until_ready(loud(tokens()))


def test_errors():
    with pytest.raises(ValueError, match="onsager"):
        make(onsager="tap")
    with pytest.raises(ValueError, match="max_len"):
        make()(tokens(N + 1))
    with pytest.raises(ValueError, match="context"):
        make()(tokens(), context=tokens())
    with pytest.raises(ValueError, match="16x16|16×16"):
        nn.ImageClassifier((8, 8), 10, dim=DIM, key=jax.random.key(0))
    with pytest.raises(ValueError, match="patch"):
        nn.ImageClassifier((8, 8), 10, dim=DIM, embed="patch", patch=3, key=jax.random.key(0))
    model = nn.ImageClassifier((28, 28), 10, dim=DIM, key=jax.random.key(0))
    assert model.num_sites == 17  # the post's 4×4 grid plus the classification site
    with pytest.raises(ValueError, match="shape"):
        model(jnp.zeros((4, 28, 28)))


def test_adaptive_tap_onsager_has_the_naive_fixed_point():
    """With the Gaussian prior the adaptive-TAP correction changes how the iteration runs,
    not where it ends: the means solve m = Jm + X exactly (the Gaussian model's exact
    means), as with onsager="none"; the cavity variances are those of the exact marginal
    covariances, (I − V_i)⁻¹ = [(I − 𝐉)⁻¹]_ii."""
    kw = dict(max_len=N, solver=solvers.Anderson(tol=1e-6, max_steps=100))
    tap = nn.ImplicitAttention(DIM, 2, onsager="adaptive_tap", key=jax.random.key(4), **kw)
    naive = nn.ImplicitAttention(DIM, 2, onsager="none", key=jax.random.key(4), **kw)
    x = tokens()
    rho = np.abs(np.linalg.eigvals(dense(tap.coupling_blocks(x)))).max()
    tap, naive = (eqx.tree_at(lambda t: t.J, a, 0.8 / rho * a.J) for a in (tap, naive))
    m_tap, d_tap = call(tap, x, return_diagnostics=True)
    m_naive = call(naive, x)
    assert int(d_tap.solver.result) == solvers.RESULTS.successful
    np.testing.assert_allclose(m_tap, m_naive, atol=3e-5)
    J = tap.coupling_blocks(x)
    V = np.asarray(tap.cavity_variances(J), np.float64)  # (H, n, dh, dh)
    G = np.linalg.inv(np.eye(N * DIM) - dense(J)).reshape(N, 2, 3, N, 2, 3)
    for h in range(2):
        for i in range(N):
            np.testing.assert_allclose(np.linalg.inv(np.eye(3) - V[h, i]), G[i, h, :, i, h, :],
                                       atol=2e-4)


@pytest.mark.parametrize("attention", ["implicit", "free_energy"])
def test_plugs_into_token_models(attention):
    """Both implicit attentions are registered: a token classifier builds them by name (the
    Transformer passes max_len for their per-site couplings); a causal LM takes the implicit
    one (causal couplings) and refuses the free-energy one."""
    tok = jnp.array([1, 4, 2, 7, 3])
    clf = nn.Classifier(10, 3, dim=8, depth=2, num_heads=2, max_len=6, attention=attention,
                        key=jax.random.key(0))
    logits, diag = call(clf, tok, return_diagnostics=True)
    assert logits.shape == (3,) and np.all(np.isfinite(np.asarray(logits)))
    assert np.all(np.asarray(diag.solver.result) == solvers.RESULTS.successful)
    if attention == "free_energy":  # symmetric couplings: every output sees every token
        with pytest.raises(ValueError, match="causal"):
            nn.CausalLM(10, dim=8, depth=1, max_len=6, attention=attention,
                        key=jax.random.key(1))
        return
    lm = nn.CausalLM(10, dim=8, depth=1, max_len=6, attention=attention, key=jax.random.key(1))
    assert call(lm, tok).shape == (5, 10)


@pytest.mark.parametrize("causal", [False, True])
def test_amortised_couplings_factored_equal_the_dense_tensor(causal):
    """Softmax couplings are applied as W (Σ_j A_ij m_j) without forming the (h, n, n, dh, dh)
    tensor: the update, its gradients with respect to m and to every parameter, and the
    couplings' norms equal the dense tensor's."""
    from spinformer.nn._implicit import FactoredCouplings

    a = nn.ImplicitAttention(DIM, 2, causal=causal, couplings="softmax", onsager="mlp",
                             max_len=N,
                             key=jax.random.key(5))
    x, m = tokens(), tokens(seed=7)
    op = a.coupling_operator(x)
    assert isinstance(op, FactoredCouplings)
    np.testing.assert_allclose(op.dense(), a.coupling_blocks(x), atol=1e-7)
    X = a.fields(x)

    def f(model, m, factored):
        J = model.coupling_operator(x) if factored else \
            model.coupling_blocks(x)
        return jnp.sum(jnp.sin(model.update(m, (X, J, None))))

    for factored in (True, False):
        v, (gm, gp) = eqx.filter_value_and_grad(
            lambda both: f(both[1], both[0], factored))((m, a))
        if factored:
            ref = (v, gm, gp)
    np.testing.assert_allclose(ref[0], v, rtol=1e-6)
    np.testing.assert_allclose(ref[1], gm, rtol=1e-5, atol=1e-6)
    for g1, g2 in zip(jax.tree.leaves(eqx.filter(ref[2], eqx.is_array)),
                      jax.tree.leaves(eqx.filter(gp, eqx.is_array))):
        np.testing.assert_allclose(g1, g2, rtol=1e-5, atol=1e-6)
    _, d = call(a, x, return_diagnostics=True)
    want = np.sqrt((np.asarray(a.coupling_blocks(x)) ** 2).sum(axis=(-2, -1)))
    np.testing.assert_allclose(d.couplings, want, rtol=1e-5, atol=1e-7)
