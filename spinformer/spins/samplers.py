r"""Sampling binary Ising systems (Gibbs, parallel tempering, simulated diabatic quantum
annealing) and vector spins (exact von Mises–Fisher draws, Monte Carlo of the parallel
vector-spin kinetics: `von_mises_fisher`, `simulate_vector_kinetics`).

Same energy as `spinformer.spins.ising`: spins s ∈ {-1, +1}^n,

    E(s) = -( h·s + ½ sᵀJs + Σ_{j<k<l} K_jkl s_j s_k s_l ),

Boltzmann weight exp(−βE). Only the symmetric off-diagonal part of J and the entries
K[j, k, l] with j < k < l are used. Every function samples one system (one `h`); vmap over
queries, batches or heads, with one key each. Keys are explicit keyword arguments.

These are the scalable alternatives to exact enumeration in Boltzmann attention (G. Kim,
D. K. Park, "Boltzmann Attention: Learnable Ising Couplings for Cooperative Attention",
arXiv:2606.12478 (2026), §4.5 and §5): samplers give noisy, non-differentiable magnetization
estimates, and `straight_through` passes gradients through them from a differentiable
surrogate (the paper trains DQA-sampled attention with the straight-through estimator).

```python
keys = jax.random.split(key, Q)
samples = jax.vmap(lambda h_q, k: samplers.gibbs(h_q, J, key=k, num_samples=512,
                                                 burn_in=64))(h, keys)   # (Q, 512, T)
m = samplers.straight_through(samples.mean(1), jax.vmap(lambda h_q: ising.tap(h_q, J).value)(h))
```
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Complex, Float, PRNGKeyArray

from ._common import MAX_DQA as MAX_DQA
from ._common import (
    Matrix,
    Scalar,
    Tensor3,
    Vector,
    HIGHEST,
    as_float,
    bits,
    check_hJK,
    check_vector,
    sym3,
    sym_offdiag,
)

__all__ = [
    "MAX_DQA",
    "gibbs",
    "parallel_tempering",
    "dqa",
    "dqa_state",
    "energy",
    "batch_means",
    "straight_through",
    "straight_through_mean_field",
    "von_mises_fisher",
    "simulate_vector_kinetics",
    "KineticsMoments",
]



# ----------------------------------------------------------------------------- helpers


def _prepare(name, h, J, K):
    n = check_hJK(name, h, J, K)
    h, J, K = as_float(h, J, K)
    K_sym = None if K is None else sym3(K)  # zero on repeated indices
    return n, h, sym_offdiag(J), K_sym


def _check_int(name, what, value, minimum):
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name}: {what} must be a Python int >= {minimum}, got {value!r}.")




def _energy(s, h, J, K_sym):
    e = -(jnp.dot(s, h, precision=HIGHEST) + 0.5 * jnp.dot(s, jnp.dot(J, s, precision=HIGHEST),
                                                         precision=HIGHEST))
    if K_sym is not None:
        e = e - jnp.einsum("jkl,j,k,l->", K_sym, s, s, s, precision=HIGHEST) / 6.0
    return e


def _local_field(j, s, h, J, K_sym):
    f = h[j] + jnp.dot(J[j], s, precision=HIGHEST)
    if K_sym is not None:
        # K_sym[j, j, :] = 0, so s_j drops out
        f = f + 0.5 * jnp.dot(s, jnp.dot(K_sym[j], s, precision=HIGHEST), precision=HIGHEST)
    return f


def _sweep(s, u, h, J, K_sym, beta):
    """One systematic-scan Gibbs sweep over all spins (heat-bath updates), uniforms `u`."""

    def body(j, s):
        p_up = jax.nn.sigmoid(2.0 * beta * _local_field(j, s, h, J, K_sym))
        return s.at[j].set(jnp.where(u[j] < p_up, 1.0, -1.0).astype(s.dtype))

    return jax.lax.fori_loop(0, s.shape[0], body, s)


def energy(
    s: Float[ArrayLike, " n"],
    h: Float[ArrayLike, " n"],
    J: Float[ArrayLike, "n n"],
    *,
    K: Float[ArrayLike, "n n n"] | None = None,
) -> Float[Array, ""]:
    """The classical energy E(s) = −(h·s + ½ sᵀJs + Σ_{j<k<l} K_jkl s_j s_k s_l).

    **Arguments:** a configuration `s` `(n,)` in ±1, fields `h` `(n,)`, couplings `J`
    `(n, n)`, optional three-body `K` `(n, n, n)`.

    **Returns:** a scalar.
    """
    n, h, J, K_sym = _prepare("energy", h, J, K)
    check_vector("energy", s, "s", n)
    return _energy(jnp.asarray(s, h.dtype), h, J, K_sym)


# ----------------------------------------------------------------------------- Gibbs


def gibbs(
    h: Float[ArrayLike, " n"],
    J: Float[ArrayLike, "n n"],
    *,
    key: PRNGKeyArray,
    num_samples: int,
    burn_in: int,
    thin: int = 1,
    K: Float[ArrayLike, "n n n"] | None = None,
    beta: float | Float[ArrayLike, ""] = 1.0,
    init: Float[ArrayLike, " n"] | None = None,
) -> Float[Array, "num_samples n"]:
    """Samples from exp(−βE) by systematic-scan Gibbs sampling (heat-bath updates).

    Each sweep visits spins 0..n−1 in order and draws s_j = +1 with probability
    σ(2β f_j), f_j = h_j + Σ_k J_jk s_k (+ Σ_{k<l} K-terms). The chain starts from random
    spins, runs `burn_in` sweeps, then records the state after every `thin`-th sweep.

    **Arguments:**

    - `h`, `J`, `K`: fields `(n,)`, couplings `(n, n)`, optional three-body `(n, n, n)`.
    - `key`: a PRNG key.
    - `num_samples`: recorded states; `burn_in`: sweeps discarded first; `thin`: sweeps
      between recorded states.
    - `beta`: inverse temperature.
    - `init`: initial configuration `(n,)` in ±1; default random.

    **Returns:** samples `(num_samples, n)` in ±1 (float). Their mean estimates ⟨s⟩; the
    samples are autocorrelated, so use `batch_means` for an error bar.

    All random numbers are drawn up front ((1 + burn_in + num_samples·thin)·n uniforms),
    which compiles much faster on CPU than drawing them inside the loop; for very long
    chains, call repeatedly with the last sample as `init` and fresh keys instead.
    """
    name = "gibbs"
    n, h, J, K_sym = _prepare(name, h, J, K)
    _check_int(name, "num_samples", num_samples, 1)
    _check_int(name, "burn_in", burn_in, 0)
    _check_int(name, "thin", thin, 1)
    beta = jnp.asarray(beta, h.dtype)
    # All random numbers are drawn up front in one call (RNG inside loops, or several RNG
    # calls, cost seconds of compile time on CPU): (1 + burn_in + num_samples·thin)·n
    # uniforms, the first row for the random initial state.
    u = jax.random.uniform(key, (1 + burn_in + num_samples * thin, n), dtype=h.dtype)
    if init is None:
        s = jnp.where(u[0] < 0.5, 1.0, -1.0).astype(h.dtype)
    else:
        check_vector(name, init, "init", n)
        s = jnp.asarray(init, h.dtype)
    u = u[1:]

    def step(s, u_sweep):
        return _sweep(s, u_sweep, h, J, K_sym, beta), None

    s, _ = jax.lax.scan(step, s, u[:burn_in])

    def record(s, u_thin):
        s, _ = jax.lax.scan(step, s, u_thin)
        return s, s

    _, samples = jax.lax.scan(record, s, u[burn_in:].reshape(num_samples, thin, n))
    return samples


# ----------------------------------------------------------------------------- tempering


def parallel_tempering(
    h: Float[ArrayLike, " n"],
    J: Float[ArrayLike, "n n"],
    *,
    key: PRNGKeyArray,
    betas: Float[ArrayLike, " R"],
    num_samples: int,
    burn_in: int = 100,
    thin: int = 1,
    K: Float[ArrayLike, "n n n"] | None = None,
    return_swap_rate: bool = False,
):
    """Replica-exchange Monte Carlo: Gibbs chains at several temperatures that swap states.

    R replicas run Gibbs sweeps at inverse temperatures `betas`; after every sweep,
    neighbouring replicas (r, r+1) — the even pairs after even sweeps, the odd pairs after
    odd sweeps — exchange their states with probability min(1, exp((β_r − β_{r+1})(E_r −
    E_{r+1}))), which keeps each replica's Boltzmann distribution invariant while the hot
    replicas carry the cold one across energy barriers (Kim & Park 2026, §5, name parallel
    tempering as the classical route beyond exact enumeration).

    **Arguments:**

    - `h`, `J`, `K`: as `gibbs`.
    - `key`: a PRNG key.
    - `betas`: `(R,)` inverse temperatures, R ≥ 2, the target first and decreasing, e.g.
      `jnp.array([1.0, 0.7, 0.5, 0.3])`.
    - `num_samples`, `burn_in`, `thin`: as `gibbs` (counted in sweeps of all replicas).
    - `return_swap_rate`: also return the acceptance rate of the swap proposals, `(R − 1,)`.

    **Returns:** samples `(num_samples, n)` of the chain at β = `betas[0]` (the usual target
    β = 1), and with `return_swap_rate` the tuple `(samples, swap_rate)`.
    """
    name = "parallel_tempering"
    n, h, J, K_sym = _prepare(name, h, J, K)
    _check_int(name, "num_samples", num_samples, 1)
    _check_int(name, "burn_in", burn_in, 0)
    _check_int(name, "thin", thin, 1)
    if jnp.ndim(betas) != 1 or jnp.shape(betas)[0] < 2:
        raise ValueError(
            f"{name}: betas must be a 1-d array of at least 2 inverse temperatures (target "
            f"first, then decreasing), got shape {jnp.shape(betas)}. Use `gibbs` for one."
        )
    betas = jnp.asarray(betas, h.dtype)
    R = betas.shape[0]
    r = jnp.arange(R)
    total = burn_in + num_samples * thin
    # random numbers drawn up front in one call (as in `gibbs`): the first row gives the
    # initial states, the last column the swap decisions
    u = jax.random.uniform(key, (1 + total, R, n + 1), dtype=h.dtype)
    states = jnp.where(u[0, :, :n] < 0.5, 1.0, -1.0).astype(h.dtype)
    u_sweep = u[1:, :, :n]
    log_u_swap = jnp.log(u[1:, :, n])
    parity = jnp.arange(total) % 2

    def step(carry, inp):
        states, accepted, proposed = carry
        u, log_u, par = inp
        states = jax.vmap(lambda s, u_, b: _sweep(s, u_, h, J, K_sym, b))(states, u, betas)
        E = jax.vmap(lambda s: _energy(s, h, J, K_sym))(states)
        # pairs (i, i+1) with i of the current parity; each replica finds its partner
        left = (r - par) % 2 == 0
        partner = jnp.where(left, r + 1, r - 1)
        valid = (partner >= 0) & (partner < R)
        partner = jnp.clip(partner, 0, R - 1)
        log_u = log_u[jnp.minimum(r, partner)]  # both members of a pair share one uniform
        log_acc = (betas - betas[partner]) * (E - E[partner])
        accept = valid & (log_u < log_acc)
        states = jnp.where(accept[:, None], states[partner], states)
        pair_ok = valid & left  # count each proposal once, at its left member
        accepted = accepted + jnp.where(pair_ok & accept, 1.0, 0.0)[:-1]
        proposed = proposed + jnp.where(pair_ok, 1.0, 0.0)[:-1]
        return (states, accepted, proposed), None

    zeros = jnp.zeros((R - 1,), h.dtype)
    carry = (states, zeros, zeros)
    xs = (u_sweep, log_u_swap, parity)
    carry, _ = jax.lax.scan(step, carry, jax.tree_util.tree_map(lambda x: x[:burn_in], xs))

    def record(carry, inp):
        carry, _ = jax.lax.scan(step, carry, inp)
        return carry, carry[0][0]

    rest = jax.tree_util.tree_map(
        lambda x: x[burn_in:].reshape((num_samples, thin) + x.shape[1:]), xs)
    (_, accepted, proposed), samples = jax.lax.scan(record, carry, rest)
    if return_swap_rate:
        return samples, accepted / jnp.maximum(proposed, 1.0)
    return samples


# ----------------------------------------------------------------------------- DQA


def dqa_state(
    h: Float[ArrayLike, " n"],
    J: Float[ArrayLike, "n n"],
    *,
    steps: int,
    total_time: float | Float[ArrayLike, ""],
    gamma: float | Float[ArrayLike, ""] = 1.0,
    K: Float[ArrayLike, "n n n"] | None = None,
) -> Complex[Array, " 2**n"]:
    r"""The final state of a Trotterised (diabatic) quantum anneal, simulated classically.

    H(t) = −(1 − t/T_a)·Γ Σ_j σ^x_j + (t/T_a)·H_Ising, with H_Ising diagonal in the
    computational basis holding the classical energy E(s) (so low energy = high Boltzmann
    weight = what the anneal ends in). The state starts in the ground state of the transverse
    field, the uniform superposition, and evolves through `steps` second-order Trotter steps
    of length dt = T_a/steps at the midpoint times: a half-step diagonal phase
    exp(−i dt/2 · (t/T_a) E), the transverse-field rotations exp(+i dt (1 − t/T_a) Γ σ^x_j)
    applied qubit by qubit (a reshape and a 2×2 mix per axis, never a 2^n × 2^n matrix),
    and another half-step phase. Kim & Park 2026, §4.5 (200 Trotter steps,
    τ = 5 in its units).

    Basis state index b holds the configuration s_k = 1 − 2·bit_k(b), as in `ising`.

    **Arguments:**

    - `h`, `J`, `K`: as `gibbs` (n ≤ 12: the state vector has 2^n complex entries).
    - `steps`: number of Trotter steps (Python int ≥ 1).
    - `total_time`: the anneal time T_a ≥ 0; 0 leaves the uniform superposition, a long
      anneal follows the instantaneous ground state (adiabatic limit).
    - `gamma`: transverse-field strength Γ.

    **Returns:** the complex state vector `(2^n,)`, of unit norm.
    """
    name = "dqa_state"
    n, h, J, K_sym = _prepare(name, h, J, K)
    if n > MAX_DQA:
        raise ValueError(
            f"{name}: simulating a quantum anneal of n={n} qubits needs a 2^{n} state vector; "
            f"it is limited to n <= {MAX_DQA}. Use gibbs or parallel_tempering for larger "
            "systems."
        )
    _check_int(name, "steps", steps, 1)
    S = jnp.asarray(bits(n), h.dtype)
    E = jax.vmap(lambda s: _energy(s, h, J, K_sym))(S)  # (2^n,), small: n <= 12
    cdt = jnp.result_type(h.dtype, jnp.complex64)
    total_time = jnp.asarray(total_time, h.dtype)
    gamma = jnp.asarray(gamma, h.dtype)
    dt = total_time / steps
    psi = jnp.full((2**n,), 2.0 ** (-n / 2), cdt)

    def rotate(psi, theta):
        """exp(+i θ σ^x) on every qubit: cos θ·I + i sin θ·σ^x, axis by axis."""
        c, s = jnp.cos(theta).astype(cdt), (1j * jnp.sin(theta)).astype(cdt)
        for j in range(n):
            x = psi.reshape(2 ** (n - 1 - j), 2, 2**j)
            x0, x1 = x[:, 0, :], x[:, 1, :]
            psi = jnp.stack([c * x0 + s * x1, s * x0 + c * x1], axis=1).reshape(-1)
        return psi

    def step(psi, k):
        frac = (k + 0.5) / steps  # t / T_a at the midpoint
        half_phase = jnp.exp(-0.5j * (dt * frac * E)).astype(cdt)
        psi = half_phase * psi
        psi = rotate(psi, dt * (1.0 - frac) * gamma)
        psi = half_phase * psi
        return psi, None

    psi, _ = jax.lax.scan(step, psi, jnp.arange(steps, dtype=h.dtype))
    return psi


def dqa(
    h: Float[ArrayLike, " n"],
    J: Float[ArrayLike, "n n"],
    *,
    key: PRNGKeyArray,
    num_samples: int,
    steps: int = 200,
    total_time: float | Float[ArrayLike, ""] = 5.0,
    gamma: float | Float[ArrayLike, ""] = 1.0,
    K: Float[ArrayLike, "n n n"] | None = None,
) -> Float[Array, "num_samples n"]:
    """Samples from a simulated diabatic quantum anneal (Kim & Park 2026, §4.5).

    Runs `dqa_state` and measures it `num_samples` times in the computational basis
    (configurations drawn from |ψ|²). A fast anneal gives approximately Boltzmann samples at
    an effective temperature set by the annealing rate; a slow one concentrates on the ground
    state; `total_time=0` gives uniform samples. The samples carry no gradient: combine their
    mean with a differentiable surrogate through `straight_through`.

    **Arguments:**

    - `h`, `J`, `K`: as `gibbs`, n ≤ 12.
    - `key`: a PRNG key; `num_samples`: measurements of the final state.
    - `steps`, `total_time`, `gamma`: as `dqa_state` (defaults: the paper's 200 steps, τ = 5).

    **Returns:** samples `(num_samples, n)` in ±1 (float).
    """
    _check_int("dqa", "num_samples", num_samples, 1)
    psi = dqa_state(h, J, steps=steps, total_time=total_time, gamma=gamma, K=K)
    n = jnp.shape(h)[0]
    prob = jnp.real(psi * jnp.conj(psi))
    logits = jnp.log(jnp.maximum(prob, jnp.finfo(prob.dtype).tiny))
    idx = jax.random.categorical(key, logits, shape=(num_samples,))
    bits = (idx[:, None] >> jnp.arange(n)[None, :]) & 1
    return (1 - 2 * bits).astype(prob.dtype)


# ----------------------------------------------------------------------------- estimators


def batch_means(
    samples: Float[ArrayLike, "num_samples n"], num_batches: int = 20
) -> tuple[Float[Array, " n"], Float[Array, " n"]]:
    """Mean of correlated samples and its standard error by the method of batch means.

    The chain is cut into `num_batches` consecutive batches (the remainder at the start is
    dropped); the standard error is the standard deviation of the batch means over
    √num_batches, which accounts for autocorrelation shorter than a batch.

    **Arguments:** `samples` `(num_samples, n)` from one chain; `num_batches` ≥ 2.

    **Returns:** `(mean, stderr)`, each `(n,)`.
    """
    if jnp.ndim(samples) != 2:
        raise ValueError(
            f"batch_means: samples must have shape (num_samples, n), got {jnp.shape(samples)}."
        )
    N = jnp.shape(samples)[0]
    _check_int("batch_means", "num_batches", num_batches, 2)
    if N < num_batches:
        raise ValueError(f"batch_means: {N} samples cannot fill {num_batches} batches.")
    size = N // num_batches
    x = jnp.asarray(samples)[N - size * num_batches:]
    means = x.reshape(num_batches, size, -1).mean(axis=1)
    return x.mean(axis=0), means.std(axis=0, ddof=1) / np.sqrt(num_batches)


def straight_through(
    estimate: Float[ArrayLike, "..."], surrogate: Float[ArrayLike, "..."]
) -> Float[Array, "..."]:
    """Straight-through estimator: the value of `estimate`, the gradient of `surrogate`.

    Returns `surrogate + stop_gradient(estimate − surrogate)`. Use it to train through
    sampled magnetizations (Kim & Park 2026, §4.5, train DQA-sampled attention this way):
    `estimate` is the (non-differentiable) sample mean, `surrogate` a differentiable
    approximation of the same magnetizations — exact marginals when affordable, otherwise
    `ising.mean_field` / `ising.tap` (or one mean-field step: `straight_through_mean_field`).

    **Arguments:** two arrays of the same shape.

    **Returns:** an array equal to `estimate` whose derivatives are those of `surrogate`.
    """
    if jnp.shape(estimate) != jnp.shape(surrogate):
        raise ValueError(
            f"straight_through: estimate {jnp.shape(estimate)} and surrogate "
            f"{jnp.shape(surrogate)} must have the same shape."
        )
    surrogate = jnp.asarray(surrogate)
    return surrogate + jax.lax.stop_gradient(jnp.asarray(estimate, surrogate.dtype) - surrogate)


def straight_through_mean_field(
    estimate: Float[ArrayLike, " n"],
    h: Vector, J: Matrix, *, beta: Scalar = 1.0, K: Tensor3 = None
) -> Float[Array, " n"]:
    """Sampled magnetizations with mean-field gradients: the value of `estimate` (e.g. a
    sample mean m̂), the derivatives of one mean-field step taken at it,
    m̃ = tanh(β(h + J m̂ [+ ½ Ks:m̂m̂])) (`ising.mean_field_update` with m̂ held fixed).

    The surrogate is exact when the couplings vanish and costs one matrix–vector product, so
    it suits training through samplers (Gibbs, parallel tempering, DQA) where a full
    mean-field solve per query would cost more than the sampling.

    **Arguments:** `estimate` `(n,)` (its gradient is stopped), fields `h (n,)`, couplings
    `J (n, n)`, `beta`, optional three-body `K (n, n, n)`.

    **Returns:** `(n,)`, equal to `estimate`.
    """
    from .ising import mean_field_update

    m_hat = jax.lax.stop_gradient(jnp.asarray(estimate))
    return straight_through(m_hat, mean_field_update(m_hat, h, J, beta=beta, K=K))


# ----------------------------------------------------------------------------- vector spins
#
# Vector spins s ∈ ℝ^D on the sphere of radius R with density ∝ exp(β s·θ) (`vector`), and
# the parallel kinetics P(s_t | s_{t−1}) = Π_i p(s_i,t | θ_i = x_i + Σ_j J_ij s_j,t−1) of
# M. Bal, "Spin-Model Transformers" (2023) and "Entropy Production in Non-Equilibrium Neural
# Networks" (2026), mcbal.github.io.

from typing import NamedTuple  # noqa: E402


_VMF_MAX_ROUNDS = 200  # Wood's acceptance rate exceeds 0.65 for every D and κ
_VMF_CHI2_MAX_DIM = 33  # Beta draws from normals up to this D, from gammas above


def _is_concrete(value):
    return not isinstance(value, jax.core.Tracer)


def _check_positive(name, what, value):
    if _is_concrete(value) and np.any(np.asarray(value) <= 0):
        raise ValueError(f"{name}: {what} must be > 0, got {value!r}.")


def _check_vector_field(name, what, theta):
    if jnp.ndim(theta) < 1:
        raise ValueError(f"{name}: {what} must have a trailing vector dimension D, got a "
                         "scalar.")
    if jnp.shape(theta)[-1] < 2:
        raise ValueError(f"{name}: spins on a sphere need D >= 2 components, got D = "
                         f"{jnp.shape(theta)[-1]} ({what} of shape {jnp.shape(theta)}); "
                         "D = 1 is the binary Ising case (`gibbs`).")


def _symmetric_beta(key, D, shape, dt):
    """Beta((D−1)/2, (D−1)/2) variates: X/(X+Y) with X, Y ~ χ²_{D−1} as sums of squared
    normals for small D (far cheaper than JAX's gamma sampler), from gammas otherwise."""
    if D <= _VMF_CHI2_MAX_DIM:
        g = jax.random.normal(key, (2, D - 1) + shape, dt) ** 2
        x, y = jnp.sum(g[0], axis=0), jnp.sum(g[1], axis=0)
        return x / (x + y)
    half = (D - 1.0) / 2.0
    return jax.random.beta(key, half, half, shape, dt)


def _wood_cosine(key, kappa, D):
    """The cosine w = s·μ/R of von Mises–Fisher samples with concentrations `kappa` (a 1-d
    array) on the sphere S^{D−1}, by Wood's (1994) rejection sampler.

    Wood proposes w = (1 − (1+b)z)/(1 − (1−b)z), z ~ Beta((D−1)/2, (D−1)/2),
    b = (D−1)/(2κ + √(4κ² + (D−1)²)), and accepts when
    κw + (D−1) log(1 − x₀w) − c ≥ log u (x₀ = (1−b)/(1+b), c = κx₀ + (D−1) log(1 − x₀²)).
    With q = 1 − (1−b)z, 1 − w = 2bz/q, 1 + w = 2(1−z)/q and 1 − x₀w = 2b/((1+b)q), so the
    test is κ(2b/(1+b) − 2bz/q) + (D−1) log((1+b)/(2q)) ≥ log u: every term is O(1) and free
    of cancellations however large κ is.

    Every spin gets one proposal; the rejected ones (about a third) are then gathered into a
    buffer of N/8 slots and proposed again until none is left, so the work stays ≈ 1.5N
    proposals where re-proposing for all N spins until the last is accepted would cost
    ~log N rounds of N. Returns `(w, 1 − w, 1 + w)`, NaN where nothing was accepted within
    `_VMF_MAX_ROUNDS` rounds (only for non-finite κ).
    """
    (N,) = kappa.shape
    dt = kappa.dtype
    d1 = jnp.asarray(D - 1.0, dt)
    b = d1 / (2.0 * kappa + jnp.sqrt(4.0 * kappa**2 + d1**2))

    def propose(key, k, b_):
        k_z, k_u = jax.random.split(key)
        z = _symmetric_beta(k_z, D, k.shape, dt)
        log_u = jnp.log(jax.random.uniform(k_u, k.shape, dt))
        q = 1.0 - (1.0 - b_) * z
        log_ratio = k * (2.0 * b_ / (1.0 + b_) - 2.0 * b_ * z / q) + d1 * jnp.log(
            (1.0 + b_) / (2.0 * q))
        return z, log_ratio >= log_u

    key, k_first = jax.random.split(key)
    z, done = propose(k_first, kappa, b)
    K = max(1, N // 8)

    def cond(state):
        _, rounds, done, _ = state
        return (rounds < _VMF_MAX_ROUNDS) & ~jnp.all(done)

    def body(state):
        key, rounds, done, z = state
        key, k_round = jax.random.split(key)
        (idx,) = jnp.nonzero(~done, size=K, fill_value=N)  # N: an empty slot
        take = lambda a: jnp.take(a, idx, mode="clip")  # noqa: E731 (an empty slot reads N − 1)
        z_new, accept = propose(k_round, take(kappa), take(b))
        z = z.at[idx].set(z_new, mode="drop")  # empty slots are dropped
        done = done.at[idx].set(accept, mode="drop")
        return key, rounds + 1, done, z

    _, _, done, z = jax.lax.while_loop(cond, body, (key, jnp.zeros((), jnp.int32), done, z))
    z = jnp.where(done, z, jnp.nan)
    q = 1.0 - (1.0 - b) * z
    return (1.0 - (1.0 + b) * z) / q, 2.0 * b * z / q, 2.0 * (1.0 - z) / q


def _vmf(key, theta, beta, R):
    """Samples with the shape of `theta` (..., D); no checks."""
    D = theta.shape[-1]
    sq = jnp.sum(theta * theta, axis=-1)
    pos = sq > 0
    norm = jnp.where(pos, jnp.sqrt(jnp.where(pos, sq, 1.0)), 0.0)
    e1 = jnp.zeros((D,), theta.dtype).at[0].set(1.0)
    mu = jnp.where(pos[..., None], theta / jnp.where(pos, norm, 1.0)[..., None], e1)
    k_w, k_v = jax.random.split(key)
    kappa = (beta * R * norm).reshape(-1)
    w, one_minus_w, one_plus_w = (a.reshape(norm.shape) for a in _wood_cosine(k_w, kappa, D))
    # a uniform direction orthogonal to μ: project a Gaussian vector and normalise it
    # (projected twice: when the Gaussian lies close to ±μ — often in D = 2 — one projection
    # leaves a parallel rounding error that normalising magnifies)
    v = jax.random.normal(k_v, theta.shape, theta.dtype)
    for _ in range(2):
        v = v - jnp.sum(v * mu, axis=-1, keepdims=True) * mu
        v = v / jnp.sqrt(jnp.sum(v * v, axis=-1, keepdims=True))
    sin = jnp.sqrt(jnp.maximum(one_minus_w * one_plus_w, 0.0))
    return R * (w[..., None] * mu + sin[..., None] * v)


def von_mises_fisher(
    key: PRNGKeyArray,
    theta: Float[ArrayLike, "... D"],
    *,
    beta: Scalar = 1.0,
    R: Scalar = 1.0,
    num_samples: int | None = None,
) -> Float[Array, "... D"]:
    """Exact samples of vector spins on the sphere of radius R in ℝ^D with density
    ∝ exp(β s·θ), one independent spin per leading index of θ.

    This is the von Mises–Fisher distribution with mean direction θ/‖θ‖ and concentration
    κ = βR‖θ‖; its mean is `vector.magnetization(theta, beta=beta, R=R, large_d=False)`
    (M. Bal, "Spin-Model Transformers" (2023), App. A.2). The cosine w between s and θ,
    whose density is ∝ exp(κw)(1 − w²)^((D−3)/2) on [−1, 1], is drawn by Wood's rejection
    algorithm (A. T. A. Wood, "Simulation of the von Mises Fisher distribution",
    Communications in Statistics — Simulation and Computation 23, 157 (1994)), with the
    acceptance test rearranged so it stays exact for large κ (tested up to κ = 10⁴ in float32);
    all spins are proposed in parallel and the loop runs until every one is accepted (about
    two rounds on average). The component orthogonal to θ is a uniform direction scaled by
    √(1 − w²). θ = 0 gives the uniform distribution on the sphere.

    **Arguments:**

    - `key`: a PRNG key.
    - `theta`: fields `(..., D)`, D ≥ 2 (D = 1 is the Ising case).
    - `beta`: inverse temperature > 0; `R`: sphere radius > 0 (scalars).
    - `num_samples`: if given, that many independent samples of every spin.

    **Returns:** spins of shape `theta.shape`, or `(num_samples, *theta.shape)`; each has
    norm R (to rounding).
    """
    name = "von_mises_fisher"
    _check_vector_field(name, "theta", theta)
    _check_positive(name, "beta", beta)
    _check_positive(name, "R", R)
    if num_samples is not None:
        _check_int(name, "num_samples", num_samples, 1)
    theta, beta, R = as_float(theta, beta, R)
    if jnp.ndim(beta) or jnp.ndim(R):
        raise ValueError(f"{name}: beta and R must be scalars, got shapes {jnp.shape(beta)} "
                         f"and {jnp.shape(R)}.")
    if num_samples is not None:
        theta = jnp.broadcast_to(theta, (num_samples,) + theta.shape)
    return _vmf(key, theta, beta, R)


class KineticsMoments(NamedTuple):
    """Ensemble averages over parallel chains of the vector kinetics, one row per step
    (`simulate_vector_kinetics`).

    - `mean`: `(steps, n, D)`, the magnetizations m_i,t = ⟨s_i,t⟩.
    - `delayed`: `(steps, n, n)`, the connected delayed correlations
      D_ij,t = ⟨(s_i,t − m_i,t)·(s_j,t−1 − m_j,t−1)⟩, as the unbiased sample covariance
      across chains (centred on the chains' own means, so the noise of those means drops out).
    - `final`: `(num_chains, n, D)`, the last configuration of every chain (to continue).
    """

    mean: Float[Array, "steps n D"]
    delayed: Float[Array, "steps n n"]
    final: Float[Array, "chains n D"]


def simulate_vector_kinetics(
    key: PRNGKeyArray,
    x: Float[ArrayLike, "n D"] | Float[ArrayLike, "steps n D"],
    J: Float[ArrayLike, "n n"],
    *,
    beta: Scalar = 1.0,
    R: Scalar = 1.0,
    steps: int,
    num_chains: int,
    s0: Float[ArrayLike, "n D"] | Float[ArrayLike, "chains n D"] | None = None,
    rao_blackwell: bool = True,
) -> KineticsMoments:
    """Monte Carlo of the kinetic vector-spin model: `num_chains` independent chains of

        P(s_t | s_{t−1}) = Π_i p(s_i,t | θ_i,t),  θ_i,t = x_i,t + Σ_j J_ij s_j,t−1,

    with p(s | θ) ∝ exp(β s·θ) on the sphere of radius R (`von_mises_fisher`): every spin is
    redrawn at once from the previous configuration (a parallel, Little-type update), the
    dynamics whose first-order Plefka[t−1,t] mean field is `vector.mean_field_step` (M. Bal,
    "Spin-Model Transformers" (2023); "Entropy Production in Non-Equilibrium Neural
    Networks" (2026)). Only ensemble averages are kept, one row per step (the trajectory
    itself would take steps·chains·n·D numbers).

    With `rao_blackwell=True` (default) the averages use the exact conditional mean of the
    new spin, E[s_i,t | s_{t−1}] = φ(θ_i,t) (`vector.magnetization(..., large_d=False)`),
    in place of the sampled s_i,t: m_i,t = ⟨φ(θ_i,t)⟩ and ⟨s_i,t·s_j,t−1⟩ = ⟨φ(θ_i,t)·s_j,t−1⟩
    hold exactly, and the estimates have far lower variance (at weak coupling φ(θ_i,t)
    varies by O(βJ) where s_i,t varies by O(R)). The chains themselves always evolve by
    exact sampling. A stationary estimate averages the rows after a burn-in.

    **Arguments:**

    - `key`: a PRNG key.
    - `x`: fields `(n, D)`, constant in time, or `(steps, n, D)`, the field of every step.
    - `J`: couplings `(n, n)` (any matrix); `beta` > 0, `R` > 0: scalars.
    - `steps`: number of updates (Python int ≥ 1); `num_chains`: parallel chains (≥ 2).
    - `s0`: initial configuration `(n, D)` shared by all chains or `(num_chains, n, D)`, on
      the sphere of radius R; default independent uniform spins.
    - `rao_blackwell`: average conditional means (see above) or the sampled spins.

    **Returns:** a `KineticsMoments` with rows t = 1..steps (row 0 is the first update).
    Independent runs (vmap over keys) give independent estimates, hence error bars.
    """
    name = "simulate_vector_kinetics"
    if jnp.ndim(x) not in (2, 3):
        raise ValueError(f"{name}: x must have shape (n, D) or (steps, n, D), got "
                         f"{jnp.shape(x)}.")
    _check_vector_field(name, "x", x)
    n, D = jnp.shape(x)[-2:]
    if jnp.shape(J) != (n, n):
        raise ValueError(f"{name}: J must have shape ({n}, {n}) for x of shape "
                         f"{jnp.shape(x)}, got {jnp.shape(J)}.")
    _check_int(name, "steps", steps, 1)
    _check_int(name, "num_chains", num_chains, 2)
    if jnp.ndim(x) == 3 and jnp.shape(x)[0] != steps:
        raise ValueError(f"{name}: time-dependent x must have steps = {steps} rows, got "
                         f"{jnp.shape(x)[0]}.")
    _check_positive(name, "beta", beta)
    _check_positive(name, "R", R)
    x, J, beta, R = as_float(x, J, beta, R)
    if jnp.ndim(beta) or jnp.ndim(R):
        raise ValueError(f"{name}: beta and R must be scalars, got shapes {jnp.shape(beta)} "
                         f"and {jnp.shape(R)}.")
    from .vector import magnetization

    k0, k_run = jax.random.split(key)
    if s0 is None:
        s = _vmf(k0, jnp.zeros((num_chains, n, D), x.dtype), beta, R)
    else:
        if jnp.shape(s0) not in ((n, D), (num_chains, n, D)):
            raise ValueError(f"{name}: s0 must have shape ({n}, {D}) or ({num_chains}, {n}, "
                             f"{D}), got {jnp.shape(s0)}.")
        s = jnp.broadcast_to(jnp.asarray(s0, x.dtype), (num_chains, n, D))
    xs = jnp.broadcast_to(x, (steps, n, D)) if x.ndim == 2 else x

    def step(s_prev, inp):
        k, x_t = inp
        theta = x_t + jnp.einsum("ij,cjd->cid", J, s_prev, precision=HIGHEST)
        s_new = _vmf(k, theta, beta, R)
        est = magnetization(theta, beta=beta, R=R, large_d=False) if rao_blackwell else s_new
        mean, mean_prev = est.mean(axis=0), s_prev.mean(axis=0)
        raw = jnp.einsum("cid,cjd->ij", est, s_prev, precision=HIGHEST) / num_chains
        delayed = (raw - mean @ mean_prev.T) * (num_chains / (num_chains - 1.0))
        return s_new, (mean, delayed)

    final, (mean, delayed) = jax.lax.scan(step, s, (jax.random.split(k_run, steps), xs))
    return KineticsMoments(mean=mean, delayed=delayed, final=final)
