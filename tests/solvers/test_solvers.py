import functools
from typing import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import jaxopt
import numpy as np
import pytest

from spinformer import solvers as S
from spinformer.config import ConfigError, load_config
from solver_helpers import (
    JaxoptAnderson,
    linear_map,
    numpy_iterate,
    numpy_tap,
    random_contraction,
    sk_couplings,
    tuned,
    tanh_map,
    tap_map,
)

FP_SOLVERS = [
    S.Picard(),
    S.Picard(damping=0.3),
    S.Anderson(),
    S.Anderson(history=2, damping=0.3, safeguard=False),
    S.Broyden(),
    S.Broyden(history=3),
    S.Newton(),
    JaxoptAnderson(),
]
ids = lambda s: repr(s).replace("\n", "")


def true_residual(fn, value, args):
    return float(jnp.max(jnp.abs(fn(value, args) - value)))


# ----------------------------------------------------------------------------- values


@pytest.mark.parametrize("solver", FP_SOLVERS, ids=ids)
def test_linear_map_closed_form(solver, x64):
    rng = np.random.default_rng(0)
    n = 6
    A = random_contraction(rng, n, 0.6)
    b = rng.normal(size=n)
    sol = S.fixed_point(linear_map, jnp.zeros(n), (jnp.asarray(A), jnp.asarray(b)),
                        solver=tuned(solver, tol=1e-10, max_steps=200))
    exact = np.linalg.solve(np.eye(n) - A, b)
    np.testing.assert_allclose(sol.value, exact, atol=1e-8)
    assert sol.result == S.RESULTS.successful
    assert sol.value.dtype == jnp.float64
    # The reported residual is the real one at the returned value.
    if not isinstance(solver, JaxoptAnderson):  # jaxopt reports it at the previous iterate
        assert abs(true_residual(linear_map, sol.value, (A, b)) - float(sol.residual)) < 1e-12
    assert float(sol.residual) <= 1e-10


@pytest.mark.parametrize("solver", FP_SOLVERS, ids=ids)
def test_tanh_contraction_matches_long_iteration(solver):
    rng = np.random.default_rng(1)
    n = 16
    W = random_contraction(rng, n, 0.8)
    b = rng.normal(size=n)
    ref = numpy_iterate(lambda x: np.tanh(W @ x + b), np.zeros(n))
    sol = S.fixed_point(tanh_map, jnp.zeros(n, jnp.float32),
                        (jnp.asarray(W, jnp.float32), jnp.asarray(b, jnp.float32)),
                        solver=tuned(solver, tol=1e-6))
    np.testing.assert_allclose(sol.value, ref, atol=2e-5)
    assert sol.value.dtype == jnp.float32


def test_binary_tap_matches_damped_iteration():
    rng = np.random.default_rng(2)
    n, beta = 64, 0.8
    J = sk_couplings(rng, n, beta=1.0, j_mean=0.0, j_std=0.5)
    h = rng.normal(scale=0.3, size=n)
    ref = numpy_iterate(numpy_tap(h, J, beta), np.zeros(n), steps=4000, damping=0.5)
    assert np.max(np.abs(numpy_tap(h, J, beta)(ref) - ref)) < 1e-12
    args = (jnp.asarray(h, jnp.float32), jnp.asarray(J, jnp.float32), beta)
    for solver in (S.Anderson(), S.Picard(damping=0.5), S.Broyden()):
        sol = S.fixed_point(tap_map, jnp.zeros(n), args,
                            solver=tuned(solver, tol=1e-6, max_steps=300))
        np.testing.assert_allclose(sol.value, ref, atol=5e-6)


def test_anderson_beats_picard_on_tap_near_critical_point():
    rng = np.random.default_rng(3)
    n, beta = 128, 1.11
    J = jnp.asarray(sk_couplings(rng, n, beta), jnp.float32)
    h = jnp.asarray(rng.uniform(-0.5 * beta, 0.5 * beta, n), jnp.float32)
    rule = dict(tol=1e-5, max_steps=1000)
    pic = S.fixed_point(tap_map, jnp.zeros(n), (h, J, 1.0), solver=S.Picard(**rule),
                        throw=False)
    and_ = S.fixed_point(tap_map, jnp.zeros(n), (h, J, 1.0), solver=S.Anderson(**rule),
                         throw=False)
    assert and_.result == S.RESULTS.successful
    assert int(and_.num_steps) < int(pic.num_steps)
    ref = numpy_iterate(numpy_tap(np.asarray(h, np.float64), np.asarray(J, np.float64), 1.0),
                        np.zeros(n), steps=20000, damping=0.5)
    # Near the transition the map contracts weakly, so the error is ~ tol / (1 - rate).
    np.testing.assert_allclose(and_.value, ref, atol=2e-4)



@pytest.mark.parametrize("n", [3, 4, 6])
def test_anderson_terminates_on_linear_maps_like_gmres(n, x64):
    # On an affine map with a history of n + 1 iterates, type-II Anderson spans the same
    # Krylov space as GMRES and, in exact arithmetic, lands on the fixed point at step n + 1.
    # A ridge scaled by the oldest (largest) residual of the window swamps the newest ones
    # once they have fallen by orders of magnitude: that took 14-34 steps here.
    rng = np.random.default_rng(n)
    for _ in range(3):
        A = rng.normal(size=(n, n))
        A *= 0.95 / np.max(np.abs(np.linalg.eigvals(A)))
        b = rng.normal(size=n)
        sol = S.fixed_point(lambda x, a: a[0] @ x + a[1], jnp.zeros(n),
                            (jnp.asarray(A), jnp.asarray(b)), throw=False,
                            solver=S.Anderson(history=n + 1, tol=1e-10, max_steps=200,
                                              norm=S.l2_norm))
        assert sol.result == S.RESULTS.successful
        assert int(sol.num_steps) <= 2 * n + 2
        np.testing.assert_allclose(sol.value, np.linalg.solve(np.eye(n) - A, b), atol=1e-8)

def test_pytree_state(x64):
    rng = np.random.default_rng(4)
    A = jnp.asarray(random_contraction(rng, 3, 0.5))
    B = jnp.asarray(random_contraction(rng, 2, 0.5))

    def fn(x, args):
        return {"a": jnp.tanh(A @ x["a"] + 0.1 * x["b"][0][0] + 1.0),
                "b": (B @ x["b"][0] - 0.2 * jnp.sum(x["a"]), x["b"][1] * 0.5 + 1.0)}

    x0 = {"a": jnp.zeros(3), "b": (jnp.zeros(2), jnp.zeros(()))}
    ref = {"a": np.zeros(3), "b": (np.zeros(2), 0.0)}
    for _ in range(500):
        ref = {"a": np.tanh(np.asarray(A) @ ref["a"] + 0.1 * ref["b"][0][0] + 1.0),
               "b": (np.asarray(B) @ ref["b"][0] - 0.2 * ref["a"].sum(), ref["b"][1] * 0.5 + 1)}
    sol = S.fixed_point(fn, x0, None, solver=S.Anderson(tol=1e-12, max_steps=200))
    assert jax.tree.structure(sol.value) == jax.tree.structure(x0)
    np.testing.assert_allclose(sol.value["a"], ref["a"], atol=1e-10)
    np.testing.assert_allclose(sol.value["b"][0], ref["b"][0], atol=1e-10)
    np.testing.assert_allclose(sol.value["b"][1], 2.0, atol=1e-10)


def test_root_find_newton_and_broyden(x64):
    theta = jnp.array([0.5, -2.0, 3.0])

    def F(x, t):
        return x**3 + x - t

    ref = np.array([np.real([r for r in np.roots([1, 0, 1, -t]) if abs(r.imag) < 1e-9][0])
                    for t in np.asarray(theta)])
    for solver in (S.Newton(), S.Broyden(), S.Broyden(history=8)):
        sol = S.root_find(F, jnp.zeros(3), theta, solver=tuned(solver, tol=1e-12))
        np.testing.assert_allclose(sol.value, ref, atol=1e-10)
        # d x / d t = 1 / (3 x^2 + 1)
        g = jax.grad(lambda t: S.root_find(F, jnp.zeros(3), t, solver=tuned(solver, tol=1e-12),
                                           adjoint=S.Implicit(rtol=1e-11)).value.sum())(theta)
        np.testing.assert_allclose(g, 1 / (3 * ref**2 + 1), rtol=1e-7)


def test_dense_adjoint_solves_what_richardson_cannot(x64):
    """`Implicit(linear_solver=Dense())` forms ∂F/∂x from n products and solves directly:
    on a root whose Jacobian has eigenvalues far from 1 (−3 ... 5, non-symmetric) the
    Neumann-series backward solve fails (NaN with throw=False) and Dense gives the analytic
    gradient; with a closed-form matrix (`Dense(matrix=...)`) it spends no
    product on forming it, and the solve is recorded like every implicit solve."""
    n = 6
    A = jnp.asarray(np.random.default_rng(0).normal(size=(n, n))) + jnp.diag(
        jnp.linspace(-3.0, 5.0, n))
    b = jnp.arange(1.0, n + 1.0)

    def F(x, theta):
        return A @ x + 0.1 * jnp.tanh(x) - theta

    def loss(theta, adjoint):
        sol = S.root_find(F, jnp.zeros(n), theta, solver=S.Newton(tol=1e-12), adjoint=adjoint,
                          throw=False)
        return jnp.sum(sol.value * b)

    x = S.root_find(F, jnp.zeros(n), b, solver=S.Newton(tol=1e-12)).value
    jac = A + jnp.diag(0.1 * (1 - jnp.tanh(x) ** 2))
    want = np.linalg.solve(np.asarray(jac).T, np.asarray(b))  # d(b·x)/dθ = J⁻ᵀ b
    np.testing.assert_allclose(jax.grad(loss)(b, S.Implicit(linear_solver=S.Dense())), want,
                               rtol=1e-9)
    closed = S.Dense(matrix=lambda x, theta: A + jnp.diag(0.1 * (1 - jnp.tanh(x) ** 2)))
    adjoint = S.record_backward(S.Implicit(linear_solver=closed))
    g = jax.grad(lambda t, adj: loss(t, adj), argnums=(0, 1))(b, adjoint)
    np.testing.assert_allclose(g[0], want, rtol=1e-9)
    _, (record,) = S.backward_stats(g[1])
    np.testing.assert_allclose(record[:2], [1, 1])  # one solve: only its residual's product
    np.testing.assert_allclose(record[3], 0)  # no fallback needed
    # the Neumann series (Richardson with Picard) needs the spectrum of ∂F/∂x near 1: alone it
    # fails; the default fallback (Auto: a dense solve at this size) answers, and is counted
    assert not np.all(np.isfinite(jax.grad(loss)(b, S.Implicit(linear_solver=S.Picard(),
                                                               fallback=None))))
    adj = S.record_backward(S.Implicit(linear_solver=S.Picard()))
    g, record = jax.grad(lambda t, probe: loss(t, eqx.tree_at(lambda a: a.probe, adj, probe)),
                         argnums=(0, 1))(b, adj.probe)
    np.testing.assert_allclose(g, want, rtol=1e-9)
    assert record[3] == 1 and record[2] < 1e-9
    with pytest.raises(ValueError, match="needs the solution point"):
        closed.solve(lambda v: v, b, rtol=1e-6, max_steps=1)


