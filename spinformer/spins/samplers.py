r"""Sampling binary Ising systems (Gibbs, parallel tempering, simulated diabatic quantum
annealing) and vector spins (exact von Mises–Fisher draws, Monte Carlo of the parallel
vector-spin kinetics: `von_mises_fisher`, `simulate_vector_kinetics`, written in
`spins._vector_mc`).

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
    check_int as _check_int,
    check_vector,
    sym3,
    sym_offdiag,
)

from ._vector_mc import KineticsMoments, simulate_vector_kinetics, von_mises_fisher

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
