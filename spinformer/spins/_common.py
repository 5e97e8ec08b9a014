"""Private helpers shared by the spin modules: input checks and solver defaults."""

from __future__ import annotations

import jax.numpy as jnp

from .. import solvers


def check_square(name: str, J, n: int, what: str = "J") -> None:
    shape = jnp.shape(J)
    if shape != (n, n):
        raise ValueError(
            f"{name}: {what} must have shape (n, n) = ({n}, {n}) to match the {n} spins, "
            f"got {shape}. Pass one system per call and vmap over a batch."
        )


def check_vector(name: str, v, what: str, n: int | None = None) -> int:
    shape = jnp.shape(v)
    if len(shape) != 1:
        raise ValueError(
            f"{name}: {what} must be a 1-d array of shape (n,), got shape {shape}. "
            "Functions in spinformer.spins take one system per call; vmap over a batch."
        )
    if n is not None and shape[0] != n:
        raise ValueError(f"{name}: {what} has {shape[0]} entries but the system has {n} spins.")
    return shape[0]


def as_float(*arrays):
    """Promote inputs to a common floating dtype (float32 unless x64 is on)."""
    dt = jnp.result_type(*[a for a in arrays if a is not None], jnp.float32)
    if not jnp.issubdtype(dt, jnp.floating):
        dt = jnp.float32
    return tuple(None if a is None else jnp.asarray(a, dt) for a in arrays)


# Implicit differentiation with short GMRES cycles: spin fixed points away from criticality
# are well conditioned, the adjoint converges in a handful of products, and a long restart
# cycle (the solvers' default of 20) costs a full Arnoldi cycle per backward pass.
DEFAULT_ADJOINT = solvers.Implicit(linear_solver="gmres", restart=5)


def solve(name, fn, x0, args, *, solver, adjoint, tol, max_steps, throw, return_solution,
          norm="inf"):
    """Run `solvers.fixed_point` with spinformer's defaults for spin problems."""
    if solver is None:
        solver = solvers.Anderson()
    if adjoint is None:
        adjoint = DEFAULT_ADJOINT
    sol = solvers.fixed_point(
        fn, x0, args, solver=solver, adjoint=adjoint, tol=tol, max_steps=max_steps, throw=throw,
        norm=norm,
    )
    return sol if return_solution else sol.value


def check_damping(name: str, damping) -> None:
    if not (0.0 <= float(damping) < 1.0):
        raise ValueError(
            f"{name}: damping={damping} must be in [0, 1): the map is replaced by "
            "m -> damping * m + (1 - damping) * update(m), which keeps the same fixed points."
        )


def check_hJK(name, h, J, K=None):
    """Fields `(n,)`, couplings `(n, n)` and optional three-body `K (n, n, n)`; returns n."""
    n = check_vector(name, h, "h")
    check_square(name, J, n)
    if K is not None and jnp.shape(K) != (n, n, n):
        raise ValueError(
            f"{name}: K must have shape (n, n, n) = ({n}, {n}, {n}), got {jnp.shape(K)}. "
            "Only the entries K[j, k, l] with j < k < l are used."
        )
    return n
