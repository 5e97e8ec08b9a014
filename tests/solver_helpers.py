"""Shared problems for the solver tests, with independent numpy references."""

import numpy as np
import jax.numpy as jnp


def random_contraction(rng, n, norm=0.5):
    """A random matrix with spectral norm `norm` (so x -> A x + b contracts)."""
    A = rng.normal(size=(n, n))
    return A * (norm / np.linalg.norm(A, 2))


def linear_map(x, args):
    A, b = args
    return A @ x + b


def tanh_map(x, args):
    W, b = args
    return jnp.tanh(W @ x + b)


def tap_map(m, args):
    """Binary TAP: m = tanh(β(h + J m) − β² m Σ_j J_ij² (1 − m_j²))."""
    h, J, beta = args
    onsager = beta**2 * m * ((J**2) @ (1.0 - m**2))
    return jnp.tanh(beta * (h + J @ m) - onsager)


def numpy_iterate(f, x0, steps=5000, damping=0.0):
    """Plain (damped) iteration in float64 numpy: the reference for nonlinear maps."""
    x = np.asarray(x0, np.float64)
    for _ in range(steps):
        x = (1 - damping) * f(x) + damping * x
    return x


def numpy_tap(h, J, beta):
    def f(m):
        return np.tanh(beta * (h + J @ m) - beta**2 * m * ((J**2) @ (1 - m**2)))

    return f


def sk_couplings(rng, n, beta, j_mean=1.0, j_std=0.1):
    """Symmetric couplings J_ij ~ N(β J_μ / n, β² J_σ² / n), zero diagonal (the seeds' setup)."""
    J = rng.normal(beta * j_mean / n, beta * j_std / np.sqrt(n), size=(n, n))
    J = np.triu(J, 1)
    return J + J.T


def tuned(solver=None, **rule):
    """`solver` (default `Anderson()`) with its stopping rule (`tol`, `max_steps`, `norm`)
    replaced: the tolerances live on the solver objects."""
    import dataclasses

    from spinformer import solvers

    return dataclasses.replace(solvers.Anderson() if solver is None else solver, **rule)