def test_jit_and_float64_dtypes(x64):
    fn = jax.jit(lambda b: S.fixed_point(lambda x, b: 0.5 * jnp.cos(x) + b, jnp.zeros(2), b).value)
    out = fn(jnp.array([0.1, 0.2]))
    assert out.dtype == jnp.float64
    np.testing.assert_allclose(out, 0.5 * np.cos(out) + np.array([0.1, 0.2]), atol=1e-5)


# ----------------------------------------------------------------------------- vmap


def test_vmap_per_example_statistics():
    rates = jnp.array([0.1, 0.5, 0.9])
    b = jnp.array([1.0, -1.0, 0.5])

    def solve(rate, bi):
        return S.fixed_point(lambda x, a: a[0] * jnp.sin(x) + a[1], jnp.zeros(()), (rate, bi),
                             solver=S.Picard(tol=1e-6, max_steps=500))

    batched = jax.vmap(solve)(rates, b)
    assert batched.num_steps.shape == (3,)
    singles = [solve(r, bi) for r, bi in zip(rates, b)]
    steps = [int(s.num_steps) for s in singles]
    assert steps[0] < steps[1] < steps[2]
    # Each example stops when it converges: same steps and bitwise-same values as alone.
    np.testing.assert_array_equal(batched.num_steps, steps)
    np.testing.assert_array_equal(batched.value, jnp.stack([s.value for s in singles]))
    np.testing.assert_array_equal(batched.result, 0)
    assert jnp.all(batched.residual <= 1e-6)


def test_vmap_mixed_results_without_throw():
    def solve(slope):
        return S.fixed_point(lambda x, s: s * x + 1.0, jnp.zeros(()), slope,
                             solver=S.Picard(tol=1e-6, max_steps=50), throw=False)

    sol = jax.vmap(solve)(jnp.array([0.5, 1.5]))
    np.testing.assert_array_equal(sol.result, [S.RESULTS.successful, S.RESULTS.max_steps_reached])
    np.testing.assert_array_equal(sol.num_steps[1], 50)


# ----------------------------------------------------------------------------- gradients


def _tap_problem(n=12, seed=5):
    rng = np.random.default_rng(seed)
    J = sk_couplings(rng, n, beta=1.0, j_mean=0.0, j_std=0.6)
    h = rng.normal(scale=0.4, size=n)
    return jnp.asarray(h), jnp.asarray(J)


def _fd_grad(f, x, eps=1e-6):
    f = jax.jit(f)
    x = np.asarray(x, np.float64)
    g = np.zeros_like(x)
    for idx in np.ndindex(x.shape):
        e = np.zeros_like(x)
        e[idx] = eps
        g[idx] = (f(jnp.asarray(x + e)) - f(jnp.asarray(x - e))) / (2 * eps)
    return g


@pytest.mark.parametrize(
    "solver,adjoint",
    [
        (S.Anderson(), S.Implicit(rtol=1e-11)),
        (S.Anderson(), S.Implicit(linear_solver=S.BiCGStab(), rtol=1e-11)),
        (S.Anderson(), S.Implicit(linear_solver=S.GMRES(restart=20), rtol=1e-11)),
        (S.Picard(damping=0.2), S.Implicit(rtol=1e-11)),
        (S.Broyden(), S.Implicit(rtol=1e-11)),
        (JaxoptAnderson(), S.Implicit(rtol=1e-11)),
    ],
    ids=ids,
)
def test_gradients_implicit_unrolled_fd_agree(solver, adjoint, x64):
    h, J = _tap_problem()
    w = jnp.linspace(-1.0, 1.0, h.shape[0])

    def loss(h, J, adj, sol=solver):
        m = S.fixed_point(tap_map, jnp.zeros_like(h), (h, J, 0.9),
                          solver=tuned(sol, tol=1e-12, max_steps=400), adjoint=adj).value
        return jnp.sum(w * m) + jnp.sum(m**2)

    g_imp = jax.grad(loss, argnums=(0, 1))(h, J, adjoint)
    g_unr = jax.grad(loss, argnums=(0, 1))(h, J, S.Unrolled(), S.Picard(damping=0.2))
    g_fd = _fd_grad(lambda hh: loss(hh, J, adjoint), h)
    np.testing.assert_allclose(g_imp[0], g_unr[0], rtol=1e-7, atol=1e-9)
    np.testing.assert_allclose(g_imp[1], g_unr[1], rtol=1e-7, atol=1e-9)
    np.testing.assert_allclose(g_imp[0], g_fd, rtol=1e-6, atol=1e-8)


def test_unrolled_through_anderson_matches_fd(x64):
    h, J = _tap_problem(n=6, seed=6)

    def loss(h):
        m = S.fixed_point(tap_map, jnp.zeros_like(h), (h, J, 0.9),
                          solver=S.Anderson(tol=1e-12, max_steps=100),
                          adjoint=S.Unrolled()).value
        return jnp.sum(jnp.sin(m))

    np.testing.assert_allclose(jax.grad(loss)(h), _fd_grad(loss, h), rtol=1e-6, atol=1e-9)


def _closed_over_problem():
    rng = np.random.default_rng(7)
    W = jnp.asarray(random_contraction(rng, 5, 0.7))
    b = jnp.asarray(rng.normal(size=5))

    def loss(W, adjoint):
        fn = lambda x, _: jnp.tanh(W @ x + b)  # W is closed over, not passed as args
        # Picard (contraction 0.7: 1e-12 in about 80 steps): the unrolled reference through
        # its loop compiles in a quarter of Anderson's time
        sol = S.fixed_point(fn, jnp.zeros(5), None, solver=S.Picard(tol=1e-12, max_steps=300),
                            adjoint=adjoint)
        return jnp.sum(sol.value**2)

    return W, loss


@functools.cache
def _closed_over_unrolled_reference():
    """The unrolled-backprop gradient of `_closed_over_problem`, computed once for all the
    linear solvers below (each call builds a new closure, so JAX's own cache cannot share
    its compile between them: ~6 s each)."""
    with jax.enable_x64(True):
        W, loss = _closed_over_problem()
        return np.asarray(jax.grad(loss)(W, S.Unrolled()))


@pytest.mark.parametrize(
    "linear_solver",
    [S.GMRES(), S.BiCGStab(), S.Picard(), S.Anderson(history=5, safeguard=False)], ids=ids,
)
def test_gradient_wrt_closed_over_parameters(linear_solver, x64):
    W, loss = _closed_over_problem()
    g_imp = jax.grad(loss)(W, S.Implicit(linear_solver, rtol=1e-11, max_steps=1000))
    g_unr = _closed_over_unrolled_reference()
    np.testing.assert_allclose(g_imp, g_unr, rtol=1e-7, atol=1e-10)
    assert np.abs(g_imp).sum() > 0


def test_gradients_under_vmap(x64):
    h, J = _tap_problem(n=8)
    H = jnp.stack([h, 0.5 * h, -h])

    def loss(h):
        return jnp.sum(S.fixed_point(tap_map, jnp.zeros_like(h), (h, J, 0.9),
                                     solver=S.Anderson(tol=1e-12)).value)

    grad = jax.jit(jax.grad(loss))
    g_batched = jax.jit(jax.vmap(jax.grad(loss)))(H)
    for i in range(3):
        np.testing.assert_allclose(g_batched[i], grad(H[i]), rtol=1e-9)


def test_phantom_and_onestep_errors_are_bounded(x64):
    rng = np.random.default_rng(8)
    n, rho = 8, 0.3
    A = jnp.asarray(random_contraction(rng, n, rho))
    b = jnp.asarray(rng.normal(size=n))
    w = jnp.asarray(rng.normal(size=n))

    def loss(b, adjoint):
        return w @ S.fixed_point(linear_map, jnp.zeros(n), (A, b), adjoint=adjoint,
                                 solver=S.Anderson(tol=1e-12)).value

    exact = np.linalg.solve((np.eye(n) - np.asarray(A)).T, np.asarray(w))  # d loss / d b
    rel = lambda g: np.linalg.norm(np.asarray(g) - exact) / np.linalg.norm(exact)
    e1 = rel(jax.grad(loss)(b, S.OneStep()))
    e_ph2 = rel(jax.grad(loss)(b, S.Phantom(steps=2, damping=0.0)))
    e_ph10 = rel(jax.grad(loss)(b, S.Phantom(steps=10, damping=0.0)))
    # Truncating the Neumann series sum_k (A^T)^k w after k terms leaves error <= rho^k/(1-rho)*|w|.
    bound = lambda k: rho**k / (1 - rho) * np.linalg.norm(w) / np.linalg.norm(exact)
    assert 0 < e1 <= bound(1) + 1e-12
    assert e_ph2 <= bound(2) + 1e-12
    assert e_ph10 <= bound(10) + 1e-12
    assert e_ph10 < e_ph2 < e1
    # The forward value is the solved fixed point, not the phantom iterate.
    v = S.fixed_point(linear_map, jnp.zeros(n), (A, b), adjoint=S.Phantom(steps=3),
                      solver=S.Anderson(tol=1e-12)).value
    np.testing.assert_allclose(v, np.linalg.solve(np.eye(n) - A, b), atol=1e-10)


