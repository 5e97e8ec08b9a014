"""Diagnostics of the fixed points a model solves: local contraction, multiplicity, solver
effort, and the non-equilibrium quantities the attention reports, per layer.

A spin-attention head in `mode="fixed_point"` outputs a steady state m* = F(m*) of the
vector-spin mean-field dynamics (`spins.vector.tap_ness` / `mean_field_ness`). Three questions
about it are not answered by the forward pass:

- is m* locally contracting? The spectral radius ρ of ∂F/∂m at m*: below 1 plain iteration
  converges to m* from nearby starts; above 1 m* is unstable (Anderson can still land on it);
- is it the only fixed point? Solves from several random starts, clustered;
- how hard was it to find? Solver steps and failures.

`steady_state_analysis` answers them for one head's explicit `(x, J)`,
`fixed_point_analysis` for a `SpinAttention` on one input, `model_analysis` for every layer
of a sequence model (adding what the attention reports itself: solver statistics and the
entropy production σ_t).
"""

from __future__ import annotations

from typing import Optional, Union

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from .. import solvers
from .._schema import choice
from ..spins import vector
from ._attention_diagnostics import Diagnostics, Stats
from ._spin import SpinAttention, SpinUpdate
from ._transformer import SequenceModel, Transformer

# The Jacobian of the steady-state map is (n·D_h)²: its eigenvalues are computed exactly up to
# this size, estimated by power iteration above it.
EXACT_MAX = 512
_POWER_STEPS = 100
# Solutions closer than this many solver tolerances are one fixed point (see `cluster_tol`).
_CLUSTER_FACTOR = 100.0


class FixedPointAnalysis(eqx.Module):
    """The steady states of a vector-spin model from several starts.

    Shapes are those of one head (`steady_state_analysis`); `fixed_point_analysis` adds a
    leading head axis `H`, `model_analysis` a leading `depth` axis before it. `S` is the
    number of starts: the default start φ(x) (index 0, the one the attention uses) and
    `num_starts` random ones.

    **Fields:**

    - `spectral_radius`: `()`, ρ of the steady-state map's Jacobian ∂F/∂m at the solution
      from the default start (< 1: locally contracting). At that solve's best iterate if it
      did not converge.
    - `num_fixed_points`: `()` int32, the number of distinct fixed points among the converged
      solves (0 if none converged).
    - `converged`: `()`, the fraction of the `S` starts whose solve converged.
    - `solver`: `Stats` of the default start's solve (`num_steps`, `residual`, `result`),
      each `()`.
    - `start_steps`: `(S,)` int32, solver steps from every start.
    - `magnetizations`: `(n, D_h)`, the solution from the default start.
    - `method`: how ρ was computed: `"eigenvalues"` (exact) or `"power iteration"`.
    """

    spectral_radius: Float[Array, "*batch"]
    num_fixed_points: Int[Array, "*batch"]
    converged: Float[Array, "*batch"]
    solver: Stats
    start_steps: Int[Array, "*batch S"]
    magnetizations: Float[Array, "*batch n dh"]
    method: str = eqx.field(static=True)


def _check_positive_int(name, what, value, minimum):
    if not (isinstance(value, int) and not isinstance(value, bool) and value >= minimum):
        raise ValueError(f"{name}: {what}={value!r} must be an int >= {minimum}.")


def _random_starts(key, n, dh, count, R, dtype):
    """`count` magnetizations `(count, n, dh)`, every spin uniform inside the ball of
    radius R (a uniform direction, radius R·u^{1/dh})."""
    kd, kr = jax.random.split(key)
    v = jax.random.normal(kd, (count, n, dh), dtype)
    v = v / jnp.sqrt(jnp.sum(v * v, axis=-1, keepdims=True))
    u = jax.random.uniform(kr, (count, n, 1), dtype)
    return R * u ** (1.0 / dh) * v


def _distinct(values, ok, norm, tol):
    """The number of distinct points among `values[ok]` `(S, ...)`: a converged solution
    counts unless it lies within `tol` (in `norm`) of an earlier converged one."""
    flat = values.reshape(values.shape[0], -1)
    dist = jax.vmap(lambda a: jax.vmap(lambda b: norm(a - b))(flat))(flat)  # (S, S)
    earlier = jnp.tril(jnp.ones(dist.shape, bool), k=-1)
    seen = jnp.any(earlier & (dist <= tol) & ok[None, :], axis=1)
    return jnp.sum(ok & ~seen).astype(jnp.int32)


