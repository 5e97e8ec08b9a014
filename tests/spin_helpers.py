"""Independent numpy references for the spin tests: brute-force enumeration, exact Markov-chain
evolution, Monte Carlo. Nothing here imports spinformer."""

from __future__ import annotations

import itertools

import numpy as np


def all_configs(n: int) -> np.ndarray:
    """Every configuration of n binary spins, shape (2^n, n), float64."""
    return np.array(list(itertools.product([-1.0, 1.0], repeat=n)))


def ising_energy_terms(S, h, J, K=None):
    """−E(s) = h·s + Σ_{j<k} J_jk s_j s_k + Σ_{j<k<l} K_jkl s_j s_k s_l for each row of S."""
    n = S.shape[1]
    out = S @ h
    for j, k in itertools.combinations(range(n), 2):
        out = out + J[j, k] * S[:, j] * S[:, k]
    if K is not None:
        for j, k, l in itertools.combinations(range(n), 3):
            out = out + K[j, k, l] * S[:, j] * S[:, k] * S[:, l]
    return out


def ising_exact(h, J, beta, K=None):
    """(log Z, m, C) of the Ising model by brute force in float64."""
    h, J = np.asarray(h, np.float64), np.asarray(J, np.float64)
    K = None if K is None else np.asarray(K, np.float64)
    S = all_configs(len(h))
    a = beta * ising_energy_terms(S, h, J, K)
    amax = a.max()
    w = np.exp(a - amax)
    Z = w.sum()
    p = w / Z
    m = p @ S
    C = (S * p[:, None]).T @ S - np.outer(m, m)
    return np.log(Z) + amax, m, C


def random_symmetric(rng, n, scale):
    A = rng.normal(size=(n, n)) * scale / np.sqrt(n)
    J = (A + A.T) / np.sqrt(2.0)
    np.fill_diagonal(J, 0.0)
    return J


# ----------------------------------------------------------------------------- kinetic Ising


def kinetic_one_step(m_prev, x, J, beta):
    """Exact moments after one step from a factorized state with means m_prev.

    Returns (m, C, D) with C the equal-time and D the delayed connected correlations."""
    n = len(m_prev)
    S = all_configs(n)
    p = np.prod((1.0 + S * m_prev) / 2.0, axis=1)
    T = np.tanh(beta * (x + S @ J.T))  # E[s_t | s_{t-1}] per configuration
    m = p @ T
    C = (T * p[:, None]).T @ T - np.outer(m, m)
    np.fill_diagonal(C, 1.0 - m**2)
    D = (T * p[:, None]).T @ S - np.outer(m, m_prev)
    return m, C, D


def kinetic_transition_matrix(x, J, beta):
    """W[a, b] = P(s_t = S[a] | s_{t-1} = S[b]) over all 2^n configurations S."""
    S = all_configs(len(x))
    H = beta * (x[None, :] + S @ J.T)  # (b, i)
    logp = S @ H.T - np.sum(np.log(2.0 * np.cosh(H)), axis=1)[None, :]  # (a, b)
    return np.exp(logp), S


def kinetic_exact_trajectory(m0, x, J, beta, steps):
    """Exact magnetizations m_1..m_steps starting from a factorized state with means m0."""
    W, S = kinetic_transition_matrix(x, J, beta)
    P = np.prod((1.0 + S * m0) / 2.0, axis=1)
    out = []
    for _ in range(steps):
        P = W @ P
        out.append(P @ S)
    return np.array(out)


def kinetic_monte_carlo(rng, m0, x, J, beta, steps, chains):
    """Average of `chains` independent runs of the kinetic Ising chain, shape (steps, n),
    and the standard error of each entry."""
    n = len(m0)
    s = np.where(rng.random((chains, n)) < (1.0 + m0) / 2.0, 1.0, -1.0)
    means, errs = [], []
    for _ in range(steps):
        H = beta * (x[None, :] + s @ J.T)
        p_up = 0.5 * (1.0 + np.tanh(H))
        s = np.where(rng.random((chains, n)) < p_up, 1.0, -1.0)
        means.append(s.mean(0))
        errs.append(s.std(0) / np.sqrt(chains))
    return np.array(means), np.array(errs)


def kinetic_stationary(x, J, beta):
    """Stationary distribution π, the transition matrix W and the configurations S."""
    W, S = kinetic_transition_matrix(x, J, beta)
    vals, vecs = np.linalg.eig(W)
    pi = np.real(vecs[:, np.argmin(np.abs(vals - 1.0))])
    pi = pi / pi.sum()
    return pi, W, S


# ----------------------------------------------------------------------------- vector spins


def sphere_moments_importance(rng, theta, beta, R, samples):
    """Mean and covariance of s on the sphere of radius R with density ∝ exp(β s·θ), by
    self-normalized importance sampling from the uniform distribution on the sphere."""
    D = len(theta)
    u = rng.normal(size=(samples, D))
    s = R * u / np.linalg.norm(u, axis=1, keepdims=True)
    a = beta * s @ theta
    w = np.exp(a - a.max())
    w = w / w.sum()
    mean = w @ s
    cov = (s * w[:, None]).T @ s - np.outer(mean, mean)
    ess = 1.0 / np.sum(w**2)
    return mean, cov, ess