# ----------------------------------------------------------------------------- failures


def test_nonconvergence_raises_with_throw():
    f = jax.jit(lambda x0: S.fixed_point(lambda x, _: x + 1.0, x0, None,
                                         solver=S.Anderson(max_steps=20)).value)
    with pytest.raises(Exception, match="max_steps"):
        jax.block_until_ready(f(jnp.zeros(3)))


def test_nonconvergence_reported_without_throw():
    for solver in (S.Picard(), S.Anderson(), S.Broyden()):
        sol = S.fixed_point(lambda x, _: x + 1.0, jnp.zeros(3), None,
                            solver=tuned(solver, max_steps=20), throw=False)
        assert int(sol.result) == S.RESULTS.max_steps_reached
        assert int(sol.num_steps) == 20
        assert float(sol.residual) >= 0.99


def test_nan_map_reported_as_nonfinite():
    nan_map = lambda x, _: jnp.log(x - 10.0)
    for solver in (S.Picard(), S.Anderson(), S.Anderson(safeguard=False), S.Newton()):
        sol = S.fixed_point(nan_map, jnp.zeros(2), None, solver=solver, throw=False)
        assert int(sol.result) == S.RESULTS.nonfinite, solver
        assert int(sol.num_steps) <= 2
    with pytest.raises(Exception, match="non-finite"):
        jax.block_until_ready(S.fixed_point(nan_map, jnp.zeros(2), None).value)


def test_anderson_safeguard_recovers_from_blowup():
    # The map is undefined (NaN) for x < 0. Unguarded Anderson extrapolates into that region
    # and fails; the safeguard restarts from the best iterate and converges.
    f = lambda x, p: p[0] * jnp.sqrt(x) + p[1] * jnp.cos(p[2] * x) ** 2
    p = jnp.array([0.36156827, 0.3397506, 2.8353972])
    x0 = jnp.full((3,), 1.2898477)
    rule = dict(tol=1e-6, max_steps=200)
    bare = S.fixed_point(f, x0, p, solver=S.Anderson(safeguard=False, **rule), throw=False)
    assert int(bare.result) == S.RESULTS.nonfinite
    sol = S.fixed_point(f, x0, p, solver=S.Anderson(**rule), throw=False)
    assert int(sol.result) == S.RESULTS.successful
    np.testing.assert_allclose(f(sol.value, p), sol.value, atol=1e-6)


def test_failing_backward_solve_raises_or_nans():
    A = 0.99 * jnp.eye(3)  # slow to invert by Neumann iteration
    adj = S.Implicit(linear_solver=S.Picard(), max_steps=3, fallback=None)

    def loss(b, throw):
        return S.fixed_point(linear_map, jnp.zeros(3), (A, b), adjoint=adj,
                             solver=S.Anderson(tol=1e-6, max_steps=5000), throw=throw).value.sum()

    with pytest.raises(Exception, match="backward linear solve"):
        jax.block_until_ready(jax.grad(loss)(jnp.ones(3), True))
    g = jax.grad(loss)(jnp.ones(3), False)
    assert np.all(np.isnan(g))
    # the default fallback (a dense solve at this size) answers where the first solve failed
    rescued = S.Implicit(linear_solver=S.Picard(), max_steps=3)
    g = jax.grad(lambda b: S.fixed_point(linear_map, jnp.zeros(3), (A, b), adjoint=rescued,
                                         solver=S.Anderson(tol=1e-6, max_steps=5000)).value.sum())(
        jnp.ones(3))
    np.testing.assert_allclose(g, 100.0, rtol=1e-3)
    # With enough steps the same solve succeeds: the failure was the solve, not the map.
    ok = S.Implicit(linear_solver=S.Picard(), max_steps=5000, rtol=1e-5)
    g = jax.grad(lambda b: S.fixed_point(linear_map, jnp.zeros(3), (A, b), adjoint=ok,
                                         solver=S.Anderson(max_steps=5000)).value.sum())(jnp.ones(3))
    np.testing.assert_allclose(g, 100.0, rtol=1e-3)


# ----------------------------------------------------------------------------- errors


def test_input_errors_are_clear():
    good = lambda x, _: 0.5 * x
    with pytest.raises(ValueError, match="structure"):
        S.fixed_point(lambda x, _: (x, x), jnp.zeros(2))
    with pytest.raises(ValueError, match="shape"):
        S.fixed_point(lambda x, _: jnp.zeros(3), jnp.zeros(2))
    with pytest.raises(ValueError, match="floating"):
        S.fixed_point(good, jnp.zeros(2, jnp.int32))
    with pytest.raises(ValueError, match="max_steps"):
        S.Anderson(max_steps=0)
    with pytest.raises(ValueError, match="tol"):
        S.Picard(tol=-1.0)
    with pytest.raises(ValueError, match="solver"):
        S.fixed_point(good, jnp.zeros(2), solver="anderson")
    with pytest.raises(ValueError, match="Newton"):
        S.root_find(good, jnp.zeros(2), solver=S.Anderson())
    with pytest.raises(ValueError, match="differentiates fixed points only"):
        S.root_find(good, jnp.zeros(2), adjoint=S.OneStep())
    with pytest.raises(ValueError, match="history"):
        S.Anderson(history=0)
    with pytest.raises(ValueError, match="damping"):
        S.Picard(damping=1.0)
    with pytest.raises(ValueError, match="linear_solver"):
        S.Implicit(linear_solver="gmres")
    with pytest.raises(ValueError, match="norm"):
        S.Anderson(norm="l2")
    with pytest.raises(ValueError, match="damping"):
        S.Phantom(damping=1.0)
    with pytest.raises(ValueError, match="damping"):
        S.Newton(damping=-0.1)
    with pytest.raises(TypeError, match=r"solver=Anderson\(tol=\.\.\.\)"):
        S.fixed_point(good, jnp.zeros(2), tol=1e-3)  # tolerances live on the solver
    with pytest.raises(ValueError, match="has_aux=True"):  # a pair without has_aux
        S.fixed_point(lambda x, _: (0.5 * x, x.sum()), jnp.zeros(2))
    with pytest.raises(ValueError, match="must return a pair"):
        S.fixed_point(good, jnp.zeros(2), has_aux=True)


def test_other_libraries_spellings_point_to_ours():
    """A call in optimistix's, jaxopt's or banax's spelling says what spinformer calls it
    and where the guide compares them; a good call is unchanged."""
    good = lambda x, _: 0.5 * x
    guide = "Coming from optimistix, jaxopt or banax"
    with pytest.raises(TypeError, match="the solver is a keyword") as e:
        S.fixed_point(good, S.Anderson(), jnp.zeros(2), None)  # optx.fixed_point(fn, solver, y0, args)
    assert guide in str(e.value)
    with pytest.raises(ValueError, match="x0 is Anderson"):
        S.fixed_point(good, S.Anderson(), jnp.zeros(2))
    with pytest.raises(TypeError, match=r"Anderson\(max_steps=\.\.\.\)") as e:
        S.fixed_point(good, jnp.zeros(2), max_steps=10)
    assert guide in str(e.value)
    with pytest.raises(TypeError, match=r"Implicit\(rtol=\.\.\.\)"):
        S.root_find(good, jnp.zeros(2), rtol=1e-3, atol=1e-6)
    with pytest.raises(TypeError, match="x0"):
        S.fixed_point(good, y0=jnp.zeros(2))
    with pytest.raises(TypeError, match="the solver is a keyword"):
        S.root_find(good, S.Newton(), jnp.zeros(2), None)
    # a TypeError raised inside fn is the user's own, untouched
    def bad(x, _):
        raise TypeError("mine")
    with pytest.raises(ValueError, match="mine"):
        S.fixed_point(bad, jnp.zeros(2))
    assert float(S.fixed_point(good, jnp.ones(2)).residual) <= 1e-5


def test_has_aux_is_the_map_at_the_solution_with_its_gradient(x64):
    """`has_aux=True`: the solve iterates the first output, `Solution.aux` is the second at
    the solution, and its gradient matches central finite differences (through the implicit
    adjoint and the direct dependence on the arguments alike)."""
    rng = np.random.default_rng(3)
    W0 = jnp.asarray(0.4 * rng.normal(size=(5, 5)) / np.sqrt(5))
    b = jnp.asarray(rng.normal(size=5))

    def layer(x, W):
        pre = W @ x + b
        return jnp.tanh(pre), {"energy": jnp.sum(pre ** 2) + jnp.sum(W)}

    def aux_loss(W):
        sol = S.fixed_point(layer, jnp.zeros(5), W, solver=S.Anderson(tol=1e-13),
                            adjoint=S.Implicit(rtol=1e-13), has_aux=True)
        return sol.aux["energy"]

    sol = S.fixed_point(layer, jnp.zeros(5), W0, solver=S.Anderson(tol=1e-13), has_aux=True)
    x = np.tanh(np.asarray(W0) @ np.asarray(sol.value) + np.asarray(b))
    np.testing.assert_allclose(sol.value, x, atol=1e-12)  # the first output's fixed point
    pre = np.asarray(W0) @ np.asarray(sol.value) + np.asarray(b)
    np.testing.assert_allclose(sol.aux["energy"], np.sum(pre ** 2) + np.sum(W0), rtol=1e-12)
    g = jax.grad(aux_loss)(W0)
    eps, fd = 1e-6, np.zeros((5, 5))
    for i in range(5):
        for j in range(5):
            d = jnp.zeros((5, 5)).at[i, j].set(eps)
            fd[i, j] = (aux_loss(W0 + d) - aux_loss(W0 - d)) / (2 * eps)
    np.testing.assert_allclose(g, fd, rtol=1e-6, atol=1e-8)
    # the same function again does not trace the solve again: `layer` is called only to
    # check its output's shapes and to evaluate the auxiliary output
    calls = []
    counted = lambda x, W: (calls.append(1), layer(x, W))[1]
    for expected in (None, 2):
        calls.clear()
        S.fixed_point(counted, jnp.zeros(5), W0, solver=S.Anderson(tol=1e-13), has_aux=True)
        assert expected is None or len(calls) == expected, len(calls)