def _jacobian_radius(fn, m, *, key, exact_max, power_steps, causal=False):
    """`(ρ, method)` of ∂fn/∂m at `m` `(n, dh)`: exact eigenvalues of the `(n·dh)²` Jacobian
    (`jax.jacfwd`) up to `exact_max` unknowns, else `solvers.spectral_radius` (power
    iteration on Jacobian–vector products). `causal`: spin i's update reads spins j ≤ i
    only, so the Jacobian is block lower-triangular and its eigenvalues are those of its n
    diagonal `(dh, dh)` blocks: the same ρ from n small eigenproblems, n² times less work
    than the whole matrix's (on the quickstart's analysis, 12 blocks of 32 against one
    384 × 384 matrix: the diagnosis ran 5 s of eigenvalues per 64 examples)."""
    n, dh = m.shape
    if m.size <= exact_max:
        jac = jax.jacfwd(lambda v: fn(v.reshape(m.shape)).reshape(-1))(m.reshape(-1))
        if causal:
            diagonal = jac.reshape(n, dh, n, dh)[jnp.arange(n), :, jnp.arange(n), :]
            rho = jnp.max(jnp.abs(jnp.linalg.eigvals(diagonal)))
        else:
            rho = jnp.max(jnp.abs(jnp.linalg.eigvals(jac)))
        return rho.astype(m.dtype), "eigenvalues"
    rho = solvers.spectral_radius(lambda v, _: fn(v), m, None, key=key, steps=power_steps)
    return rho, "power iteration"


def steady_state_analysis(
    x: Float[Array, "n dh"],
    J: Float[Array, "n n"],
    *,
    beta: float = 1.0,
    R: float = 1.0,
    update: Union[SpinUpdate, str] = "tap",
    solver: Optional[solvers.AbstractSolver] = None,
    key: PRNGKeyArray,
    num_starts: int = 8,
    cluster_tol: Optional[float] = None,
    exact_max: int = EXACT_MAX,
    power_steps: int = _POWER_STEPS,
    causal: bool = False,
) -> FixedPointAnalysis:
    """Analyse the steady states m = F(m) of one vector-spin model (one head).

    F is the steady-state map of the second-order (`update="tap"`,
    `spins.vector.ness_update`) or first-order (`update="mean_field"`, m ↦ φ(x + J m))
    dynamics, whose fixed point `spins.vector.tap_ness` / `mean_field_ness` solve (M. Bal,
    "Spin-Model Transformers" (2023), mcbal.github.io).

    - Spectral radius: of ∂F/∂m at the solution from the default start φ(x). Exact — the
      largest |eigenvalue| of the `(n·D_h) × (n·D_h)` Jacobian built with `jax.jacfwd` — when
      `n·D_h ≤ exact_max`; otherwise estimated by power iteration (Gelfand's formula,
      `solvers.spectral_radius`, `power_steps` Jacobian–vector products: on 24 random
      12-unknown systems at 100 steps, within 0.7 % (median) and 4 % (worst) of the exact
      radius, 1.2 % at worst after 400; 10 % off on one system whose leading eigenvalues
      are close in modulus). `method` says which.
    - Fixed points: solves from φ(x) and from `num_starts` random starts, every spin uniform
      inside the ball of radius R. A converged solution is a new fixed point unless it lies
      within `cluster_tol` of an earlier converged one, in the solver's norm. A solve stops at
      a residual ‖F(m) − m‖ ≤ tol, which puts it within about tol/(1 − ρ) of its fixed point,
      so the default `cluster_tol = 100·tol` merges the solves of one fixed point whose ρ is
      up to ~0.98. A continuum of fixed points (e.g. zero fields and symmetric couplings,
      whose ferromagnetic states may point anywhere) counts as many.

    **Arguments:**

    - `x`: fields `(n, D_h)`; `J`: couplings `(n, n)`; `beta`, `R` as `spins.vector`.
    - `update`: the update rule, `TAPUpdate()` / `MeanFieldUpdate()` or its name `"tap"` /
      `"mean_field"`.
    - `solver`: the fixed-point solver (its `tol`, `max_steps` and `norm` apply); default
      the steady-state solves' own, `spins.vector.NESS_SOLVER`.
    - `key`: PRNG key for the random starts (and the power iteration's start vector).
    - `num_starts`: random starts besides φ(x), ≥ 0.
    - `cluster_tol`: distance under which two solutions are one fixed point; default
      100 × the solver's `tol`.
    - `exact_max`: largest `n·D_h` for exact eigenvalues; `power_steps`: iterations above it.
    - `causal`: causal couplings, spin i feeling only spins j ≤ i (J's entries above the
      diagonal are taken as zero). The Jacobian is then block lower-triangular, and its
      exact eigenvalues are those of its n diagonal `(D_h, D_h)` blocks (the same ρ, for
      n² times less work than the whole matrix's).

    **Returns:** a `FixedPointAnalysis` (no head axis). Nothing here is differentiated: the
    inputs are taken as constants.
    """
    name = "steady_state_analysis"
    update = choice("spin.update", update, where=f"{name}: update")
    _check_positive_int(name, "num_starts", num_starts, 0)
    _check_positive_int(name, "exact_max", exact_max, 0)
    _check_positive_int(name, "power_steps", power_steps, 1)
    if jnp.ndim(x) != 2:
        raise ValueError(f"{name}: x must have shape (n, D_h); got {jnp.shape(x)}.")
    n, dh = jnp.shape(x)
    if jnp.shape(J) != (n, n):
        raise ValueError(f"{name}: J must have shape (n, n) = ({n}, {n}); got {jnp.shape(J)}.")
    solver = vector.NESS_SOLVER if solver is None else solver
    tol = _CLUSTER_FACTOR * solver.tol if cluster_tol is None else cluster_tol
    if not tol >= 0:
        raise ValueError(f"{name}: cluster_tol={cluster_tol!r} must be >= 0.")
    x, J = jax.lax.stop_gradient((jnp.asarray(x), jnp.asarray(J)))
    dtype = jnp.result_type(x, J, jnp.float32)
    x, J = x.astype(dtype), J.astype(dtype)
    if causal:
        J = jnp.tril(J)
    ks, kp = jax.random.split(key)

    ness = update.ness

    def fn(m):
        return update.ness_map(m, x, J, beta=beta, R=R)

    m_default = vector.magnetization(x, beta=beta, R=R)
    starts = jnp.concatenate(
        [m_default[None], _random_starts(ks, n, dh, num_starts, R, dtype)], axis=0)
    sols = jax.vmap(lambda m0: ness(x, J, beta=beta, R=R, solver=solver, throw=False,
                                    m0=m0))(starts)
    ok = sols.result == solvers.RESULTS.successful
    m = sols.value[0]
    rho, method = _jacobian_radius(fn, m, key=kp, exact_max=exact_max,
                                   power_steps=power_steps, causal=causal)
    return FixedPointAnalysis(
        spectral_radius=rho,
        num_fixed_points=_distinct(sols.value, ok, solver.norm, tol),
        converged=jnp.mean(ok.astype(dtype)),
        solver=Stats(sols.num_steps[0], sols.residual[0], sols.result[0]),
        start_steps=sols.num_steps,
        magnetizations=m,
        method=method,
    )


