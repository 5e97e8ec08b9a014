"""What an attention module reports when called with `return_diagnostics=True`."""

from __future__ import annotations

from typing import Optional

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Float, Int


class Stats(eqx.Module):
    """Solver statistics of the fixed points an attention solved, one per head (or per head
    and query).

    **Fields:**

    - `num_steps`: solver iterations, int32.
    - `residual`: the final residual norm.
    - `result`: a `spinformer.solvers.RESULTS` code, int32;
      `stats.result == solvers.RESULTS.successful` marks the converged ones.
    """

    num_steps: Int[Array, "..."]
    residual: Float[Array, "..."]
    result: Int[Array, "..."]

    @classmethod
    def of(cls, solution) -> "Stats":
        """The statistics of a `spinformer.solvers.Solution`."""
        return cls(solution.num_steps, solution.residual, solution.result)

    @classmethod
    def none(cls, shape: tuple[int, ...] = (), dtype=jnp.float32) -> "Stats":
        """The statistics of a solve that was not needed: zero steps, zero residual,
        successful."""
        zero = jnp.zeros(shape, jnp.int32)
        return cls(zero, jnp.zeros(shape, dtype), zero)


class Diagnostics(eqx.Module):
    """The inside of an attention call; a field an attention does not compute is None.

    Blocks and transformers stack these over layers: every array then has a leading `depth`
    axis (and a batch axis under `vmap`).

    **Fields:**

    - `weights`: attention weights `(H, n, s)` (each query's distribution over keys).
    - `couplings`: spin couplings `(H, n, s)` of the spin model built for this input (e.g.
      spin attention's `J`).
    - `magnetizations`: the spins' magnetizations (shape per module).
    - `fields`: the external fields of the spin model (shape per module).
    - `state`: `(n, d)`, the state to carry into the next call (`state=`).
    - `solver`: `Stats` of the fixed-point solves, or None if none were run.
    - `penalty`: a scalar the trainer adds to the loss (e.g. the Jacobian regulariser of an
      implicit layer), or None.
    - `spectral_radius`: the spectral radius of the fixed-point map's Jacobian at the
      solution (whether the fixed point attracts), or None when not computed.
    - `delayed_correlations`: first-order time-delayed correlations D_ij,t of the spins
      `(H, n, n)` (`spins.vector.delayed_correlations`), or None.
    - `entropy_production`: σ_t per head `(H,)` (`spins.vector.entropy_production`), or None.
    - `hidden`: `(n, d)`, the block's output (filled by `Block`; stacked over layers by a
      `Transformer`, for per-layer readouts), or None.
    """

    weights: Optional[Float[Array, "h n s"]] = None
    couplings: Optional[Float[Array, "h n s"]] = None
    magnetizations: Optional[Array] = None
    fields: Optional[Array] = None
    state: Optional[Float[Array, "n d"]] = None
    solver: Optional[Stats] = None
    penalty: Optional[Float[Array, ""]] = None
    spectral_radius: Optional[Float[Array, ""]] = None
    delayed_correlations: Optional[Float[Array, "h n n"]] = None
    entropy_production: Optional[Float[Array, " h"]] = None
    hidden: Optional[Float[Array, "n d"]] = None
