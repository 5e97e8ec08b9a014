"""Binary Ising spins: mean field, TAP and enumeration against brute-force numpy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spinformer import solvers
from spinformer.spins import ising

from spin_helpers import ising_exact, random_symmetric


@pytest.mark.parametrize("n", [6, 13])  # 13 > 12 exercises the chunked path
@pytest.mark.parametrize("three_body", [False, True])
def test_enumeration_matches_brute_force(n, three_body):
    rng = np.random.default_rng(n + 10 * three_body)
    h = rng.normal(size=n) * 0.5
    J = random_symmetric(rng, n, 1.0)
    K = rng.normal(size=(n, n, n)) * 0.3 if three_body else None
    beta = 0.8
    log_z, m, C = ising_exact(h, J, beta, K)
    Kj = None if K is None else jnp.asarray(K, jnp.float32)
    args = (jnp.asarray(h, jnp.float32), jnp.asarray(J, jnp.float32))
    np.testing.assert_allclose(ising.log_partition(*args, beta=beta, K=Kj), log_z, rtol=2e-6)
    np.testing.assert_allclose(ising.exact_marginals(*args, beta=beta, K=Kj), m, atol=2e-6)
    np.testing.assert_allclose(ising.connected_correlations(*args, beta=beta, K=Kj), C,
                               atol=2e-6)
    if n == 13 and not three_body:
        # jitted and vmapped (batch >= 2) against plain numpy: guards against XLA CPU
        # miscompiling broadcast-and-reduce patterns in enumeration code
        h2 = np.stack([h, -h])
        f = jax.jit(jax.vmap(lambda h_, J_: ising.exact_marginals(h_, J_, beta=beta)))
        got = f(jnp.asarray(h2, jnp.float32), jnp.asarray(np.stack([J, J]), jnp.float32))
        np.testing.assert_allclose(got[0], m, atol=2e-6)
        np.testing.assert_allclose(got[1], ising_exact(-h, J, beta)[1], atol=2e-6)


def test_twenty_spins_float32_accuracy():
    """n = 20 in float32 stays near 1e-6 thanks to the chunked log-sum-exp."""
    n = 20
    rng = np.random.default_rng(20)
    h = rng.normal(size=n)
    J = random_symmetric(rng, n, 1.5)
    beta = 1.0
    # float64 numpy reference, vectorized over 2^20 configurations in blocks
    idx = np.arange(2**n)
    lse_parts, m_parts = [], []
    for block in np.array_split(idx, 16):
        S = 1.0 - 2.0 * ((block[:, None] >> np.arange(n)[None, :]) & 1)
        a = beta * (S @ h + 0.5 * np.sum((S @ J) * S, axis=1))
        amax = a.max()
        w = np.exp(a - amax)
        lse_parts.append(np.log(w.sum()) + amax)
        m_parts.append(w @ S / w.sum())
    lse_parts = np.array(lse_parts)
    log_z = np.logaddexp.reduce(lse_parts)
    m_ref = np.exp(lse_parts - log_z) @ np.array(m_parts)
    f = jax.jit(lambda h, J: (ising.log_partition(h, J, beta=beta),
                              ising.exact_marginals(h, J, beta=beta)))
    lz, m = f(jnp.asarray(h, jnp.float32), jnp.asarray(J, jnp.float32))
    assert abs(float(lz) - log_z) / abs(log_z) < 2e-6
    assert np.max(np.abs(np.asarray(m) - m_ref)) < 5e-6


def test_fluctuation_dissipation(x64):
    """∂⟨s⟩/∂h = β C (seed boltzmann-attention.txt, Prop. 1), with three-body couplings."""
    rng = np.random.default_rng(3)
    n, beta = 6, 0.7
    h = jnp.asarray(rng.normal(size=n))
    J = jnp.asarray(random_symmetric(rng, n, 1.0))
    K = jnp.asarray(rng.normal(size=(n, n, n)) * 0.3)

    @jax.jit
    def moments(h_):
        jac = jax.jacobian(lambda a: ising.exact_marginals(a, J, beta=beta, K=K))(h_)
        grad_lz = jax.grad(lambda a: ising.log_partition(a, J, beta=beta, K=K))(h_)
        return (jac, grad_lz, ising.connected_correlations(h_, J, beta=beta, K=K),
                ising.exact_marginals(h_, J, beta=beta, K=K))

    jac, grad_lz, C, m = moments(h)
    np.testing.assert_allclose(jac, beta * C, atol=1e-12)
    np.testing.assert_allclose(grad_lz, beta * m, atol=1e-12)


@pytest.fixture(scope="module")
def solved_batch():
    """Weakly coupled SK-like instances (the last ones with J = 0), solved once per module
    with every method, so each solver is compiled once."""
    rng = np.random.default_rng(4)
    n, count, zero, beta = 10, 24, 4, 1.0
    hs = rng.normal(size=(count, n)) * 0.3
    Js = np.stack([random_symmetric(rng, n, 0.4) for _ in range(count)])
    Js[-zero:] = 0.0
    hs, Js = jnp.asarray(hs, jnp.float32), jnp.asarray(Js, jnp.float32)

    @jax.jit
    def run(hs, Js):
        def one(h, J):
            return dict(
                exact=ising.exact_marginals(h, J, beta=beta),
                corr=ising.connected_correlations(h, J, beta=beta),
                log_z=ising.log_partition(h, J, beta=beta),
                mf=ising.mean_field(h, J, beta=beta, solver=solvers.Anderson(tol=1e-6)),
                tap=ising.tap(h, J, beta=beta, solver=solvers.Anderson(tol=1e-6)),
                tap_damped=ising.tap(h, J, beta=beta, damping=0.5,
                                     solver=solvers.Anderson(tol=1e-6, max_steps=300)).value,
            )

        return jax.vmap(one)(hs, Js)

    return dict(hs=hs, Js=Js, beta=beta, zero=zero, out=run(hs, Js))


def test_zero_coupling_limits(solved_batch):
    b = solved_batch
    z = slice(-b["zero"], None)
    out, beta = b["out"], b["beta"]
    want = np.tanh(beta * np.asarray(b["hs"][z]))
    np.testing.assert_allclose(out["exact"][z], want, atol=1e-6)
    np.testing.assert_allclose(out["mf"].value[z], want, atol=1e-6)
    np.testing.assert_allclose(out["tap"].value[z], want, atol=1e-6)
    # C = <ss> - m m^T in float32: one rounding of a value near 1 is ~6e-8, the subtraction
    # keeps a few of them (seen: 1.07e-6 on one diagonal entry), so allow 2e-6
    np.testing.assert_allclose(out["corr"][z], jax.vmap(jnp.diag)(1 - want**2), atol=2e-6)
    log_z = np.sum(np.log(2 * np.cosh(beta * np.asarray(b["hs"][z], np.float64))), axis=1)
    np.testing.assert_allclose(out["log_z"][z], log_z, rtol=1e-6)


def test_tap_closer_than_naive_mean_field(solved_batch):
    """Averaged over weakly coupled instances, TAP beats naive mean field."""
    b = solved_batch
    c = slice(0, -b["zero"])
    out = b["out"]
    err_mf = float(jnp.mean(jnp.abs(out["mf"].value[c] - out["exact"][c])))
    err_tap = float(jnp.mean(jnp.abs(out["tap"].value[c] - out["exact"][c])))
    assert err_tap < 0.5 * err_mf, (err_tap, err_mf)


def test_fixed_points_and_damping(solved_batch):
    b = solved_batch
    out, beta = b["out"], b["beta"]
    assert np.all(np.asarray(out["tap"].result) == solvers.RESULTS.successful)
    assert np.all(np.asarray(out["mf"].result) == solvers.RESULTS.successful)
    m, mf = out["tap"].value, out["mf"].value
    upd = jax.vmap(lambda m_, h, J: ising.tap_update(m_, h, J, beta=beta))
    np.testing.assert_allclose(upd(m, b["hs"], b["Js"]), m, atol=3e-6)
    upd = jax.vmap(lambda m_, h, J: ising.mean_field_update(m_, h, J, beta=beta))
    np.testing.assert_allclose(upd(mf, b["hs"], b["Js"]), mf, atol=3e-6)
    np.testing.assert_allclose(out["tap_damped"], m, atol=1e-5)


def test_tap_gradients_finite_differences(x64):
    rng = np.random.default_rng(6)
    n, beta = 5, 0.9
    h = jnp.asarray(rng.normal(size=n) * 0.5)
    J = jnp.asarray(random_symmetric(rng, n, 0.7))
    w = jnp.asarray(rng.normal(size=n))

    def loss(h_, J_, adjoint=None, solver=solvers.Anderson(tol=1e-12, max_steps=25)):
        return jnp.dot(w, ising.tap(h_, J_, beta=beta, adjoint=adjoint, solver=solver).value)

    gh, gJ = jax.jit(jax.grad(loss, argnums=(0, 1)))(h, J)
    # the unrolled reference backpropagates through Picard's iterations (another algorithm to
    # the same fixed point; its loop compiles in a fraction of Anderson's time)
    picard = solvers.Picard(tol=1e-12, max_steps=500)
    gh_u, gJ_u = jax.jit(jax.grad(lambda a, b: loss(a, b, solvers.Unrolled(), picard),
                                  argnums=(0, 1)))(h, J)
    # Central differences, all perturbations evaluated in one vmapped call.
    eps = 1e-6
    batched = jax.jit(jax.vmap(loss))
    dh = eps * np.eye(n)
    fd_h = (batched(h + dh, jnp.broadcast_to(J, (n, n, n)))
            - batched(h - dh, jnp.broadcast_to(J, (n, n, n)))) / (2 * eps)
    np.testing.assert_allclose(gh, fd_h, rtol=1e-6, atol=1e-8)
    dJ = eps * np.eye(n * n).reshape(n * n, n, n)
    hb = jnp.broadcast_to(h, (n * n, n))
    fd_J = ((batched(hb, J + dJ) - batched(hb, J - dJ)) / (2 * eps)).reshape(n, n)
    np.testing.assert_allclose(gJ, fd_J, rtol=1e-5, atol=1e-8)
    np.testing.assert_allclose(gh, gh_u, rtol=1e-8, atol=1e-10)
    np.testing.assert_allclose(gJ, gJ_u, rtol=1e-8, atol=1e-10)


def test_shape_errors():
    h = jnp.zeros(3)
    with pytest.raises(ValueError, match="shape"):
        ising.tap(h, jnp.zeros((4, 4)))
    with pytest.raises(ValueError, match="1-d"):
        ising.exact_marginals(jnp.zeros((2, 3)), jnp.zeros((3, 3)))
    with pytest.raises(ValueError, match="K must have shape"):
        ising.exact_marginals(h, jnp.zeros((3, 3)), K=jnp.zeros((3, 3)))
    with pytest.raises(ValueError, match="limited to"):
        ising.log_partition(jnp.zeros(40), jnp.zeros((40, 40)))
    with pytest.raises(ValueError, match="damping"):
        ising.mean_field(h, jnp.zeros((3, 3)), damping=1.0)


def test_three_body_mean_field_against_explicit_sums(x64):
    rng = np.random.default_rng(12)
    n, beta = 5, 0.7
    h = rng.normal(size=n) * 0.4
    J = random_symmetric(rng, n, 0.5)
    K = rng.normal(size=(n, n, n)) * 0.3
    m = np.tanh(rng.normal(size=n))

    def local(m):
        # spin j feels sum over the other two members of every triple k < l < ... containing j
        f = h + J @ m
        for a in range(n):
            for b in range(a + 1, n):
                for c in range(b + 1, n):
                    f[a] += K[a, b, c] * m[b] * m[c]
                    f[b] += K[a, b, c] * m[a] * m[c]
                    f[c] += K[a, b, c] * m[a] * m[b]
        return f

    np.testing.assert_allclose(ising.mean_field_update(m, h, J, beta=beta, K=K),
                               np.tanh(beta * local(m)), atol=1e-12)
    sol = ising.mean_field(h, J, beta=beta, K=K, solver=solvers.Anderson(tol=1e-12))
    np.testing.assert_allclose(sol.value, np.tanh(beta * local(np.asarray(sol.value))),
                               atol=1e-11)
    # K = 0 is the pairwise equation
    np.testing.assert_allclose(ising.mean_field(h, J, K=np.zeros((n, n, n))).value,
                               ising.mean_field(h, J).value, atol=1e-12)


def test_updates_with_visible_spins_are_the_updates_of_the_visible_subsystem(x64):
    """`visible` removes spins: the update on the visible ones equals the update of the
    model built from their fields and couplings alone, and the removed ones stay at 0."""
    rng = np.random.default_rng(7)
    n = 6
    h, m = rng.normal(size=n), rng.uniform(-0.9, 0.9, size=n)
    J = ising.symmetrize(rng.normal(size=(n, n)) * 0.4)
    K = rng.normal(size=(n, n, n)) * 0.3
    vis = np.array([1, 0, 1, 1, 0, 1], float)
    idx = np.flatnonzero(vis)
    sub = np.ix_(idx, idx)
    for full, part in (
        (ising.mean_field_update(m, h, J, K=K, beta=0.7, visible=vis),
         ising.mean_field_update(m[idx], h[idx], J[sub], beta=0.7,
                                 K=K[np.ix_(idx, idx, idx)])),
        (ising.tap_update(m, h, J, beta=0.7, visible=vis),
         ising.tap_update(m[idx], h[idx], J[sub], beta=0.7)),
    ):
        full = np.asarray(full)
        np.testing.assert_allclose(full[idx], part, atol=1e-12)
        np.testing.assert_array_equal(full[vis == 0], 0.0)