def fixed_point_analysis(
    attention: SpinAttention,
    x: Float[Array, "n d"],
    *,
    key: PRNGKeyArray,
    mask: Optional[Bool[Array, "n n"]] = None,
    num_starts: int = 8,
    cluster_tol: Optional[float] = None,
    exact_max: int = EXACT_MAX,
    power_steps: int = _POWER_STEPS,
) -> FixedPointAnalysis:
    """`steady_state_analysis` of every head of a `SpinAttention` in `mode="fixed_point"`
    on one input.

    The heads' fields and couplings are the attention's own (`attention.fields(x)`,
    `attention.couplings(x, mask=mask)`), and so are β, R, the update and the solver (its
    tolerance sets the default `cluster_tol`).

    **Arguments:**

    - `attention`: a `SpinAttention` built with `mode="fixed_point"` (else a `ValueError`).
    - `x`: `(n, d)`, what the attention receives (in a `Block`, the normed input
      `norm1(h)`).
    - `key`: PRNG key; `mask`: optional `(n, n)` as in the attention's call.
    - `num_starts`, `cluster_tol`, `exact_max`, `power_steps`: as `steady_state_analysis`
      (`exact_max` bounds `n·D_h`, the size of one head's system).

    **Returns:** a `FixedPointAnalysis` with a leading head axis `H`.
    """
    if not isinstance(attention, SpinAttention):
        raise ValueError("fixed_point_analysis: attention must be a SpinAttention; got "
                         f"{type(attention).__name__}.")
    if attention.mode == "steps":
        raise ValueError(f"fixed_point_analysis: the attention has mode={attention.mode!r}; "
                         "only mode='fixed_point' solves for a steady state.")
    if jnp.ndim(x) != 2 or jnp.shape(x)[-1] != attention.dim:
        raise ValueError(f"fixed_point_analysis: x must have shape (n, {attention.dim}); got "
                         f"{jnp.shape(x)}. Analyse one example per call.")
    # with learned per-head temperatures the fields and couplings carry exp(a_h) (see
    # SpinAttention.learn_beta), so the analysis sees the system the layer solves
    xh, J = attention._gain(attention.fields(x), attention.couplings(x, mask=mask))
    keys = jax.random.split(key, attention.num_heads)

    def one(xx, jj, k):
        return steady_state_analysis(
            xx, jj, beta=attention.beta, R=attention.radius, update=attention.update,
            solver=attention.solver, key=k, num_starts=num_starts, cluster_tol=cluster_tol,
            exact_max=exact_max, power_steps=power_steps, causal=attention.causal)

    return jax.vmap(one)(xh, J, keys)


