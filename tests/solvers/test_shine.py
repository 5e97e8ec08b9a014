"""The backward passes that reuse the forward solver's secant estimate of the inverse
Jacobian: `Shine()` (the estimate alone) and `Implicit(precondition=True)` (the estimate as
start and preconditioner of the exact solve). Checked against a dense solve of the adjoint
system, finite differences and backpropagation through the iterations."""

import pathlib

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spinformer import solvers as S
from spinformer.config import ConfigError, load_config
from solver_helpers import random_contraction, tanh_map

QUICKSTART = pathlib.Path(__file__).parents[2] / "configs" / "quickstart.yaml"


def _affine_problem(n=6, seed=0):
    rng = np.random.default_rng(seed)
    A = jnp.asarray(random_contraction(rng, n, 0.8))
    b = jnp.asarray(rng.normal(size=n))
    w = jnp.asarray(rng.normal(size=n))
    return A, b, w


def _exact_affine_grad(A, b, w):
    """d/db of w·x* for x* = A x* + b: (I − A)⁻ᵀ w, in numpy."""
    return np.linalg.solve((np.eye(len(b)) - np.asarray(A)).T, np.asarray(w))


def test_shine_is_the_exact_gradient_where_the_history_spans_the_space(x64):
    # On an affine map every residual difference is (A − I) times the iterate difference,
    # so once Anderson's history holds n + 1 iterates its multisecant estimate is the exact
    # inverse Jacobian, and SHINE's gradient is the implicit one. OneStep's is not.
    A, b, w = _affine_problem()
    solver = S.Anderson(history=8, ridge=1e-12, tol=1e-11, max_steps=200)

    def loss(b, adjoint):
        return w @ S.fixed_point(lambda x, b: A @ x + b, jnp.zeros_like(b), b, solver=solver,
                                 adjoint=adjoint).value

    exact = _exact_affine_grad(A, b, w)
    np.testing.assert_allclose(jax.grad(loss)(b, S.Shine()), exact, rtol=1e-6)
    assert np.max(np.abs(jax.grad(loss)(b, S.OneStep()) - exact)) > 1e-2


@pytest.mark.parametrize("history", [None, 4])
def test_shine_with_broyden_on_an_affine_root_is_exact(history, x64):
    # A root's Broyden starts from the exact inverse Jacobian at x0; on an affine residual
    # every secant pair agrees with it, so the updates vanish and H stays exact (dense and
    # limited memory): SHINE's gradient is the implicit one, signs of a root included.
    A, b, w = _affine_problem(seed=1)
    M = jnp.eye(6) - A

    def loss(b, adjoint):
        x = S.root_find(lambda x, b: M @ x - b, jnp.zeros_like(b), b,
                        solver=S.Broyden(history=history, tol=1e-11), adjoint=adjoint).value
        return w @ x

    np.testing.assert_allclose(jax.grad(loss)(b, S.Shine()), _exact_affine_grad(A, b, w),
                               rtol=1e-8)


def _tanh_problem(n=24, seed=2):
    rng = np.random.default_rng(seed)
    W = jnp.asarray(random_contraction(rng, n, 0.9))
    c = jnp.asarray(rng.normal(size=n))
    return W, c


@pytest.mark.parametrize("solver", [S.Anderson(tol=1e-10, max_steps=300),
                                    S.Broyden(tol=1e-10, max_steps=300),
                                    S.Broyden(history=5, tol=1e-10, max_steps=300)],
                         ids=["anderson", "broyden", "broyden5"])
def test_preconditioned_implicit_gradient_is_exact_and_takes_fewer_products(solver, x64):
    W, c = _tanh_problem()

    def loss(args, adjoint):
        x = S.fixed_point(tanh_map, jnp.zeros_like(c), args, solver=solver,
                          adjoint=adjoint).value
        return jnp.sum(jnp.sin(x))

    def grads(adjoint):
        adjoint = S.record_backward(adjoint)
        g = eqx.filter_grad(lambda ta: loss(*ta))(((W, c), adjoint))
        return g[0], g[1].probe

    plain, rec_plain = grads(S.Implicit(rtol=1e-9))
    pre, rec_pre = grads(S.Implicit(rtol=1e-9, precondition=True))
    dense, _ = grads(S.Implicit(rtol=1e-12, linear_solver=S.Dense()))
    for a, d in zip(pre, dense):
        np.testing.assert_allclose(a, d, rtol=1e-6, atol=1e-10)
    # central differences in c
    eps, v = 1e-6, jnp.linspace(-1.0, 1.0, c.shape[0])
    fd = (loss((W, c + eps * v), S.Implicit()) - loss((W, c - eps * v), S.Implicit())) / (2 * eps)
    np.testing.assert_allclose(pre[1] @ v, fd, rtol=1e-6)
    assert rec_pre[3] == 0 and rec_pre[2] <= 1e-8  # no fallback; the residual reached
    assert rec_pre[1] < rec_plain[1], (rec_pre, rec_plain)


def test_shine_under_vmap_and_jit_matches_per_example(x64):
    W, c = _tanh_problem(n=8)
    cs = jnp.stack([c, 0.5 * c, -c])
    solver = S.Anderson(tol=1e-10, max_steps=300)

    def one(c):
        return jnp.sum(S.fixed_point(tanh_map, jnp.zeros_like(c), (W, c), solver=solver,
                                     adjoint=S.Shine()).value ** 2)

    batched = jax.jit(jax.vmap(jax.grad(one)))(cs)
    for i in range(3):
        np.testing.assert_allclose(batched[i], jax.grad(one)(cs[i]), rtol=1e-5)
    # an approximation of the gradient, closer than the identity's on this contraction
    exact = jax.vmap(jax.grad(lambda c: jnp.sum(S.fixed_point(
        tanh_map, jnp.zeros_like(c), (W, c), solver=solver,
        adjoint=S.Implicit(rtol=1e-12)).value ** 2)))(cs)
    assert np.all(np.isfinite(batched))
    cos = jnp.sum(batched * exact, -1) / jnp.linalg.norm(batched, axis=-1) / jnp.linalg.norm(
        exact, axis=-1)
    assert np.all(cos > 0.5), cos


def test_solvers_without_an_estimate_are_refused():
    good = lambda x, a: 0.5 * jnp.tanh(x)  # noqa: E731
    with pytest.raises(ValueError, match="Anderson.*Broyden.*Picard"):
        S.fixed_point(good, jnp.zeros(2), solver=S.Picard(), adjoint=S.Shine())
    with pytest.raises(ValueError, match="precondition=True.*Newton"):
        S.root_find(lambda x, a: x - good(x, a), jnp.zeros(2), solver=S.Newton(),
                    adjoint=S.Implicit(precondition=True))
    with pytest.raises(ValueError, match="Dense"):
        S.Implicit(linear_solver=S.Dense(matrix=lambda x, a: jnp.eye(2)), precondition=True)


def test_config_words_for_the_secant_adjoints():
    cfg = load_config(QUICKSTART, ["model.attention.adjoint.name=shine"])
    assert isinstance(cfg.model.attention.adjoint, S.Shine)
    cfg = load_config(QUICKSTART,
                      ["model.attention.adjoint.precondition=true"])
    assert cfg.model.attention.adjoint.precondition is True
    with pytest.raises(ConfigError, match="shine|Shine|Picard"):
        load_config(QUICKSTART, ["model.attention.adjoint.name=shine",
                                                "model.attention.solver.name=picard"])