# ----------------------------------------------------------------------------- jaxopt parity


def test_parity_with_jaxopt_anderson(x64):
    h, J = _tap_problem(n=16, seed=9)
    args = (h, J, 0.9)
    x0 = jnp.zeros_like(h)
    ref = jax.jit(lambda a: jaxopt.AndersonAcceleration(
        tap_map, history_size=5, tol=1e-12, maxiter=500).run(x0, a))(args)
    ours = jax.jit(lambda a: S.fixed_point(tap_map, x0, a,
                                           solver=S.Anderson(tol=1e-12, max_steps=500)))(args)
    jx = JaxoptAnderson(tol=1e-12, max_steps=500, norm=S.l2_norm)
    wrapped = jax.jit(lambda a: S.fixed_point(tap_map, x0, a, solver=jx))(args)
    np.testing.assert_allclose(ours.value, ref.params, atol=1e-10)
    # The wrapper runs jaxopt's own updates: same iterates, same number of steps.
    np.testing.assert_allclose(wrapped.value, ref.params, atol=1e-14)
    assert int(wrapped.num_steps) == int(ref.state.iter_num)

    def loss_ours(h):
        sol = S.fixed_point(tap_map, jnp.zeros_like(h), (h, J, 0.9),
                            solver=S.Anderson(tol=1e-12, max_steps=500),
                            adjoint=S.Implicit(rtol=1e-11))
        return jnp.sum(jnp.cos(sol.value))

    def loss_jaxopt(h):
        solver = jaxopt.AndersonAcceleration(tap_map, history_size=5, tol=1e-12, maxiter=500)
        return jnp.sum(jnp.cos(solver.run(jnp.zeros_like(h), (h, J, 0.9)).params))

    np.testing.assert_allclose(jax.jit(jax.grad(loss_ours))(h), jax.jit(jax.grad(loss_jaxopt))(h),
                               rtol=1e-7)


# ----------------------------------------------------------------------------- penalty


def test_jacobian_penalty_estimates_frobenius_norm(getkey, x64):
    rng = np.random.default_rng(10)
    A = jnp.asarray(rng.normal(size=(6, 6)))
    x = jnp.asarray(rng.normal(size=6))
    fn = lambda x, a: jnp.tanh(a @ x)
    Jac = jax.jacobian(fn)(x, A)
    exact = float(jnp.sum(Jac**2))
    est = S.jacobian_penalty(fn, x, A, key=getkey(), num_samples=20000)
    assert abs(float(est) - exact) / exact < 0.05
    single = S.jacobian_penalty(fn, x, A, key=getkey())
    assert single.shape == () and float(single) > 0
    # Differentiable with respect to the map's parameters.
    g = jax.grad(lambda a: S.jacobian_penalty(fn, x, a, key=jax.random.key(0)))(A)
    assert np.all(np.isfinite(g)) and np.abs(g).sum() > 0


@pytest.mark.parametrize("adjoint", [S.Implicit(), S.Unrolled(), S.Phantom(), S.OneStep()],
                         ids=ids)
def test_forward_failure_is_not_lost_under_jit_grad(adjoint):
    # Only the gradient is used, so a check on the forward value alone would be dead code.
    grad = jax.jit(jax.grad(lambda a: S.fixed_point(lambda x, a: x + a, jnp.zeros(2), a,
                                                    adjoint=adjoint,
                                                    solver=S.Anderson(max_steps=5)).value.sum()))
    with pytest.raises(Exception, match="max_steps"):
        jax.block_until_ready(grad(jnp.ones(2)))


def test_spectral_radius_tells_stable_from_unstable_fixed_points(getkey, x64):
    rng = np.random.default_rng(11)
    Q = np.linalg.qr(rng.normal(size=(5, 5)))[0]
    for eigs in ([0.5, -0.9, 0.1, 0.3, 0.2], [1.5, 0.2, -0.1, 0.0, 0.4]):
        A = jnp.asarray(Q @ np.diag(eigs) @ Q.T)
        rho = S.spectral_radius(linear_map, jnp.zeros(5), (A, jnp.zeros(5)), key=getkey(),
                                steps=300)
        np.testing.assert_allclose(rho, max(abs(e) for e in eigs), rtol=0.02)
    # A rotation-scaling (complex eigenvalues 0.8 e^{±iπ/3}) is handled by Gelfand's formula.
    c, s_ = np.cos(np.pi / 3), np.sin(np.pi / 3)
    R = jnp.asarray(0.8 * np.array([[c, -s_], [s_, c]]))
    rho = S.spectral_radius(linear_map, jnp.zeros(2), (R, jnp.zeros(2)), key=getkey(), steps=200)
    np.testing.assert_allclose(rho, 0.8, rtol=1e-6)
    # The mean-field Ising map m = tanh(β J m) at β J = 2 has an unstable fixed point at 0.
    mf = lambda m, _: jnp.tanh(2.0 * jnp.mean(m) * jnp.ones(3))
    assert float(S.spectral_radius(mf, jnp.zeros(3), None, key=getkey())) > 1.9
    m_star = S.fixed_point(mf, jnp.full(3, 0.5), None, solver=S.Picard(tol=1e-12)).value
    assert float(S.spectral_radius(mf, m_star, None, key=getkey())) < 1.0


# ----------------------------------------------------------------------------- the typed API


@pytest.mark.parametrize("adjoint", [S.Implicit(), S.Unrolled(), S.Phantom(steps=30, damping=0.0),
                                     S.OneStep()], ids=ids)
def test_python_scalar_args_are_differentiable(adjoint):
    # `args` may hold Python floats: differentiating turns them into tracers, which the
    # closure-converted map must accept (it used to raise "different dynamic arguments").
    fn = lambda x, a: jnp.tanh(0.5 * x + a)
    # Picard: what is tested is the arguments' path, the same for every solver, and Picard's
    # loop compiles fastest (Unrolled, checkpointed: 2 s against Anderson's 8 s per program)
    solver = S.Picard(tol=1e-6, max_steps=60)
    solve = lambda a: S.fixed_point(fn, jnp.zeros(3), a, solver=solver,
                                    adjoint=adjoint).value.sum()
    # jitted: op by op, the loops' pieces compile one by one (Unrolled: 12 s eagerly, 7.6 s jitted)
    g = jax.jit(jax.grad(solve))(1.0)
    m = float(S.fixed_point(fn, jnp.zeros(3), 1.0).value[0])
    exact = 3 * (1 - m**2) / (1 - 0.5 * (1 - m**2))  # implicit function theorem, per entry
    tol = 0.15 if isinstance(adjoint, S.OneStep) else 1e-4
    np.testing.assert_allclose(g, exact, rtol=tol)
    if not isinstance(adjoint, (S.Implicit, S.Unrolled)):  # forward mode, without throw
        jf = jax.jit(jax.jacfwd(lambda a: S.fixed_point(fn, jnp.zeros(3), a, solver=solver,
                                                adjoint=adjoint,
                                                throw=False).value.sum()))(1.0)
        np.testing.assert_allclose(jf, g, rtol=1e-5)
    # a pytree of arrays and scalars, with an int that must stay a Python int (a shape)
    fn2 = lambda x, a: jnp.tanh(a["w"] * x + jnp.ones(a["n"]))
    g2 = jax.jit(jax.grad(lambda w: S.fixed_point(fn2, jnp.zeros(3), {"w": w, "n": 3},
                                                  solver=solver, adjoint=adjoint
                                                  ).value.sum()))(0.5)
    # at w = 0.5 the fixed point is the one above; ∂x/∂w = x (1 − x²) / (1 − w (1 − x²))
    np.testing.assert_allclose(g2, 3 * m * (1 - m**2) / (1 - 0.5 * (1 - m**2)), rtol=tol)


def test_loop_carries_are_batched_from_the_start_and_unchanged():
    """`batched_like` (the solvers' initial loop carries): the same values and dtypes, no
    NaN or inf let in from the reference, no gradient through the tie, and under `vmap` a
    batched result (so `while_loop`'s batching rule needs one pass over the body), where
    an untied constant stays unbatched."""
    from spinformer.solvers._solvers import batched_like

    tree = (jnp.zeros(3), jnp.asarray(2, jnp.int32), jnp.asarray([True, False]))
    for ref in (jnp.ones(4), jnp.asarray([jnp.nan, 1.0]), jnp.asarray(jnp.inf)):
        out = batched_like(tree, ref)
        for a, b in zip(out, tree):
            assert a.dtype == b.dtype
            np.testing.assert_array_equal(a, b)
    refs = jnp.arange(6.0).reshape(3, 2)
    with pytest.raises(ValueError):  # batched: it cannot be returned unmapped
        jax.vmap(lambda r: batched_like(tree, r), out_axes=None)(refs)
    jax.vmap(lambda r: tree, out_axes=None)(refs)  # the untied tree is not batched
    # nested vmap: batched at both levels
    outs = jax.vmap(jax.vmap(lambda r: batched_like(tree, r)))(jnp.ones((2, 3, 4)))
    assert outs[0].shape == (2, 3, 3) and outs[2].shape == (2, 3, 2)
    # no gradient reaches the reference; the tree's own gradient is the identity
    g_ref = jax.grad(lambda r: batched_like(jnp.ones(3), r).sum())(jnp.ones(2))
    np.testing.assert_array_equal(g_ref, 0.0)
    g_x = jax.grad(lambda x: (batched_like(x, jnp.ones(2)) ** 2).sum())(jnp.arange(3.0))
    np.testing.assert_array_equal(g_x, 2 * jnp.arange(3.0))