class ModelAnalysis(eqx.Module):
    """Per-layer diagnostics of a sequence model on one input (`model_analysis`); a field
    that does not apply to the model's attention is None.

    **Fields:**

    - `solver_steps`: `(depth,)`, the mean forward solver steps of the layer's solves (over
      heads, and queries where an attention solves one system per query).
    - `solver_failures`: `(depth,)` int32, the layer's solves that did not converge.
    - `num_solves`: `(depth,)` int32, the layer's solves.
    - `entropy_production`: `(depth, H)`, σ_t per head as the attention reports it
      (`spins.vector.entropy_production`).
    - `fixed_points`: a `FixedPointAnalysis` with leading axes `(depth, H)`, for spin
      attention in `mode="fixed_point"`.
    """

    solver_steps: Optional[Float[Array, " depth"]]
    solver_failures: Optional[Int[Array, " depth"]]
    num_solves: Optional[Int[Array, " depth"]]
    entropy_production: Optional[Float[Array, "depth h"]]
    fixed_points: Optional[FixedPointAnalysis]


def model_analysis(
    model: Union[SequenceModel, Transformer],
    tokens: Int[Array, " n"],
    *,
    key: PRNGKeyArray,
    mask: Optional[Bool[Array, "n n"]] = None,
    num_starts: int = 8,
    cluster_tol: Optional[float] = None,
    exact_max: int = EXACT_MAX,
    power_steps: int = _POWER_STEPS,
) -> ModelAnalysis:
    """Diagnostics of every layer of a model on one sequence.

    The model runs once with `return_diagnostics=True`; its solver statistics and entropy
    production are read from the stacked diagnostics. For spin attention in
    `mode="fixed_point"` each layer's attention input is rebuilt — block i's input is the
    output of block i−1 (`diagnostics.hidden`; the embeddings for block 0), passed through
    the block's `norm1` — and analysed with `fixed_point_analysis`. Other attentions get the
    fields that apply (none for softmax attention).

    **Arguments:**

    - `model`: a `SequenceModel` (`CausalLM`, `Tagger`, `Classifier`) or a `Transformer`.
    - `tokens`: `(n,)` token ids; `mask`: optional `(n, n)` as in the model's call.
    - `key`: PRNG key; `num_starts`, `cluster_tol`, `exact_max`, `power_steps`: as
      `fixed_point_analysis`.

    **Returns:** a `ModelAnalysis` (per layer). Vmap or `lax.map` over a batch.
    """
    if isinstance(model, SequenceModel):
        model = model.transformer
    if not isinstance(model, Transformer):
        raise ValueError("model_analysis: model must be a SequenceModel or a Transformer; got "
                         f"{type(model).__name__}.")
    _, diag = model(tokens, mask=mask, return_diagnostics=True)
    steps = failures = solves = None
    if isinstance(diag, Diagnostics) and diag.solver is not None:
        st = diag.solver
        per_layer = st.num_steps.reshape(model.depth, -1)
        steps = jnp.mean(per_layer.astype(jnp.float32), axis=1)
        failed = (st.result != solvers.RESULTS.successful).reshape(model.depth, -1)
        failures = jnp.sum(failed, axis=1).astype(jnp.int32)
        solves = jnp.full((model.depth,), per_layer.shape[1], jnp.int32)
    sigma = diag.entropy_production if isinstance(diag, Diagnostics) else None

    fixed = None
    attention = model.blocks.attention
    if isinstance(attention, SpinAttention) and attention.mode == "fixed_point":
        inputs = jnp.concatenate([model.embeddings(tokens)[None], diag.hidden[:-1]], axis=0)
        keys = jax.random.split(key, model.depth)

        def layer(block, h, k):
            return fixed_point_analysis(
                block.attention, block.attention_input(h), key=k, mask=mask,
                num_starts=num_starts, cluster_tol=cluster_tol, exact_max=exact_max,
                power_steps=power_steps)

        fixed = eqx.filter_vmap(layer)(model.blocks, inputs, keys)
    return ModelAnalysis(solver_steps=steps, solver_failures=failures, num_solves=solves,
                         entropy_production=sigma, fixed_points=fixed)
