"""`Reversible` and `ReversibleAdjoint` (McCallum, Arora & Foster, arXiv:2509.12917): the
coupled iteration against a numpy re-implementation and the other solvers; the reversible
gradient against backpropagation through the stored iterations (`Unrolled`) and the implicit
gradient; its memory, its behaviour under vmap, and where its rounding errors grow."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spinformer import solvers as S
from solver_helpers import random_contraction, tanh_map


def numpy_reversible(f, x0, beta, tol, max_steps):
    """The coupled iteration in float64 numpy: `(z_N, N)`, stopped at ‖f(z) − z‖∞ ≤ tol."""
    y = z = np.asarray(x0, np.float64)
    fz, k = f(z), 0
    while np.max(np.abs(fz - z)) > tol and k < max_steps:
        y = (1 - beta) * y + beta * fz
        z = (1 - beta) * z + beta * f(y)
        fz, k = f(z), k + 1
    return z, k


def _tanh_problem(n=12, seed=0, rho=0.8):
    rng = np.random.default_rng(seed)
    W = random_contraction(rng, n, rho)
    return W, rng.normal(size=n), rng.normal(size=n)


def _rel(a, b):
    return float(jnp.linalg.norm(jnp.ravel(a - b)) / jnp.linalg.norm(jnp.ravel(b)))


# ----------------------------------------------------------------------------- forward


def test_forward_matches_numpy_picard_and_anderson(x64):
    W, b, _ = _tanh_problem(n=16)
    args = (jnp.asarray(W), jnp.asarray(b))
    beta, tol = 0.7, 1e-12
    z_ref, k_ref = numpy_reversible(lambda x: np.tanh(W @ x + b), np.zeros(16), beta, tol, 500)
    solver = S.Reversible(damping=1 - beta, tol=tol, max_steps=500)
    fixed = S.fixed_point(tanh_map, jnp.zeros(16), args, solver=S.Anderson(tol=1e-13)).value
    for adjoint in (S.Implicit(), S.ReversibleAdjoint()):
        sol = S.fixed_point(tanh_map, jnp.zeros(16), args, solver=solver, adjoint=adjoint)
        assert int(sol.result) == S.RESULTS.successful
        assert int(sol.num_steps) == k_ref
        np.testing.assert_allclose(sol.value, z_ref, atol=1e-13)
        np.testing.assert_allclose(sol.value, fixed, atol=1e-11)
        # the residual reported is the true one at the returned value (z_N)
        true = float(jnp.max(jnp.abs(tanh_map(sol.value, args) - sol.value)))
        np.testing.assert_allclose(float(sol.residual), true, rtol=1e-6, atol=1e-16)
        assert float(sol.residual) <= tol and float(sol.final_residual) == float(sol.residual)
    picard = S.fixed_point(tanh_map, jnp.zeros(16), args, solver=S.Picard(tol=1e-13)).value
    np.testing.assert_allclose(sol.value, picard, atol=1e-11)


@pytest.mark.parametrize("adjoint", [S.Implicit(), S.ReversibleAdjoint()], ids=repr)
def test_nonconvergence_is_reported_or_raised(adjoint):
    solver = S.Reversible(max_steps=20)
    sol = S.fixed_point(lambda x, _: x + 1.0, jnp.zeros(3), None, solver=solver,
                        adjoint=adjoint, throw=False)
    assert int(sol.result) == S.RESULTS.max_steps_reached
    assert int(sol.num_steps) == 20 and float(sol.residual) >= 0.99
    with pytest.raises(Exception, match="max_steps"):
        jax.block_until_ready(S.fixed_point(lambda x, _: x + 1.0, jnp.zeros(3), None,
                                            solver=solver, adjoint=adjoint).value)
    # also where only the gradient is used (the forward check alone would be dead code)
    grad = jax.jit(jax.grad(lambda a: S.fixed_point(lambda x, a: x + a, jnp.zeros(2), a,
                                                    solver=solver, adjoint=adjoint)
                            .value.sum()))
    with pytest.raises(Exception, match="max_steps"):
        jax.block_until_ready(grad(jnp.ones(2)))


# ----------------------------------------------------------------------------- gradients


@pytest.mark.parametrize("beta", [0.5, 0.8])
def test_gradient_equals_unrolled_and_implicit(beta, x64):
    W, b, w = _tanh_problem()
    b, w = jnp.asarray(b), jnp.asarray(w)
    tol = 1e-7  # the error grows with the steps taken (see the next test)

    def loss(W, b, adjoint):
        fn = lambda x, a: jnp.tanh(W @ x + a)  # W is closed over, b is passed as args
        sol = S.fixed_point(fn, jnp.zeros(12), b, adjoint=adjoint,
                            solver=S.Reversible(damping=1 - beta, tol=tol, max_steps=200))
        return jnp.sum(w * sol.value) + jnp.sum(sol.value**2), sol.num_steps

    grad = jax.jit(jax.grad(loss, argnums=(0, 1), has_aux=True), static_argnums=2)
    g_rev, steps = grad(jnp.asarray(W), b, S.ReversibleAdjoint())
    g_unr, _ = grad(jnp.asarray(W), b, S.Unrolled())
    g_imp, _ = grad(jnp.asarray(W), b, S.Implicit(rtol=1e-12))
    assert int(steps) > 10
    for r, u, i in zip(g_rev, g_unr, g_imp):
        assert _rel(r, u) < 1e-10, (_rel(r, u), int(steps))
        assert _rel(r, i) < 100 * tol, _rel(r, i)  # the iteration's gradient vs the limit's
    assert float(jnp.abs(g_rev[0]).sum()) > 0


def test_rounding_errors_grow_as_documented(x64):
    """In exact arithmetic the gradient is exact. In floating point, running the contracting
    iteration backwards amplifies rounding errors; for f(x) = λx + b the gradient with
    respect to λ (a parameter multiplying the state) loses accuracy by the factor
    κ = μ₊²/(1 − β)² per step, μ₊ the forward rate, while the gradient with respect to b
    (which the iterates do not enter) stays exact."""
    lam, beta, n = 0.9, 0.5, 4
    b = jnp.linspace(0.5, 1.5, n)

    def loss(p, adjoint, steps):
        fn = lambda x, p: p[0] * x + p[1]
        sol = S.fixed_point(fn, jnp.zeros(n), p, adjoint=adjoint, throw=False,
                            solver=S.Reversible(damping=1 - beta, tol=0.0, max_steps=steps))
        return jnp.sum(jnp.sin(sol.value))

    grad = jax.jit(jax.grad(loss), static_argnums=(1, 2))
    p = (jnp.asarray(lam), b)
    errs = {}
    # 8 and 20 steps: far enough above the rounding unit that the ratio measures the growth
    # (after 4 steps the error is one rounding or none, depending on how XLA compiled)
    for steps in (8, 20):
        g_rev = grad(p, S.ReversibleAdjoint(), steps)
        g_unr = grad(p, S.Unrolled(), steps)
        errs[steps] = _rel(g_rev[0], g_unr[0])
        assert _rel(g_rev[1], g_unr[1]) < 1e-14
    assert errs[8] < 1e-11
    tr = 2 * (1 - beta) + beta**2 * lam**2
    mu = (tr + np.sqrt(tr**2 - 4 * (1 - beta) ** 2)) / 2
    kappa = mu**2 / (1 - beta) ** 2  # 3.5 here
    rate = (errs[20] / errs[8]) ** (1 / 12)  # measured 3.3-3.4
    assert kappa / 3 < rate < 3 * kappa, (rate, kappa, errs)


def test_vmap_with_per_example_steps(x64):
    W, b, _ = _tanh_problem(n=8)
    W, b = jnp.asarray(W), jnp.asarray(b)
    solver = S.Reversible(damping=0.4, tol=1e-7, max_steps=300)
    fn = lambda x, s: jnp.tanh(s * (W @ x) + b)

    def solve(s, adjoint=S.ReversibleAdjoint()):
        return S.fixed_point(fn, jnp.zeros(8), s, solver=solver, adjoint=adjoint)

    def loss(s, adjoint=S.ReversibleAdjoint()):
        return jnp.sum(solve(s, adjoint).value ** 2)

    scales = jnp.array([0.1, 0.5, 0.9])
    batched = jax.jit(jax.vmap(solve))(scales)
    singles = [solve(s) for s in scales]
    steps = [int(s.num_steps) for s in singles]
    assert steps[0] < steps[1] < steps[2]
    np.testing.assert_array_equal(batched.num_steps, steps)
    np.testing.assert_array_equal(batched.result, 0)
    np.testing.assert_allclose(batched.value, jnp.stack([s.value for s in singles]),
                               rtol=1e-14, atol=1e-15)
    g_batched = jax.jit(jax.vmap(jax.grad(loss)))(scales)
    grad = jax.jit(jax.grad(loss), static_argnums=1)
    # each example's gradient is that of its own iterations, up to rounding, which the
    # backward pass amplifies (batched products round differently)
    g_single = [grad(s, S.ReversibleAdjoint()) for s in scales]
    np.testing.assert_allclose(g_batched, g_single, rtol=1e-9)
    g_unr = [grad(s, S.Unrolled()) for s in scales]
    np.testing.assert_allclose(g_batched, g_unr, rtol=1e-9)


def test_step_budget_and_trace():
    fn = lambda x, b: 0.5 * jnp.cos(x) + b
    solver = S.Reversible(tol=1e-6, max_steps=50)

    def solve(b, adjoint):
        return S.fixed_point(fn, jnp.zeros(3), b, solver=solver, adjoint=adjoint,
                             throw=False, step_budget=3, trace=True)

    sol = solve(jnp.ones(3), S.ReversibleAdjoint())
    assert int(sol.num_steps) == 3 and int(sol.result) == S.RESULTS.max_steps_reached
    assert np.all(np.isfinite(sol.trace[:4])) and np.all(np.isnan(sol.trace[4:]))
    np.testing.assert_allclose(sol.trace[3], sol.residual)
    g_rev = jax.grad(lambda b: solve(b, S.ReversibleAdjoint()).value.sum())(jnp.ones(3))
    g_unr = jax.grad(lambda b: solve(b, S.Unrolled()).value.sum())(jnp.ones(3))
    np.testing.assert_allclose(g_rev, g_unr, rtol=1e-5)


def test_backward_memory_does_not_grow_with_the_steps(x64):
    n = 16
    W = 0.5 * jnp.eye(n)

    def temp_bytes(adjoint, steps):
        def loss(W):
            fn = lambda x, a: jnp.tanh(W @ x + a)
            return S.fixed_point(fn, jnp.zeros(n), jnp.ones(n), adjoint=adjoint, throw=False,
                                 solver=S.Reversible(tol=0.0, max_steps=steps)).value.sum()

        compiled = jax.jit(jax.grad(loss)).lower(W).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    rev = [temp_bytes(S.ReversibleAdjoint(), steps) for steps in (20, 200)]
    unr = [temp_bytes(S.Unrolled(), steps) for steps in (20, 200)]
    assert rev[1] == rev[0], rev
    assert unr[1] > unr[0] + 10 * n * 8, unr  # √(2·max_steps) checkpoints of the state
    assert rev[1] < unr[0]


def test_nonfinite_gradient_raises_or_is_nan():
    # float32, beta = 0.9: the forward converges exactly in 10 steps, but rebuilding the
    # iterates backwards from there amplifies rounding by up to 10x per step and takes sqrt
    # of a negative number
    def loss(a, throw):
        return S.fixed_point(lambda x, a: a * jnp.sqrt(x) + 1.0, jnp.ones(3), a, throw=throw,
                             solver=S.Reversible(damping=0.1, tol=1e-7),
                             adjoint=S.ReversibleAdjoint()).value.sum()

    assert np.isnan(jax.grad(loss)(0.5, False))
    with pytest.raises(Exception, match="ReversibleAdjoint"):
        jax.block_until_ready(jax.grad(loss)(0.5, True))


# ----------------------------------------------------------------------------- errors


def test_errors_are_clear():
    for damping in (0.0, 1.0, -0.1, 1.5):
        with pytest.raises(ValueError, match=r"damping.*\(0, 1\)"):
            S.Reversible(damping=damping)
    good = lambda x, _: 0.5 * x
    for solver in (S.Anderson(), S.Picard(), S.Newton()):
        with pytest.raises(ValueError, match="ReversibleAdjoint.*Reversible"):
            S.fixed_point(good, jnp.zeros(2), solver=solver, adjoint=S.ReversibleAdjoint())
    with pytest.raises(ValueError, match="ReversibleAdjoint"):
        S.root_find(good, jnp.zeros(2), adjoint=S.ReversibleAdjoint())
    with pytest.raises(ValueError, match="Newton"):
        S.root_find(good, jnp.zeros(2), solver=S.Reversible())


def test_config_names():
    """A config names the reversible solver and adjoint; a pair that does not fit is refused
    when the config is read, naming the key, and so is a root problem for either."""
    from spinformer.config import ConfigError, load_config

    cfg = load_config(overrides={"model.attention.solver": {"name": "reversible", "tol": 1e-4,
                                                       "max_steps": 30},
                                 "model.attention.adjoint": "reversible"})
    solver, adjoint = cfg.model.attention.solver, cfg.model.attention.adjoint
    assert isinstance(solver, S.Reversible) and solver.tol == 1e-4 and solver.max_steps == 30
    assert isinstance(adjoint, S.ReversibleAdjoint)
    load_config(overrides={"model.attention.solver": "reversible"})  # with the implicit adjoint
    with pytest.raises(ConfigError, match=r"model.attention.solver.name='anderson' with "
                                          r"adjoint.name='reversible': .*got solver=Anderson"):
        load_config(overrides={"model.attention.adjoint": "reversible"})
    for key in ("solver", "adjoint"):  # the free-energy saddle is a root
        with pytest.raises(ConfigError, match=r"model.attention.solver.name=.* with "
                                              r"adjoint.name="):
            load_config(overrides={"model.attention": "free_energy",
                                   f"model.attention.{key}": "reversible"})
