"""Benchmark: the vector-spin TAP steady state, spinformer vs jaxopt, forward + backward.

Solves the same steady-state equations m = φ(θ(m; m)) (`spinformer.spins.vector.tap_ness`)
twice:

- with `tap_ness` (spinformer's Anderson + implicit adjoint), and
- with `jaxopt.AndersonAcceleration` (implicit differentiation, jaxopt's defaults) on the
  same map,

at the same tolerance on the same (l2) residual norm, and times a jitted forward + backward
pass (gradient of a scalar loss with respect to the fields and the couplings) for a batch of
systems. Both are compiled and run once before timing; timings alternate between the two so
that machine noise hits both alike. Prints the agreement of the solutions and gradients and
the time ratio jaxopt / ours (> 1 means ours is faster).

    python experiments/bench/tap_ness.py [--batch 8] [--n 64] [--dim 64] [--beta 1.0]
    python experiments/bench/tap_ness.py --quick    # batch 2, n 16, D 16, 3 repeats: a smoke test
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from spinformer import solvers
from spinformer.spins import vector

from _compare import interleaved, ratio_header


def make_problem(key, batch, n, dim):
    """Fields on the sphere of radius R and softmax couplings, as in the seed's module."""
    R = (dim / 2 - 1) ** 0.5
    kx, kq = jax.random.split(key)
    x = jax.random.normal(kx, (batch, n, dim))
    x = R * x / jnp.linalg.norm(x, axis=-1, keepdims=True)
    w = jax.random.normal(kq, (dim, dim)) / dim
    J = jax.nn.softmax(jnp.einsum("bid,de,bje->bij", x, w, x), axis=-1)
    return x, J, R


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--n", type=int, default=64)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--beta", type=float, default=1.0)
    p.add_argument("--tol", type=float, default=1e-3)
    p.add_argument("--max-steps", type=int, default=100)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--quick", action="store_true", help="small sizes (a smoke test)")
    a = p.parse_args(argv)
    if a.quick:
        a.batch, a.n, a.dim, a.repeats = 2, 16, 16, 3

    try:
        import jaxopt
    except ImportError:  # the peer this benchmark compares against: the bench extra
        raise SystemExit("experiments/bench/tap_ness.py compares against jaxopt, which is not "
                         "installed: pip install -e \".[bench]\"") from None

    x, J, R = make_problem(jax.random.key(0), a.batch, a.n, a.dim)
    beta = a.beta
    weights = jax.random.normal(jax.random.key(1), x.shape[1:])

    def ours(x1, J1):
        return vector.tap_ness(
            x1, J1, beta=beta, R=R,
            solver=solvers.Anderson(history=5, tol=a.tol, max_steps=a.max_steps,
                                    norm=solvers.l2_norm),
        ).value

    def reference(x1, J1):
        m0 = vector.magnetization(x1, beta=beta, R=R)

        def fp(m, x_, J_):
            # the same map as tap_ness, written out from the public functions' definition
            return vector.ness_update(m, x_, J_, beta=beta, R=R)

        solver = jaxopt.AndersonAcceleration(
            fixed_point_fun=fp, history_size=5, tol=a.tol, maxiter=a.max_steps
        )
        return solver.run(jax.lax.stop_gradient(m0), x1, J1).params

    def loss(f):
        def batch_loss(x_, J_):
            m = jax.vmap(f)(x_, J_)
            return jnp.mean(jnp.sum(m * weights, axis=(-2, -1)))

        return jax.jit(jax.value_and_grad(batch_loss, argnums=(0, 1)))

    f_ours, f_ref = loss(ours), loss(reference)
    m_ours = jax.jit(jax.vmap(ours))(x, J)
    m_ref = jax.jit(jax.vmap(reference))(x, J)
    (_, (gx1, gJ1)), (_, (gx2, gJ2)) = f_ours(x, J), f_ref(x, J)  # warm-up compiles
    jax.block_until_ready((gx1, gJ1, gx2, gJ2))

    def rel(u, v):
        return float(jnp.linalg.norm(u - v) / jnp.linalg.norm(v))

    print(f"batch={a.batch} n={a.n} D={a.dim} R={R:.3f} beta={beta} tol={a.tol} (l2 residual)")
    print(f"solution  max|m_ours - m_jaxopt| = {float(jnp.max(jnp.abs(m_ours - m_ref))):.2e}"
          f"   (max|m| = {float(jnp.max(jnp.abs(m_ref))):.2f})")
    print(f"gradient  rel. diff x: {rel(gx1, gx2):.2e}   J: {rel(gJ1, gJ2):.2e}")

    t = interleaved({"ours": lambda: f_ours(x, J), "jaxopt": lambda: f_ref(x, J)}, a.repeats,
                    warmup=False)
    mo, mr, ratio = t.median("ours"), t.median("jaxopt"), t.ratio("jaxopt", "ours")
    print(ratio_header("jaxopt", "ours"))
    print(f"forward+backward median over {a.repeats}: ours {1e3 * mo:.2f} ms, "
          f"jaxopt {1e3 * mr:.2f} ms")
    print(f"ratio jaxopt/ours = {ratio:.3f}")
    return ratio


if __name__ == "__main__":
    main()
