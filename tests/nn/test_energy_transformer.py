"""The Energy Transformer (`spins.energy_transformer`, `nn.EnergyTransformerAttention`):
energies against their definitions, the closed-form gradient against autodiff, the energy
along the descent, and the attention module."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spinformer import nn
from spinformer.spins import energy_transformer as et

N, D, H, Y, M = 6, 12, 3, 4, 20


def _params(key, gamma=1.3, dtype=jnp.float64):
    ks = jax.random.split(key, 4)
    return et.Params(jnp.asarray(gamma, dtype), 0.1 * jax.random.normal(ks[0], (D,), dtype),
                     0.5 * jax.random.normal(ks[1], (H, Y, D), dtype),
                     0.5 * jax.random.normal(ks[2], (H, Y, D), dtype),
                     0.3 * jax.random.normal(ks[3], (M, D), dtype),
                     beta=1 / np.sqrt(Y), beta_hn=2.0)


def _brute_energy(g, p, kind, mask=None):
    """The energies written as the paper's sums, one term at a time."""
    g = np.asarray(g)
    E = 0.0
    for h in range(H):
        Q, K = g @ np.asarray(p.Wq[h]).T, g @ np.asarray(p.Wk[h]).T
        for C in range(N):
            keys = [B for B in range(N) if B != C and (mask is None or mask[C, B])]
            if keys:
                E -= np.log(sum(np.exp(p.beta * K[B] @ Q[C]) for B in keys)) / p.beta
    P = g @ np.asarray(p.xi).T
    if kind == "relu":
        return E - 0.5 * np.sum(np.maximum(P, 0) ** 2)
    return E - sum(np.log(np.sum(np.exp(p.beta_hn * P[B]))) for B in range(N)) / p.beta_hn


def test_layer_norm_is_the_gradient_of_its_lagrangian(x64):
    x = jax.random.normal(jax.random.key(0), (N, D), jnp.float64)
    p = _params(jax.random.key(1))
    g = et.layer_norm(x, p.gamma, p.delta)
    np.testing.assert_allclose(jax.grad(et.layer_norm_lagrangian)(x, p.gamma, p.delta), g,
                               atol=1e-12)
    # with δ = 0 and γ = 1 it is the usual layer norm
    c = np.asarray(x) - np.asarray(x).mean(1, keepdims=True)
    np.testing.assert_allclose(et.layer_norm(x, 1.0, jnp.zeros(D)),
                               c / np.sqrt((c**2).mean(1, keepdims=True) + 1e-5), atol=1e-12)


@pytest.mark.parametrize("kind", ["relu", "softmax"])
def test_energy_and_its_closed_form_gradient(x64, kind):
    x = jax.random.normal(jax.random.key(0), (N, D), jnp.float64)
    p = _params(jax.random.key(1))
    g = et.layer_norm(x, p.gamma, p.delta)
    tril = np.tril(np.ones((N, N), bool))
    for mask in (None, tril):
        m = None if mask is None else jnp.asarray(mask)
        np.testing.assert_allclose(et.energy(g, p, kind=kind, mask=m),
                                   _brute_energy(g, p, kind, mask), rtol=1e-12)
        auto = jax.grad(lambda gg: et.energy(gg, p, kind=kind, mask=m))(g)
        np.testing.assert_allclose(et.energy_grad(g, p, kind=kind, mask=m), auto, atol=1e-12)
    A = et.attention_weights(g, p.Wq, p.Wk, beta=p.beta, mask=jnp.asarray(tril))
    np.testing.assert_allclose(A[:, 0], 0.0)  # the first query sees no other key
    np.testing.assert_allclose(A[:, 1:].sum(-1), 1.0, rtol=1e-12)
    np.testing.assert_allclose(jnp.diagonal(A, axis1=1, axis2=2), 0.0)  # B ≠ C


def test_descent_lowers_the_energy_for_positive_gamma_only(x64):
    """γ > 0 makes the layer-norm Lagrangian convex and the energy a Lyapunov function of
    the continuous dynamics; measured here on 10 instances with small steps. With γ < 0 the
    same steps raise the energy."""
    descent = jax.jit(et.descent, static_argnames=("steps", "kind"))  # one compilation
    for seed in range(10):
        kx, kp = jax.random.split(jax.random.key(seed))
        x = jax.random.normal(kx, (N, D), jnp.float64)
        p = _params(kp)
        for kind in ("relu", "softmax"):
            e = np.asarray(descent(x, p, steps=40, alpha=0.01, kind=kind).energies)
            assert e.shape == (41,) and np.all(np.diff(e) <= 1e-9), (seed, kind)
            assert e[-1] < e[0]
        neg = np.asarray(descent(x, p._replace(gamma=-p.gamma), steps=40,
                                 alpha=0.01).energies)
        assert neg[-1] > neg[0]