def test_unrolled_stops_when_converged():
    # Under vmap a scan over max_steps would evaluate the map max_steps times; the
    # checkpointed while loop stops with the slowest example (recomputing some steps).
    calls = []

    def fn(x, a):
        jax.debug.callback(lambda: calls.append(1))
        return 0.5 * jnp.cos(x) + a

    def loss(a):
        return jax.vmap(lambda ai: S.fixed_point(fn, jnp.zeros(()), ai, adjoint=S.Unrolled(),
                                                 solver=S.Picard(tol=1e-6, max_steps=2000))
                        .value)(a).sum()

    a = jnp.array([0.1, 0.3])
    g = jax.jit(jax.grad(loss))(a)
    steps = int(jnp.max(jax.vmap(lambda ai: S.fixed_point(
        fn, jnp.zeros(()), ai, solver=S.Picard(tol=1e-6, max_steps=2000)).num_steps)(a)))
    calls.clear()
    g = jax.block_until_ready(jax.jit(jax.grad(loss))(a))
    # per example: forward steps plus the backward's recomputation, far below max_steps
    assert steps < 40 and 0 < len(calls) <= 2 * 8 * (steps + 2), (steps, len(calls))
    x = S.fixed_point(lambda x, a: 0.5 * jnp.cos(x) + a, jnp.zeros(2), a,
                      solver=S.Picard(tol=1e-7)).value
    np.testing.assert_allclose(g, 1.0 / (1.0 + 0.5 * jnp.sin(x)), rtol=1e-4)


@pytest.mark.parametrize(
    "solver", [S.Picard(max_steps=6), S.Anderson(history=1, max_steps=6, safeguard=False)],
    ids=ids,
)
def test_best_iterate_is_returned_for_every_solver(solver):
    # x -> 2x + 1 diverges from x0 = 0, so the starting point is the best iterate seen.
    sol = S.fixed_point(lambda x, _: 2.0 * x + 1.0, jnp.zeros(2), None, solver=solver,
                        throw=False)
    assert int(sol.result) == S.RESULTS.max_steps_reached
    np.testing.assert_allclose(sol.residual, 1.0)
    np.testing.assert_allclose(sol.value, 0.0)
    assert float(sol.final_residual) > 1.0


def test_best_iterate_of_a_diverging_root_finder():
    # Newton on arctan overshoots further at every step from |x0| > 1.39.
    sol = S.root_find(lambda x, _: jnp.arctan(x), jnp.full(2, 2.0), None,
                      solver=S.Newton(max_steps=5), throw=False)
    assert int(sol.result) != S.RESULTS.successful
    np.testing.assert_allclose(sol.value, 2.0)
    np.testing.assert_allclose(sol.residual, np.arctan(2.0), rtol=1e-6)
    assert float(sol.final_residual) > float(sol.residual)


def test_result_codes_defined_once():
    codes = [S.RESULTS.successful, S.RESULTS.max_steps_reached, S.RESULTS.nonfinite]
    assert codes == [0, 1, 2]
    assert [S.RESULTS.name(c) for c in codes] == ["successful", "max_steps_reached", "nonfinite"]
    assert S.RESULTS.message(S.RESULTS.successful) == ""
    assert "max_steps" in S.RESULTS.message(S.RESULTS.max_steps_reached)
    assert "throw=False" in S.RESULTS.message(S.RESULTS.nonfinite)
    with pytest.raises(ValueError, match="unknown result code"):
        S.RESULTS.name(7)


def test_root_finders_solve_fixed_points_and_not_the_reverse():
    fn = lambda x, _: 0.5 * jnp.cos(x)
    for solver in (S.Newton(tol=1e-6), S.Broyden(tol=1e-6)):
        assert isinstance(solver, S.AbstractRootFinder)
        sol = S.fixed_point(fn, jnp.zeros(2), None, solver=solver)
        np.testing.assert_allclose(sol.value, 0.5 * np.cos(sol.value), atol=1e-6)
    for solver in (S.Picard(), S.Anderson(), JaxoptAnderson()):
        assert isinstance(solver, S.AbstractFixedPointSolver)
        with pytest.raises(ValueError, match="Newton"):
            S.root_find(fn, jnp.zeros(2), solver=solver)


def test_norm_is_a_callable_on_the_solver():
    fn = lambda x, _: 0.5 * x + 1.0
    x0 = jnp.zeros(4)
    inf = S.fixed_point(fn, x0, None, solver=S.Picard(tol=1e-3))
    l2 = S.fixed_point(fn, x0, None, solver=S.Picard(tol=1e-3, norm=S.l2_norm))
    one = S.fixed_point(fn, x0, None, solver=S.Picard(tol=1e-3, norm=lambda v: jnp.sum(abs(v))))
    # residual 2^-k in every entry: the l2 norm is twice the ∞-norm, the 1-norm four times
    assert int(inf.num_steps) < int(l2.num_steps) < int(one.num_steps)
    np.testing.assert_allclose(one.residual, 4 * float(jnp.max(jnp.abs(fn(one.value, None)
                                                                        - one.value))), rtol=1e-5)


class _AtLeast(S.AbstractFixedPointSolver):
    """Picard that converges only once it has taken `min_steps` steps: a stopping rule of
    its own."""

    min_steps: int = eqx.field(default=0, static=True)
    tol: float = 1e-5
    max_steps: int = eqx.field(default=100, static=True)
    norm: Callable = eqx.field(default=S.max_norm, static=True)

    def init(self, prob, x, args):
        r = prob.residual(x, args)
        return x, r, self.norm(r), jnp.zeros((), jnp.int32)

    def step(self, prob, state, args):
        x = state[0] + state[1]
        r = prob.residual(x, args)
        return x, r, self.norm(r), state[3] + 1

    def terminate(self, state):
        done = (state[2] <= self.tol) & (state[3] >= self.min_steps)
        return done, jnp.asarray(S.RESULTS.successful, jnp.int32)

    def output(self, state):
        return state[0], state[2]


def test_the_solver_alone_decides_convergence():
    """The driver reports what the solver's `terminate` says: a residual below `tol` is not
    success for a solver whose rule asks for more."""
    fn = lambda x, b: 0.1 * x + b  # noqa: E731
    sol = S.fixed_point(fn, jnp.zeros(3), jnp.ones(3), solver=_AtLeast(min_steps=12),
                        throw=False)
    assert int(sol.num_steps) == 12 and sol.result == S.RESULTS.successful
    strict = _AtLeast(min_steps=30, max_steps=20)
    sol = S.fixed_point(fn, jnp.zeros(3), jnp.ones(3), solver=strict, throw=False)
    assert float(sol.residual) <= 1e-5 and int(sol.num_steps) == 20
    assert sol.result == S.RESULTS.max_steps_reached


def test_verbose_prints_worst_residual_and_converged_count(capfd):
    fn = lambda x, a: jnp.tanh(0.5 * x + a)
    jax.vmap(lambda a: S.fixed_point(fn, jnp.zeros(3), a, verbose=True))(jnp.array([0.1, 3.0]))
    err = capfd.readouterr().err
    lines = [l for l in err.splitlines() if l.startswith("fixed_point: step")]
    assert lines and "worst residual" in lines[0] and lines[-1].endswith("converged 2/2")
    S.fixed_point(fn, jnp.zeros(3), 0.1)  # off by default: prints nothing
    assert "step" not in capfd.readouterr().err


def test_eager_calls_do_not_recompile():
    import jax.monitoring

    # jax.monitoring has no public way to unregister a listener in every jax the bounds allow
    # (unregister_event_duration_listener is newer than jax 0.8.0): the listener is switched
    # off instead, and stays registered as a no-op.
    events, active = [], [True]

    def listener(name, *a, **k):
        if active[0] and "backend_compile" in name:
            events.append(name)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        fn = lambda x, a: jnp.tanh(0.3 * x + a)
        x0, a1, a2 = jnp.zeros(5), jnp.ones(5), jnp.ones(5) + 1.0
        x6, a6 = jnp.zeros(6), jnp.ones(6)
        S.fixed_point(fn, x0, a1)
        events.clear()
        S.fixed_point(fn, x0, a2)  # same function, new values: no compilation
        assert events == []
        S.fixed_point(fn, x6, a6)  # new shapes compile (the listener works)
        assert events
    finally:
        active[0] = False


def test_backward_solves_are_recorded_per_solve(x64):
    class Layer(eqx.Module):
        W: jax.Array
        adjoint: S.AbstractAdjoint

        def __call__(self, b):
            fn = lambda x, a: jnp.tanh(self.W @ x + a)
            return S.fixed_point(fn, jnp.zeros(3), b, adjoint=self.adjoint,
                                 solver=S.Picard(tol=1e-10, max_steps=300)).value

    W = 0.3 * jnp.asarray(np.random.default_rng(13).normal(size=(3, 3)))
    B = jnp.ones((4, 3))
    loss = lambda m: jax.vmap(m)(B).sum()
    grad = eqx.filter_jit(eqx.filter_grad(loss))  # with the Picard forward: 9.6 -> 5.9 s
    plain = grad(Layer(W, S.Implicit(rtol=1e-8)))
    for lin in (S.Anderson(history=5, safeguard=False), S.GMRES(5), S.BiCGStab()):
        layer = Layer(W, S.record_backward(S.Implicit(linear_solver=lin, rtol=1e-8)))
        grads, records = S.backward_stats(grad(layer))
        (rec,) = records
        assert float(rec[0]) == 4.0  # one backward solve per example
        if isinstance(lin, S.BiCGStab):  # jax's BiCGSTAB does not report its iterations
            assert float(rec[1]) == -4.0
        else:
            assert 4 * 2 <= float(rec[1]) <= 4 * 200
        if isinstance(lin, S.GMRES):  # restart = min(5, n) = 3: 1 + 4 per cycle, per solve
            assert (float(rec[1]) - 4.0) % 4 == 0
        assert 0.0 <= float(rec[2]) <= 4 * 1e-7
        np.testing.assert_array_equal(grads.adjoint.probe, 0.0)  # the optimizer sees zeros
        np.testing.assert_allclose(grads.W, plain.W, rtol=1e-6)
    # other adjoints have no backward solve and carry no probe
    assert S.record_backward(S.Unrolled()) == S.Unrolled()


def test_a_module_keeps_its_adjoint_and_the_reader_records():
    """A module holds the adjoint it is given; the caller that reads the backward solves
    records the constructor's arguments (as `train.build_model` does), and layers stacked
    with `eqx.filter_vmap` then get one probe per layer."""
    from spinformer import nn

    a = S.Implicit(linear_solver=S.GMRES(restart=5), rtol=1e-3)
    assert nn.SpinAttention(8, 2, adjoint=a, key=jax.random.key(0)).adjoint is a
    kwargs = S.record_backward({"adjoint": a, "solver": S.Anderson(), "beta": 2.0})
    assert a.probe is None and kwargs["adjoint"].probe.shape == (4,)
    assert kwargs["solver"] == S.Anderson() and kwargs["beta"] == 2.0
    assert S.record_backward(kwargs)["adjoint"] is kwargs["adjoint"]  # recorded once
    layers = eqx.filter_vmap(lambda k: nn.SpinAttention(8, 2, key=k, **kwargs))(
        jax.random.split(jax.random.key(0), 3))
    assert layers.adjoint.probe.shape == (3, 4)


@pytest.mark.parametrize("restart", [1, 3, 8])
def test_gmres_reports_the_products_it_makes(restart):
    """GMRES's product count is every product it makes (counted as they run, under jit):
    the first residual, then per cycle its basis and the check; its answer meets the
    tolerance. A cycle stops its basis where the tolerance is met: on I + a rank-2 matrix
    the Krylov space holds the answer after 3 products, whatever `restart` allows. The
    product is traced twice (the residual check and the Arnoldi step), so the compiled
    solve holds two copies of it, not three."""
    rng = np.random.default_rng(5)
    low_rank = rng.normal(size=(12, 2)) @ rng.normal(size=(2, 12)) * 0.3
    cases = [(np.eye(12) + 0.3 * rng.normal(size=(12, 12)), None)]
    if restart >= 3:  # (restarted GMRES(1) stagnates on it)
        cases.append((np.eye(12) + low_rank, 1 + 3 + 1))
    for A, most in cases:
        A = jnp.asarray(A, jnp.float32)
        b = jnp.asarray(rng.normal(size=12), jnp.float32)
        calls, traced = [], []

        def matvec(v):
            traced.append(1)
            jax.debug.callback(lambda: calls.append(1))
            return A @ v

        w, products, resid = jax.jit(lambda b: S.GMRES(restart).solve_with_residual(
            matvec, b, rtol=1e-5, max_steps=60))(b)
        jax.effects_barrier()
        assert int(products) == len(calls)
        assert len(traced) == 2
        if most is not None:
            assert int(products) <= most, int(products)
        np.testing.assert_allclose(float(resid), float(jnp.linalg.norm(b - A @ w)), rtol=1e-3)
        assert float(resid) <= 1e-5 * float(jnp.linalg.norm(b))


def test_backward_error_if_raises_only_in_the_backward_pass():
    msgs = ["", "first failure", "second failure"]

    def loss(x, bad, code, nonfinite=False):
        y = S.backward_error_if(x, bad, code, msgs, nonfinite=nonfinite)
        return jnp.sum(jnp.log(y))  # gradient 1/x

    x = jnp.array([1.0, 2.0])
    grad = jax.jit(jax.grad(loss), static_argnums=3)
    np.testing.assert_allclose(grad(x, False, 0), 1 / x)
    np.testing.assert_allclose(loss(x, True, 2), np.log(2.0))  # the forward pass never raises
    with pytest.raises(Exception, match="second failure"):
        grad(x, jnp.asarray(True), jnp.asarray(2)).block_until_ready()
    # nonfinite: an inf arriving in the cotangent (d sqrt(x - 1) at x = 1) raises messages[index]
    nan_grad = jax.jit(jax.grad(lambda x: jnp.sum(jnp.sqrt(
        S.backward_error_if(x, False, 1, msgs, nonfinite=True) - 1.0))))
    with pytest.raises(Exception, match="first failure"):
        nan_grad(x).block_until_ready()
    np.testing.assert_allclose(grad(x, False, 1, True), 1 / x)