def test_stationarity_is_the_gradient_the_layer_norm_passes_on(x64):
    """The layer norm's Jacobian (autodiff) applied to ∂E/∂g is (γ/σ_A) times the projected
    gradient `stationarity` measures (up to ε/(var + ε))."""
    x = 3.0 * jax.random.normal(jax.random.key(0), (N, D), jnp.float64) + 1.0
    p = _params(jax.random.key(1))
    G = et.energy_grad(et.layer_norm(x, p.gamma, p.delta, p.eps), p)
    # per token: the Jacobian of g_A with respect to x_A, applied to ∂E/∂g_A
    JG = jax.vmap(lambda xa, ga: jax.jvp(
        lambda v: et.layer_norm(v[None], p.gamma, p.delta, p.eps)[0], (xa,), (ga,))[1])(x, G)
    sigma = np.sqrt(np.var(np.asarray(x), axis=-1) + p.eps)
    np.testing.assert_allclose(np.linalg.norm(JG, axis=-1) * sigma / float(p.gamma),
                               et.stationarity(x, p), rtol=1e-5)
    assert np.all(np.asarray(et.stationarity(x, p)) < np.linalg.norm(G, axis=-1))


def test_descent_converges_in_g_while_x_drifts(x64):
    """No fixed point in x (module docstring): ‖x‖ keeps growing about linearly and ∂E/∂g
    does not vanish, while the part that moves g decays."""
    x0 = jax.random.normal(jax.random.key(3), (N, D), jnp.float64)
    p = _params(jax.random.key(4))
    descent = jax.jit(et.descent, static_argnames=("steps", "kind"))
    xs = [descent(x0, p, steps=10, alpha=0.1).x]
    for _ in range(4):  # 10, 1010, 2010, 3010, 4010 steps
        xs.append(descent(xs[-1], p, steps=1000, alpha=0.1).x)
    norms = [float(jnp.linalg.norm(x)) for x in xs]
    growth = np.diff(norms)
    assert np.all(growth > 0.8 * growth[0]) and norms[-1] > 100 * norms[0], norms
    grad = et.energy_grad(et.layer_norm(xs[-1], p.gamma, p.delta, p.eps), p)
    moving = [float(jnp.linalg.norm(et.stationarity(x, p))) for x in xs]
    assert float(jnp.linalg.norm(grad)) > 10 * moving[-1], (moving, grad)
    assert moving[-1] < 0.5 * moving[0], moving  # slowly (non-monotonically) on the way


def test_descent_backpropagates_through_every_step(x64):
    x = jax.random.normal(jax.random.key(0), (N, D), jnp.float64)
    p = _params(jax.random.key(1))

    def loss(Wq):
        return jnp.sum(jnp.sin(et.descent(x, p._replace(Wq=Wq), steps=5, alpha=0.1).x))

    g = jax.grad(loss)(p.Wq)
    d = jax.random.normal(jax.random.key(2), p.Wq.shape, jnp.float64)
    eps = 1e-6
    fd = (loss(p.Wq + eps * d) - loss(p.Wq - eps * d)) / (2 * eps)
    np.testing.assert_allclose(jnp.sum(g * d), fd, rtol=1e-6)


def test_attention_module(getkey):
    attn = nn.EnergyTransformerAttention(16, 2, steps=4, key=getkey())
    x = jax.random.normal(getkey(), (7, 16))
    y, diag = attn(x, return_diagnostics=True)
    assert y.shape == (7, 16) and diag.fields.shape == (5,)
    assert np.all(np.diff(np.asarray(diag.fields)) <= 1e-4)  # the energy went down
    p = attn.params()
    np.testing.assert_allclose(y, et.descent(x, p, steps=4, alpha=0.1).x - x, atol=1e-5)
    # padding: a masked-out key does not move the others through the attention energy
    mask = jnp.ones((7, 7), bool).at[:, 6].set(False).at[6, :].set(False)
    y2 = attn(x.at[6].set(100.0), mask=mask)
    np.testing.assert_allclose(y2[:6], attn(x[:6])[:6], atol=1e-4)
    grads = eqx.filter_grad(lambda a: jnp.sum(a(x) ** 2))(attn)
    assert all(np.all(np.isfinite(v)) for v in jax.tree.leaves(eqx.filter(grads,
                                                                          eqx.is_array)))
    soft = nn.EnergyTransformerAttention(16, 2, hopfield="softmax", key=getkey())
    assert soft.hopfield == "softmax"


def test_errors():
    with pytest.raises(ValueError, match="not causal"):
        nn.EnergyTransformerAttention(8, 2, causal=True, key=jax.random.key(0))
    with pytest.raises(ValueError, match="hopfield='tanh' is not one of"):
        nn.EnergyTransformerAttention(8, 2, hopfield="tanh", key=jax.random.key(0))
    with pytest.raises(ValueError, match="steps must be a Python int >= 1"):
        et.descent(jnp.zeros((3, 4)), _params(jax.random.key(0), dtype=jnp.float32),
                   steps=0, alpha=0.1)
    with pytest.raises(ValueError, match=r"tokens must have shape \(N, D\)"):
        et.layer_norm(jnp.zeros(4), 1.0, jnp.zeros(4))