def test_import_needs_no_jaxopt():
    """jaxopt (unmaintained upstream) is only the reference of the tests and benchmarks: the
    library imports and solves without it."""
    import os
    import subprocess
    import sys

    code = ("import sys; sys.modules['jaxopt'] = None\n"
            "import jax.numpy as jnp, spinformer as sf\n"
            "import spinformer.nn, spinformer.train\n"
            "sol = sf.solvers.fixed_point(lambda x, a: jnp.tanh(0.5 * x + 1), jnp.ones(2))\n"
            "assert sol.result == sf.solvers.RESULTS.successful\n"
            "assert not hasattr(sf.solvers, 'JaxoptAnderson')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert out.returncode == 0, out.stderr[-2000:]

def test_python_number_initial_guess():
    """`root_find(fn, 0.0)`: a Python or NumPy number as x0 is an array like any other."""
    np.testing.assert_allclose(S.root_find(lambda y, _: y - 3.0, 0.0).value, 3.0, atol=1e-5)
    sol = S.fixed_point(lambda y, _: 0.5 * y + 1.0, np.float32(0.0),
                        solver=S.Picard(tol=1e-7, max_steps=100))
    np.testing.assert_allclose(sol.value, 2.0, atol=1e-6)
    assert isinstance(sol.value, jax.Array)


def test_spin_functions_compute_in_float64_under_x64_from_python_numbers(x64):
    """Inputs that are all Python numbers take the default float (float64 under x64); arrays
    keep their dtype (a float32 array with a Python number stays float32)."""
    from spinformer.spins import vector
    from spinformer.spins._common import as_float

    assert vector.bessel_ratio(255.0, 2550.0).dtype == jnp.float64
    assert [a.dtype for a in as_float(1.0, 2)] == [jnp.float64] * 2
    assert [a.dtype for a in as_float(jnp.ones(2, jnp.float32), 2.0)] == [jnp.float32] * 2
    assert as_float(jnp.ones(2, jnp.bfloat16))[0].dtype == jnp.float32  # at least float32


def test_root_find_default_adjoint_solves_a_root_richardson_cannot(x64):
    """A well-posed 100-dimensional root whose Jacobian has eigenvalues with negative real
    parts (cond ~ 280): the Richardson iteration (`Implicit()`'s Anderson without a fallback,
    the old default) gives NaN gradients; `root_find`'s default (Auto: dense here) and every
    `Implicit` with its default fallback give the gradient of a dense solve."""
    n = 100
    A = jax.random.normal(jax.random.key(0), (n, n)) / np.sqrt(n) + 0.3 * jnp.eye(n)
    assert np.linalg.eigvals(np.asarray(A)).real.min() < 0
    theta = jax.random.normal(jax.random.key(1), (n,))

    def F(x, th):
        return A @ x + 0.1 * jnp.tanh(x) - th

    def loss(th, **kw):
        return jnp.sum(S.root_find(F, jnp.zeros(n), th, solver=S.Newton(tol=1e-12),
                                   throw=False, **kw).value ** 2)

    x = S.root_find(F, jnp.zeros(n), theta, solver=S.Newton(tol=1e-12)).value
    jac = np.asarray(A + jnp.diag(0.1 * (1 - jnp.tanh(x) ** 2)))
    want = np.linalg.solve(jac.T, 2 * np.asarray(x))  # d(Σx²)/dθ = J⁻ᵀ 2x
    np.testing.assert_allclose(jax.grad(loss)(theta), want, rtol=1e-8)
    np.testing.assert_allclose(jax.grad(loss)(theta, adjoint=S.Implicit()), want, rtol=1e-8)
    old = jax.grad(loss)(theta, adjoint=S.Implicit(fallback=None))
    assert not np.all(np.isfinite(old))


def test_fallback_runs_for_the_failing_systems_of_a_batch():
    """Under vmap the fallback answers for the systems whose first solve failed and leaves
    the others' answers as they were; the records count one fallback per failed system."""
    a = jnp.asarray([1e-3, 0.99, 1e-3, 0.99, 0.99])  # x = a x + b: 3 Picard steps suffice for
    adj = S.record_backward(S.Implicit(linear_solver=S.Picard(), max_steps=3))  # a = 1e-3 only

    def loss(probe, b, batched=jax.vmap):
        adjoint = eqx.tree_at(lambda t: t.probe, adj, probe)

        def one(ai, bi):
            return S.fixed_point(lambda x, p: p[0] * x + p[1], jnp.zeros(()), (ai, bi),
                                 solver=S.Anderson(tol=1e-7, max_steps=100),
                                 adjoint=adjoint).value

        return jnp.sum(batched(one)(a, b))

    record, g = jax.grad(loss, argnums=(0, 1))(adj.probe, jnp.ones(5))
    np.testing.assert_allclose(g, 1.0 / (1.0 - a), rtol=1e-4)  # dx/db = 1 / (1 - a)
    assert record[0] == 5 and record[3] == 3  # the three systems with a = 0.99

    # nested vmap (layers x batch): the same answers, one fallback per failed system
    def nested(probe, b):
        return loss(probe, b, lambda one: lambda a, b: jax.vmap(jax.vmap(one, (None, 0)),
                                                                 (0, None))(a[:2], b))

    record, g = jax.jit(jax.grad(nested, argnums=(0, 1)))(adj.probe, jnp.ones(3))
    np.testing.assert_allclose(g, np.full(3, 1.0 / (1.0 - a[0]) + 1.0 / (1.0 - a[1])),
                               rtol=1e-4)
    assert record[0] == 6 and record[3] == 3


def test_an_unused_fallback_reserves_no_batch_sized_memory():
    """A dense fallback that a batch does not need adds nothing to the compiled backward
    pass's buffers (it solves failed systems one at a time). A loop that ran at most once
    reserved a (batch, n, n) matrix at every call: 2x the temporary memory here, and 40 %
    more time on a batch-64, n = 256 layer."""
    rng = np.random.default_rng(0)
    n, batch = 96, 32
    W = jnp.asarray(random_contraction(rng, n, 0.5), jnp.float32)
    X = jnp.asarray(rng.normal(size=(batch, n)), jnp.float32)

    def temp_bytes(fallback):
        def loss(W):
            def one(x):
                return S.fixed_point(lambda z, a: jnp.tanh(a[0] @ z + a[1]), jnp.zeros(n),
                                     (W, x), adjoint=S.Implicit(fallback=fallback)).value

            return jnp.sum(jax.vmap(one)(X))

        return jax.jit(jax.grad(loss)).lower(W).compile().memory_analysis().temp_size_in_bytes

    without, dense = temp_bytes(None), temp_bytes(S.Dense())
    assert dense <= 1.1 * without + 4 * n * n * 8, (without, dense)  # one system's matrix


def test_auto_is_dense_for_small_systems_and_gmres_for_large():
    assert isinstance(S.Auto().choose(512), S.Dense)
    assert isinstance(S.Auto(dense_max=4).choose(5), S.GMRES)
    from spinformer.solvers._linear import linear_solve

    M = jax.random.normal(jax.random.key(0), (40, 40)) / np.sqrt(40)
    A = M @ M.T + jnp.eye(40)
    b = jnp.arange(40.0)
    for solver in (S.Auto(), S.Auto(dense_max=4, restart=10)):
        w, ok, steps, rel = linear_solve(solver, lambda v: A @ v, b, rtol=1e-5, max_steps=20)
        assert bool(ok) and float(rel) < 1e-4
        np.testing.assert_allclose(A @ w, b, rtol=1e-3, atol=1e-3)


def test_limited_memory_broyden_is_dense_broyden_until_its_history_fills(x64):
    """H = H0 + Σ u_i v_iᵀ is the dense estimate exactly while every update is kept (same
    iterates); with a short history (restarts from H0) it still converges, on a fixed point
    and on a root."""
    n = 40
    rng = np.random.default_rng(3)
    W = jnp.asarray(random_contraction(rng, n, 0.8))
    b = jnp.asarray(rng.normal(size=n))
    fn = lambda x, a: jnp.tanh(a[0] @ x + a[1])
    runs = {m: S.fixed_point(fn, jnp.zeros(n), (W, b), solver=S.Broyden(history=m, tol=1e-10,
                                                                          max_steps=60))
            for m in (None, 60, 4)}
    assert int(runs[None].num_steps) == int(runs[60].num_steps)
    np.testing.assert_allclose(runs[60].value, runs[None].value, atol=1e-12)
    assert bool(runs[4].result == S.RESULTS.successful)
    np.testing.assert_allclose(runs[4].value, runs[None].value, atol=1e-9)
    # a root whose Jacobian is far from -I: H0 is the LU-factored inverse Jacobian at x0
    A = jnp.asarray(rng.normal(size=(n, n))) / np.sqrt(n) + 2.0 * jnp.eye(n)
    F = lambda x, t: A @ x + 0.3 * jnp.sin(x) - t
    sol = S.root_find(F, jnp.zeros(n), b, solver=S.Broyden(history=3, tol=1e-10))
    assert float(jnp.max(jnp.abs(F(sol.value, b)))) < 1e-9
    with pytest.raises(ValueError, match="history"):
        S.Broyden(history=0)


def test_step_budget_is_a_run_time_value():
    """`step_budget` caps the iterations without recompiling (the solver's static `max_steps`
    stays the ceiling); a capped solve says so in its result; it is traceable under jit and
    vmap, and the unrolled adjoint differentiates the capped iterations."""
    fn = lambda x, b: 0.6 * jnp.cos(x) + b
    solver = S.Picard(tol=1e-7, max_steps=300)
    full = S.fixed_point(fn, jnp.zeros(3), jnp.ones(3), solver=solver)
    assert int(full.num_steps) > 20

    traces = []

    @jax.jit
    def capped(budget):
        traces.append(1)
        return S.fixed_point(fn, jnp.zeros(3), jnp.ones(3), solver=solver, throw=False,
                             step_budget=budget)

    for budget, want in ((5, 5), (12, 12), (10_000, int(full.num_steps))):
        sol = capped(jnp.asarray(budget))
        assert int(sol.num_steps) == want
    assert len(traces) == 1  # one compilation for every budget
    assert int(capped(jnp.asarray(5)).result) == int(S.RESULTS.max_steps_reached)
    assert int(capped(jnp.asarray(10_000)).result) == int(S.RESULTS.successful)
    per = jax.vmap(lambda n: S.fixed_point(fn, jnp.zeros(3), jnp.ones(3), solver=solver,
                                           throw=False, step_budget=n).num_steps)(
        jnp.asarray([2, 7]))
    np.testing.assert_array_equal(per, [2, 7])
    # the unrolled adjoint differentiates exactly the iterations taken: x_3 of x <- 0.5 x + b
    g = jax.grad(lambda b: S.fixed_point(lambda x, b: 0.5 * x + b, jnp.zeros(()), b,
                                         solver=S.Picard(tol=1e-12, max_steps=50),
                                         adjoint=S.Unrolled(), throw=False,
                                         step_budget=3).value)(1.0)
    np.testing.assert_allclose(g, 1 + 0.5 + 0.25)
    with pytest.raises(ValueError, match="step_budget"):
        S.fixed_point(fn, jnp.zeros(3), jnp.ones(3), step_budget=2.5)
    with pytest.raises(ValueError, match="step_budget"):
        S.root_find(lambda x, _: x, jnp.zeros(2), step_budget=-1)


def test_residual_trace_per_example():
    """`trace=True` records the residual after every iteration (NaN after the last), the
    same residuals the solve reports, per example under vmap; the default records none."""
    fn = lambda x, b: 0.5 * jnp.cos(x) + b
    solver = S.Picard(tol=1e-6, max_steps=40, norm=S.l2_norm)
    sol = jax.vmap(lambda b: S.fixed_point(fn, jnp.zeros(3), b, solver=solver, trace=True))(
        jnp.stack([jnp.ones(3), 0.01 * jnp.ones(3)]))
    assert sol.trace.shape == (2, 41)
    for i in range(2):
        k = int(sol.num_steps[i])
        t = np.asarray(sol.trace[i])
        assert np.all(np.isfinite(t[:k + 1])) and np.all(np.isnan(t[k + 1:]))
        np.testing.assert_allclose(t[k], sol.final_residual[i], rtol=1e-6)
        # Picard on a contraction: the residual falls at every step, by at most the rate 0.5
        assert np.all(np.diff(t[:k + 1]) < 0) and np.all(t[1:k + 1] / t[:k] <= 0.5 + 1e-6)
    # the initial residual is ‖fn(x0) − x0‖ = ‖0.5 + b‖
    np.testing.assert_allclose(sol.trace[0, 0], np.linalg.norm(np.full(3, 1.5)), rtol=1e-6)
    assert S.fixed_point(fn, jnp.zeros(3), jnp.ones(3), solver=solver).trace is None
    # differentiable (the unrolled loop carries the trace too), with the gradient of the
    # fixed point: x = 0.5 cos x + b gives ∂x_i/∂b_i = 1 / (1 + 0.5 sin x_i)
    grad = lambda trace: jax.grad(lambda b: S.fixed_point(
        fn, jnp.zeros(3), b, solver=solver, trace=trace,
        adjoint=S.Unrolled()).value.sum())(jnp.ones(3))
    x = np.asarray(sol.value[0])
    np.testing.assert_allclose(grad(True), 1 / (1 + 0.5 * np.sin(x)), rtol=1e-5)
    np.testing.assert_array_equal(grad(True), grad(False))


def test_lineax_linear_solvers_in_the_implicit_adjoint(x64):
    """`Implicit(linear_solver=lineax.LU())` (what optimistix users pass) gives the gradient
    of our dense solve, and a lineax solver that misses the tolerance fails like ours (NaN
    with throw=False; here a 2-step GMRES, no fallback)."""
    # (lineax 0.0.8 with the floor stack, jax 0.8 and equinox 0.13.0, fails inside lineax:
    # "cannot create weak reference to 'Flatten' object")
    lx = pytest.importorskip("lineax", minversion="0.1.1")
    n = 30
    A = jax.random.normal(jax.random.key(0), (n, n)) / np.sqrt(n) + 0.3 * jnp.eye(n)
    theta = jax.random.normal(jax.random.key(1), (n,))
    F = lambda x, th: A @ x + 0.1 * jnp.tanh(x) - th

    def grad(adjoint):
        return jax.grad(lambda th: jnp.sum(S.root_find(F, jnp.zeros(n), th,
                                                       solver=S.Newton(tol=1e-12),
                                                       adjoint=adjoint, throw=False).value ** 2))(
            theta)

    want = grad(S.Implicit(linear_solver=S.Dense()))
    np.testing.assert_allclose(grad(S.Implicit(linear_solver=lx.LU())), want, rtol=1e-9)
    weak = S.Implicit(linear_solver=lx.GMRES(rtol=1e-8, atol=1e-8, max_steps=2, restart=2),
                      fallback=None)
    assert not np.all(np.isfinite(grad(weak)))
    with pytest.raises(ValueError, match="lineax"):
        S.Implicit(linear_solver="lu")


def test_anderson_small_solve_is_a_cholesky_solve(x64):
    """Anderson's least-squares system is solved by a written-out Cholesky factorisation
    (one fused kernel instead of a LAPACK call per step): it agrees with a dense solve, also
    under vmap, and a singular system gives non-finite entries (Anderson's safeguard)."""
    from spinformer.solvers._solvers import _spd_solve

    rng = np.random.default_rng(0)
    for m in (1, 3, 5, 8):
        A = rng.normal(size=(4, m, m))
        G = A @ np.swapaxes(A, 1, 2) + 1e-3 * np.eye(m)
        b = rng.normal(size=(4, m))
        got = jax.vmap(_spd_solve)(jnp.asarray(G), jnp.asarray(b))
        np.testing.assert_allclose(got, np.linalg.solve(G, b[..., None])[..., 0], rtol=1e-8)
    singular = jnp.zeros((3, 3))
    assert not np.all(np.isfinite(_spd_solve(singular, jnp.ones(3))))


def test_unrolled_loop_matches_the_while_loop(x64):
    """`unroll=True` runs exactly `max_steps` straight-line steps (no while loop in the
    program); an example that converged stops changing, so value, step count and result
    equal the while loop's, per example under vmap, and the unrolled adjoint's gradient
    agrees; too few steps report `max_steps_reached`, and throw like the loop."""
    # tol 1e-4 and 8 steps: Picard converges in 7 and 4 steps, Anderson in 4 and 3 (the
    # unrolled program's compile grows faster than linearly with the step count: 14
    # Anderson steps took 10 s to compile, 8 take about 3)
    fn = lambda x, b: 0.3 * jnp.cos(x) + b
    bs = jnp.stack([jnp.ones(3), 0.01 * jnp.ones(3)])
    for cls, kw in ((S.Picard, {}), (S.Anderson, dict(history=2))):
        loop = cls(tol=1e-4, max_steps=8, **kw)
        flat = cls(tol=1e-4, max_steps=8, unroll=True, **kw)
        run = lambda s: jax.vmap(lambda b: S.fixed_point(fn, jnp.zeros(3), b, solver=s))(bs)
        a, b = run(loop), run(flat)
        np.testing.assert_array_equal(a.num_steps, b.num_steps)
        if cls is S.Picard:  # the examples stop at their own step
            assert int(a.num_steps[0]) > int(a.num_steps[1])
        np.testing.assert_allclose(b.value, a.value, rtol=0, atol=1e-12)
        np.testing.assert_array_equal(b.result, a.result)
        jaxpr = str(jax.make_jaxpr(lambda b: S.fixed_point(fn, jnp.zeros(3), b,
                                                           solver=flat).value)(bs[0]))
        assert "while" not in jaxpr
    # the gradient through the straight-line steps
    grad = lambda s: jax.grad(lambda b: S.fixed_point(
        fn, jnp.zeros(3), b, solver=S.Picard(tol=1e-4, max_steps=8, unroll=s),
        adjoint=S.Unrolled()).value.sum())(bs[0])
    np.testing.assert_allclose(grad(True), grad(False), rtol=1e-9)
    # a run-time step budget and the residual trace work the same without the loop
    traced = [S.fixed_point(fn, jnp.zeros(3), bs[0], solver=S.Picard(
        tol=1e-4, max_steps=8, unroll=u), trace=True, step_budget=5, throw=False)
        for u in (True, False)]
    np.testing.assert_array_equal(traced[0].trace, traced[1].trace)
    assert int(traced[0].num_steps) == 5
    short = S.Picard(tol=1e-6, max_steps=2, unroll=True)
    sol = S.fixed_point(fn, jnp.zeros(3), bs[0], solver=short, throw=False)
    assert int(sol.num_steps) == 2
    assert int(sol.result) == int(S.RESULTS.max_steps_reached)
    with pytest.raises(Exception, match="max_steps"):
        jax.block_until_ready(S.fixed_point(fn, jnp.zeros(3), bs[0], solver=short).value)
    # in a config: unroll is a key of picard and anderson, and of no other solver
    assert load_config(overrides={"model.attention.solver": {"name": "picard", "unroll": True}}
                       ).model.attention.solver.unroll
    with pytest.raises(ConfigError, match="unknown config key 'model.attention.solver.unroll'"):
        load_config(overrides={"model.attention.solver": {"name": "broyden", "unroll": True}})


def _dot_precisions(hlo: str) -> list[str]:
    """The operand precisions of every dot product in a lowered program's text."""
    import re

    return re.findall(r"dot_general[^\n]*?precision = \[(\w+), \w+\]", hlo)


def test_solves_trace_their_products_at_the_solvers_precision():
    """On NVIDIA GPUs float32 products default to TF32, whose ~1e-3 rounding stalls tight
    tolerances (H200: the DEQ benchmark's backward solves took 78 products instead of 10).
    Every product of a solve, forward and backward, map and solver alike, is traced at the
    solver's `precision` ("highest" by default), whatever the caller's global setting."""
    W = 0.3 * jnp.eye(6) + 0.05
    U = jnp.ones((6, 6)) / 6

    def loss(W, solver, adjoint):
        z = S.fixed_point(lambda z, W: jnp.tanh(W @ z + U @ jnp.ones(6)), jnp.zeros(6), W,
                          solver=solver, adjoint=adjoint).value
        return jnp.sum(U @ z)  # a product outside the solve: the caller's precision

    grad = jax.jit(jax.grad(loss), static_argnums=(1, 2))
    adjoint = S.Implicit()  # (Unrolled's backward transposes these same traced products)
    with jax.default_matmul_precision("bfloat16"):  # a caller's cheap global default
        hlo = grad.lower(W, S.Anderson(max_steps=20), adjoint).as_text()
        plain = grad.lower(W, S.Anderson(max_steps=20, precision=None), adjoint).as_text()
    got = _dot_precisions(hlo)
    # the read-out product (and its transpose) stay at the caller's setting; every other
    # product (the map, Anderson's Gram matrix, the backward solve) is HIGHEST
    assert len(got) >= 6 and "DEFAULT" in got, got
    assert got.count("HIGHEST") >= len(got) - 2, got
    # precision=None leaves the map's products at the caller's setting
    assert _dot_precisions(plain).count("DEFAULT") >= got.count("DEFAULT") + 3
    # and the answer is unchanged on a CPU, where float32 products are float32 anyway
    g1 = grad(W, S.Anderson(max_steps=20), S.Implicit())
    g2 = grad(W, S.Anderson(max_steps=20, precision=None), S.Implicit())
    np.testing.assert_allclose(g1, g2, rtol=1e-6)


def test_precision_option_checked_and_carried_by_the_config():
    with pytest.raises(ValueError, match="precision='tf32'.*tensorfloat32"):
        S.Picard(precision="tf32")
    solver = lambda value: load_config(  # noqa: E731
        overrides={"model.attention.solver": value}).model.attention.solver
    assert solver("anderson").precision == "highest"
    assert solver({"name": "picard", "precision": None}).precision is None
    assert solver({"name": "broyden", "precision": "tensorfloat32"}).precision == \
        "tensorfloat32"


# ----------------------------------------------------------------------------- vmapped loops


def test_a_vmapped_solve_compacts_only_from_the_step_cap_that_pays():
    """Compaction compiles a copy of the step per level: a solve capped below
    `COMPACT_FROM_STEPS` runs one plain batched loop, one capped at it compacts, except under
    `plain_loops()` (the evaluation step)."""
    from spinformer.solvers._fixed_point import COMPACT_FROM_STEPS, plain_loops

    def jaxpr(max_steps):
        def one(b):
            return S.fixed_point(lambda x, a: 0.5 * jnp.tanh(x) + a, jnp.zeros(3), b,
                                 solver=S.Picard(tol=1e-6, max_steps=max_steps),
                                 throw=False).value
        return str(jax.make_jaxpr(jax.vmap(one))(jnp.ones((16, 3))))  # levels 16, 8

    plain, compacting = jaxpr(COMPACT_FROM_STEPS - 1), jaxpr(COMPACT_FROM_STEPS)
    assert "sort" not in plain and plain.count("while[") == 1
    assert "sort" in compacting and compacting.count("while[") > 1
    with plain_loops():  # a program called a few times: never compacting
        inside = jaxpr(COMPACT_FROM_STEPS)
    assert "sort" not in inside and inside.count("while[") == 1


def test_a_vmapped_solve_compacts_finished_systems_without_changing_any_result(monkeypatch):
    """Under nested vmaps (examples × heads) the forward loop gathers the systems still
    running into smaller batches (`_lanes.while_lanes`); every system must come out exactly
    as from the plain batched `lax.while_loop` (value, steps, residual, result; the gradient
    to rounding), with shared (unbatched) operands and a system that fails its budget."""
    from spinformer.solvers import _fixed_point, _lanes

    rng = np.random.default_rng(0)
    B, H, n = 6, 3, 4
    # contraction rates from 0.05 to 0.99: 2 to ~100 Picard steps
    A = rng.normal(size=(B, H, n, n)) * rng.uniform(0.05, 0.99, (B, H, 1, 1)) / np.sqrt(n)
    A[0, 0] = -3.0 * np.eye(n)  # Picard oscillates: runs into max_steps
    b = rng.normal(size=(B, H, n))
    shared = rng.normal(size=(n,))

    def run(A, b, shared):
        def one(A, b):
            sol = S.fixed_point(lambda x, a: jnp.tanh(a[0] @ x + a[1] + shared), jnp.zeros(n),
                                (A, b), solver=S.Picard(tol=1e-6, max_steps=60), throw=False)
            return sol.value, sol.num_steps, sol.residual, sol.result
        return jax.vmap(jax.vmap(one))(A, b)

    def loss(A, b, shared):
        return jnp.sum(jnp.sin(run(A, b, shared)[0]))

    def both():
        f = jax.jit(run)(A, b, shared)
        g = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(A, b, shared)
        return jax.tree.map(np.asarray, (f, g))

    lanes = both()
    assert "sort" in str(jax.make_jaxpr(run)(A, b, shared))  # the gathers ran
    monkeypatch.setattr(_fixed_point, "while_lanes", lambda c, body, ops, init:
                        jax.lax.while_loop(lambda x: c(ops, x), lambda x: body(ops, x), init))
    plain = both()
    steps = lanes[0][1]
    assert steps.max() == 60 and steps.min() < 10  # the systems finish far apart
    assert lanes[0][3][0, 0] == S.RESULTS.max_steps_reached
    for x, y in zip(lanes[0], plain[0]):  # the forward solves: bit for bit
        np.testing.assert_array_equal(x, y)
    for x, y in zip(lanes[1], plain[1]):  # gradients: the same up to the compiled program's
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)  # float rounding
    assert _lanes._SHRINK >= 2
