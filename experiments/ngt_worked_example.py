"""The NeuroGame Transformer's worked example recomputed, and what its Monte Carlo
estimators converge to (D. Bouchaffra, F. Ykhlef, H. Azzag, M. Lebbah, B. Faye,
"NeuroGame Transformer: Gibbs-Inspired Attention Driven by Game Theory and Statistical
Physics"; NGT below).

    python experiments/ngt_worked_example.py run          # both reports (1-2 minutes on CPU)
    python experiments/ngt_worked_example.py run --quick  # smaller sample sizes (a smoke test)

`worked_example.md`: NGT §5 ("not good movie", three tokens): the coalition values as given,
their exact Shapley values, Banzhaf indices and interactions, every printed number of the
example beside our recomputation (holds / does not hold, and why), the mean-field iterations
from the printed fields and couplings continued to their fixed point, the exact Boltzmann
marginals, and what Algorithm 1 (`coalitions.ngt_estimates`) gives on this game at large K.

`estimators.md`: on random norm games v(C) = ‖Σ_{i∈C} V_i‖ (Algorithm 1's v), Algorithm 1's
three estimators at K = 2^14 draws against the exact Shapley values, Banzhaf indices and
interactions and against the Gibbs-tilted averages they converge to, at γ = 0.25, 1, 100;
and the finite-K bias of self-normalisation (the mean estimate from K = 1 to 1024 draws
against the leading-order formula).

Everything runs in float64. Both files go to `--results` (default
`experiments/results/ngt`).
"""

from __future__ import annotations

import sys
import itertools
import math
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np

from spinformer.spins import coalitions as co
from spinformer.spins import ising

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _cli import dispatch, make_parser, run_script  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent
CITE = ("D. Bouchaffra, F. Ykhlef, H. Azzag, M. Lebbah, B. Faye, \"NeuroGame Transformer: "
        "Gibbs-Inspired Attention Driven by Game Theory and Statistical Physics\"")

# ----------------------------------------------------------------------------- the example

TOKENS = ("t1 'not'", "t2 'good'", "t3 'movie'")
# NGT §5.1: v on every coalition of {t1, t2, t3} (players 0, 1, 2)
VALUES = {(): 0.0, (0,): 0.2, (1,): 0.5, (2,): 0.4, (0, 1): 1.2, (0, 2): 0.8, (1, 2): 1.0,
          (0, 1, 2): 1.8}
GAMMA = 1.0
LAMBDA_2 = 0.6
# printed fields and couplings used by the mean-field section (§5.1.2, "suppose we obtain")
H_PRINTED = np.array([0.423, 0.711, 0.512])
J_PRINTED = {(0, 1): 0.466, (0, 2): 0.312, (1, 2): 0.278}
S_PRINTED = {1: (0.400, 0.611, 0.471), 2: (0.693, 0.773, 0.668), 5: (0.721, 0.798, 0.703)}
ALPHA_PRINTED = (0.861, 0.899, 0.852)


def table_game(values: dict, n: int):
    """A game from the values of every coalition (a dict keyed by sorted player tuples)."""
    table = np.zeros(2**n)
    for C, x in values.items():
        table[sum(1 << i for i in C)] = x
    table = jnp.asarray(table)
    powers = jnp.asarray(2 ** np.arange(n), jnp.int32)
    return lambda masks: table[jnp.sum(masks.astype(jnp.int32) * powers, axis=-1)]


def v_of(*players) -> float:
    return VALUES[tuple(sorted(players))]


def delta_i(i, C) -> float:
    return v_of(*C, i) - v_of(*C)


def delta_ij(i, j, C) -> float:
    return v_of(*C, i, j) - v_of(*C, i) - v_of(*C, j) + v_of(*C)


def snis(raw, deltas):
    raw = np.asarray(raw, np.float64)
    w = raw / raw.sum()
    return float(w @ np.asarray(deltas)), w


def mean_field_iterations(h, J, gamma, steps):
    """Plain fixed-point iteration s ← tanh((h + J s)/γ) from s = 0; all iterates."""
    s = np.zeros_like(h)
    out = [s]
    for _ in range(steps):
        s = np.tanh((h + J @ s) / gamma)
        out.append(s)
    return out


def _fmt(x, d=3):
    return "/".join(f"{v:.{d}f}" for v in np.atleast_1d(x))


def _verdict(ok: bool) -> str:
    return "holds" if ok else "**does not hold**"


def _close(printed, ours, tol):
    return bool(np.all(np.abs(np.asarray(printed) - np.asarray(ours)) <= tol))


def worked_example(num_samples: int) -> str:
    n = 3
    game = table_game(VALUES, n)
    phi = np.asarray(co.shapley(game, n))
    beta = np.asarray(co.banzhaf(game, n))
    J = np.asarray(co.interactions(game, n))
    tilt_b = np.asarray(co.gibbs_banzhaf(game, n, gamma=GAMMA))
    tilt_J = np.asarray(co.gibbs_interactions(game, n, gamma=GAMMA))
    phi_norm, beta_norm = phi / phi.sum(), beta / beta.sum()

    # --- the three printed samples, C1 = {t2}, C2 = {t1, t3}, C3 = {t2, t3}
    samples = [(1,), (0, 2), (1, 2)]
    e = np.exp([v_of(*C) / GAMMA for C in samples])
    Z = e.sum()
    w = e / Z
    w_printed = np.array([0.25, 0.34, 0.41])
    d2_printed = [0.5, 1.0, 0.6]
    phi2_printed = float(w_printed @ d2_printed)
    phi2_unrounded = float(w @ d2_printed)
    # what the printed marginals are: Δ_2 of the context C ∖ {t2}
    ctx2 = [tuple(k for k in C if k != 1) for C in samples]
    d2_ctx = [delta_i(1, C) for C in ctx2]
    # Algorithm 1's Shapley branch on the same three contexts: weight e^{v(P)/γ}/p with
    # p = |P|!(m−1−|P|)!/(m−1)!
    m = n
    p_shap = [math.factorial(len(P)) * math.factorial(m - 1 - len(P)) / math.factorial(m - 1)
              for P in ctx2]
    phi2_alg1, w_alg1 = snis(np.exp([v_of(*P) / GAMMA for P in ctx2]) / p_shap, d2_ctx)
    beta2_alg1, w_ban = snis(np.exp([v_of(*P) / GAMMA for P in ctx2]), d2_ctx)
    # eq. 6 with normalised values (exact game values)
    J2_eq6 = LAMBDA_2 * phi_norm[1] + (1 - LAMBDA_2) * beta_norm[1]
    J1_range = sorted([phi_norm[0], beta_norm[0]])
    J3_range = sorted([phi_norm[2], beta_norm[2]])
    # the pair (t1, t2): contexts C ∖ {t1, t2}
    d12_printed = [0.5, 0.4, 0.5]
    J12_printed_arith = float(w_printed @ d12_printed)
    ctx12 = [tuple(k for k in C if k not in (0, 1)) for C in samples]
    d12_ctx = [delta_ij(0, 1, C) for C in ctx12]
    J12_fixed = float(w_printed @ d12_ctx)
    J12_alg1, _ = snis(np.exp([v_of(*C) / GAMMA for C in ctx12]), d12_ctx)

    # --- mean field from the printed J's
    Jm = np.zeros((n, n))
    for (i, j), x in J_PRINTED.items():
        Jm[i, j] = Jm[j, i] = x
    iters = mean_field_iterations(H_PRINTED, Jm, GAMMA, 200)
    fixed = iters[-1]
    steps_to_fixed = next(t for t in range(1, 200)
                          if np.max(np.abs(iters[t] - iters[t - 1])) < 1e-6)
    mf = np.asarray(ising.mean_field(jnp.asarray(H_PRINTED), jnp.asarray(Jm),
                                     beta=1.0 / GAMMA).value)
    exact_m = np.asarray(ising.exact_marginals(jnp.asarray(H_PRINTED), jnp.asarray(Jm),
                                               beta=1.0 / GAMMA))
    alpha_fixed, alpha_exact = (1 + fixed) / 2, (1 + exact_m) / 2

    # --- Algorithm 1 at large K on this game
    est = co.ngt_estimates(game, n, key=jax.random.key(0), num_samples=num_samples,
                           gamma=GAMMA)

    # --- the pipeline run on computed numbers (λ_i = 0.6 for every token: an assumption)
    def pipeline(field_phi, field_beta, couplings):
        h = LAMBDA_2 * field_phi / field_phi.sum() + (1 - LAMBDA_2) * field_beta / field_beta.sum()
        s_mf = mean_field_iterations(h, couplings, GAMMA, 200)[-1]
        s_ex = np.asarray(ising.exact_marginals(jnp.asarray(h), jnp.asarray(couplings),
                                                beta=1.0 / GAMMA))
        return h, (1 + s_mf) / 2, (1 + s_ex) / 2

    pipe_exact = pipeline(phi, beta, J)
    pipe_alg1 = pipeline(tilt_b, tilt_b, tilt_J)

    r = []  # (what, printed, ours, verdict, why)
    tol = 0.006  # printed numbers carry 2-3 decimals
    for k, C in enumerate(samples):
        r.append((f"e^{{v(C{k + 1})/γ}}", f"{[1.65, 2.23, 2.72][k]:.2f}", f"{e[k]:.4f}",
                  _verdict(_close([1.65, 2.23, 2.72][k], e[k], tol)), "rounding"))
    r.append(("Z", "6.60", f"{Z:.4f}", _verdict(_close(6.60, Z, 0.01)),
              "6.60 is the sum of the rounded terms"))
    r.append(("w̄(C1..C3)", "0.25/0.34/0.41", _fmt(w, 4), _verdict(_close(w_printed, w, tol)),
              "rounding"))
    r.append(("Δ_2(C1)", "0.5", f"{d2_ctx[0]:.1f}", "holds as arithmetic",
              "C1 = {t2} contains t2, so it is no context of t2; the printed value is "
              "Δ_2(∅) = v({t2}) − v(∅), i.e. C1 is read as P ∪ {t2} with P = ∅"))
    r.append(("Δ_2(C2)", "1.0", f"{d2_ctx[1]:.1f}", "holds", "C2 = {t1, t3} is a context of t2"))
    r.append(("Δ_2(C3)", "0.6", f"{d2_ctx[2]:.1f}", "holds as arithmetic",
              "C3 = {t2, t3} contains t2; the printed value is Δ_2({t3}), C3 read as "
              "P ∪ {t2} again (but C2 is read as P)"))
    r.append(("φ̂_2", "0.711", f"{phi2_printed:.3f} ({phi2_unrounded:.3f} unrounded)",
              "holds as arithmetic; **not Algorithm 1**",
              "the weights use v of C1, C3 (which contain t2) instead of v of the prefix P, "
              "and omit p. Algorithm 1 on the same prefixes P = ∅, {t1,t3}, {t3} "
              f"(p = {_fmt(p_shap, 2)}) weights them {_fmt(w_alg1)} and gives "
              f"φ̂_2 = {phi2_alg1:.3f}. Exact φ_2 = {phi[1]:.3f}"))
    r.append(("β̂_2 (\"identical\")", "0.711", f"{beta2_alg1:.3f}",
              "**does not hold**",
              "C1 and C3 contain t2 and cannot be Bernoulli coalitions of the others. On the "
              f"contexts ∅, {{t1,t3}}, {{t3}} the Banzhaf branch weights e^{{v(C)/γ}} "
              f"({_fmt(w_ban)}) give {beta2_alg1:.3f}; the two branches differ on the same "
              f"contexts (they differ by 1/p). Exact β_2 = {beta[1]:.3f}"))
    r.append(("J_2 = λ_2 φ̂^norm_2 + (1−λ_2) β̂^norm_2", "0.711", f"{J2_eq6:.3f}",
              "**does not hold**",
              "eq. 6 takes normalised values; 0.711 is the unnormalised estimate. With the "
              f"exact values φ^norm_2 = {phi_norm[1]:.3f}, β^norm_2 = {beta_norm[1]:.3f}"))
    r.append(("J_1, J_3", "0.423, 0.512", f"{J1_range[0]:.3f}–{J1_range[1]:.3f}, "
              f"{J3_range[0]:.3f}–{J3_range[1]:.3f}", "assumed (\"suppose\")",
              "eq. 6 with the exact values gives these ranges for any λ_i in [0, 1], and the "
              f"unnormalised values used for J_2 give {phi[0]:.3f}–{beta[0]:.3f}: neither "
              "0.423 nor 0.512 is reachable"))
    r.append(("Δ_12(C1)", "0.5", f"{d12_ctx[0]:.1f}", "holds", "context C1 ∖ {t1,t2} = ∅"))
    r.append(("Δ_12(C2)", "0.4", f"{d12_ctx[1]:.1f}", "holds", "context C2 ∖ {t1} = {t3}"))
    r.append(("Δ_12(C3)", "0.5", f"{d12_ctx[2]:.1f}", "**does not hold**",
              "C3 = {t2, t3} contains t2; its context C3 ∖ {t1,t2} = {t3} gives "
              "Δ_12({t3}) = 1.8 − 0.8 − 1.0 + 0.4 = 0.4; the printed 0.5 is Δ_12(∅)"))
    r.append(("Ĵ_12", "0.466", f"{J12_printed_arith:.3f} (arithmetic); {J12_fixed:.3f} "
              f"with Δ_12(C3) = 0.4", "holds as arithmetic only",
              "with Δ_12(C3) corrected it is "
              f"{J12_fixed:.3f}; Algorithm 1 weights the contexts (∅, {{t3}}, {{t3}}) by "
              f"e^{{v(C)/γ}}, giving {J12_alg1:.3f}. Exact J_12 = {J[0, 1]:.3f}, Gibbs-tilted "
              f"limit {tilt_J[0, 1]:.3f}"))
    r.append(("Ĵ_13, Ĵ_23", "0.312, 0.278", f"{J[0, 2]:.3f}, {J[1, 2]:.3f}",
              "assumed (\"suppose\")",
              f"exact J_13, J_23 of the game; Gibbs-tilted limits {tilt_J[0, 2]:.3f}, "
              f"{tilt_J[1, 2]:.3f}"))
    for t in (1, 2):
        r.append((f"⟨s⟩ after iteration {t}", _fmt(S_PRINTED[t]), _fmt(iters[t]),
                  _verdict(_close(S_PRINTED[t], iters[t], 0.0015)),
                  "tanh((J_i + Σ_j J_ij s_j)/γ) from s = 0 with the printed J's"))
    r.append(("⟨s⟩ \"converged after T = 5\"", _fmt(S_PRINTED[5]),
              f"iteration 5: {_fmt(iters[5])}; fixed point {_fmt(fixed)}",
              "**does not hold**",
              f"iteration 5 is {np.max(np.abs(iters[5] - fixed)):.3f} from the fixed point "
              f"(reached to 1e-6 after {steps_to_fixed} iterations; ising.mean_field gives "
              f"{_fmt(mf)}); the printed values are neither. They are close to the exact "
              f"Boltzmann marginals of the same Ising model, {_fmt(exact_m)}, but do not match "
              "them either"))
    r.append(("α = (1 + ⟨s⟩)/2", _fmt(ALPHA_PRINTED),
              f"from the printed ⟨s⟩: {_fmt((1 + np.array(S_PRINTED[5])) / 2)}; fixed point: "
              f"{_fmt(alpha_fixed)}; exact: {_fmt(alpha_exact)}",
              "arithmetic holds; values **do not hold**",
              "they follow from the printed ⟨s⟩, which the iteration does not produce"))

    lines = [
        "# NGT worked example (§5, \"not good movie\") recomputed",
        "",
        f"Source: {CITE}, §5. Generated by `experiments/ngt_worked_example.py` (float64, "
        f"γ = {GAMMA:g}).",
        "",
        "## The game",
        "",
        "| coalition | ∅ | {t1} | {t2} | {t3} | {t1,t2} | {t1,t3} | {t2,t3} | {t1,t2,t3} |",
        "|---|---|---|---|---|---|---|---|---|",
        "| v | " + " | ".join(f"{VALUES[C]:g}" for C in VALUES) + " |",
        "",
        "Its exact values (`coalitions.shapley`, `banzhaf`, `interactions`; Σφ = v(N) = "
        f"{phi.sum():.3f}):",
        "",
        "| token | φ (Shapley) | β (Banzhaf) | φ^norm | β^norm | β^γ (Gibbs-tilted, γ = 1) |",
        "|---|---|---|---|---|---|",
    ]
    for i in range(n):
        lines.append(f"| {TOKENS[i]} | {phi[i]:.4f} | {beta[i]:.4f} | {phi_norm[i]:.4f} | "
                     f"{beta_norm[i]:.4f} | {tilt_b[i]:.4f} |")
    lines += [
        "",
        "| pair | J (uniform contexts, eq. 9) | J^γ (Gibbs-tilted, γ = 1) |",
        "|---|---|---|",
    ]
    for (i, j) in ((0, 1), (0, 2), (1, 2)):
        lines.append(f"| t{i + 1}, t{j + 1} | {J[i, j]:.4f} | {tilt_J[i, j]:.4f} |")
    lines += [
        "",
        "## Every printed number",
        "",
        "The example samples C1 = {t2}, C2 = {t1, t3}, C3 = {t2, t3} and reuses them for the "
        "Shapley value, the Banzhaf index of t2 and the pair (t1, t2).",
        "",
        "| printed quantity | printed | recomputed | verdict | why |",
        "|---|---|---|---|---|",
    ]
    lines += [f"| {a} | {b} | {c} | {d} | {e_} |" for a, b, c, d, e_ in r]
    lines += [
        "",
        "## Mean field from the printed fields and couplings",
        "",
        "h = (0.423, 0.711, 0.512), J_12 = 0.466, J_13 = 0.312, J_23 = 0.278, γ = 1, "
        "s⁽⁰⁾ = 0 (plain iteration, as NGT eq. 25):",
        "",
        "| iteration | ⟨s_1⟩ | ⟨s_2⟩ | ⟨s_3⟩ | printed |",
        "|---|---|---|---|---|",
    ]
    for t in (1, 2, 3, 4, 5, 10, steps_to_fixed):
        pr = _fmt(S_PRINTED[t]) if t in S_PRINTED else ""
        lines.append(f"| {t} | " + " | ".join(f"{x:.4f}" for x in iters[t]) + f" | {pr} |")
    lines += [
        "| `ising.mean_field` (Anderson) | " + " | ".join(f"{x:.4f}" for x in mf) + " | |",
        "| exact Boltzmann marginals (`ising.exact_marginals`) | "
        + " | ".join(f"{x:.4f}" for x in exact_m) + " | |",
        "",
        f"Attention α = (1 + ⟨s⟩)/2: fixed point {_fmt(alpha_fixed)}, exact "
        f"{_fmt(alpha_exact)}, printed {_fmt(ALPHA_PRINTED)}. The ranking t2 > t1 > t3 that "
        "the example draws from α holds for all three.",
        "",
        "## Algorithm 1 on this game",
        "",
        f"`coalitions.ngt_estimates` with K = {num_samples} draws per token and per pair, "
        f"γ = {GAMMA:g}, against the exact values and the Gibbs-tilted limits:",
        "",
        "| token | Shapley branch φ̂ | Banzhaf branch β̂ | β^γ (limit of both) | φ exact | "
        "β exact |",
        "|---|---|---|---|---|---|",
    ]
    for i in range(n):
        lines.append(f"| {TOKENS[i]} | {est.shapley[i]:.4f} | {est.banzhaf[i]:.4f} | "
                     f"{tilt_b[i]:.4f} | {phi[i]:.4f} | {beta[i]:.4f} |")
    lines += ["", "| pair | Ĵ | J^γ (limit) | J exact |", "|---|---|---|---|"]
    for (i, j) in ((0, 1), (0, 2), (1, 2)):
        lines.append(f"| t{i + 1}, t{j + 1} | {est.interactions[i, j]:.4f} | "
                     f"{tilt_J[i, j]:.4f} | {J[i, j]:.4f} |")
    lines += [
        "",
        "Both branches land on the same Gibbs-tilted average β^γ, above both the Shapley value "
        "and the Banzhaf index here (the tilt favours large coalitions, whose marginal "
        "contributions are larger in this game).",
        "",
        "## The pipeline on computed numbers",
        "",
        "With the fields of eq. 6 computed rather than supposed (λ_i = 0.6 for every token — an "
        "assumption: the example gives λ_2 only), γ = 1:",
        "",
        "| inputs | fields J_i | α mean field (fixed point) | α exact |",
        "|---|---|---|---|",
        f"| exact φ, β, J | {_fmt(pipe_exact[0])} | {_fmt(pipe_exact[1])} | "
        f"{_fmt(pipe_exact[2])} |",
        f"| Algorithm 1's K → ∞ limits (β^γ for both, J^γ) | {_fmt(pipe_alg1[0])} | "
        f"{_fmt(pipe_alg1[1])} | {_fmt(pipe_alg1[2])} |",
        "",
    ]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- estimators


def random_norm_game(seed: int, n: int, d: int):
    V = np.random.default_rng(seed).normal(size=(n, d)) / np.sqrt(d)
    return co.NormGame(jnp.asarray(V), "identity")


def leading_bias(game: co.NormGame, n: int, i: int, gamma: float):
    """Exact O(1/K) term of both self-normalised branches for player i (all players):
    E[estimate] ≈ μ − E_q[w̃²(Δ − μ)]/K with w̃ = (g/q)/E_q[g/q], g = e^{v/γ}."""
    others = [k for k in range(n) if k != i]
    m = n
    ctx = [C for r in range(m) for C in itertools.combinations(others, r)]
    masks = np.zeros((len(ctx), n), bool)
    for a, C in enumerate(ctx):
        masks[a, list(C)] = True
    with_i = masks.copy()
    with_i[:, i] = True
    v0 = np.asarray(game(jnp.asarray(masks)))
    delta = np.asarray(game(jnp.asarray(with_i))) - v0
    g = np.exp((v0 - v0.max()) / gamma)
    mu = float(g @ delta / g.sum())
    size = masks.sum(1)
    q_shap = np.array([math.factorial(s) * math.factorial(m - 1 - s) / math.factorial(m)
                       for s in size])
    q_ban = np.full(len(ctx), 2.0 ** -(m - 1))
    out = {}
    for name, q in (("shapley", q_shap), ("banzhaf", q_ban)):
        wt = g / g.sum() / q  # g/q scaled so that E_q[w̃] = 1
        out[name] = float(np.sum(q * wt**2 * (delta - mu)))
        out[name + "_k1"] = float(q @ delta)  # the K = 1 expectation: E_q[Δ]
    return mu, out


def estimators(num_samples: int, reps: int, seeds=(0, 1, 2), n: int = 8, d: int = 4) -> str:
    gammas = (0.25, 1.0, 100.0)
    ngt = jax.jit(lambda g, key, gamma: co.ngt_estimates(g, n, key=key,
                                                         num_samples=num_samples, gamma=gamma))
    off = ~np.eye(n, dtype=bool)
    rows, detail = [], []
    for seed in seeds:
        game = random_norm_game(seed, n, d)
        phi = np.asarray(co.shapley(game, n))
        beta = np.asarray(co.banzhaf(game, n))
        J = np.asarray(co.interactions(game, n))
        for gamma in gammas:
            tb = np.asarray(co.gibbs_banzhaf(game, n, gamma=gamma))
            tJ = np.asarray(co.gibbs_interactions(game, n, gamma=gamma))
            ests = [ngt(game, jax.random.key(100 * seed + k), gamma) for k in range(4)]
            e = ests[0]
            spread = max(np.std([np.asarray(x.shapley) for x in ests], axis=0, ddof=1).max(),
                         np.std([np.asarray(x.banzhaf) for x in ests], axis=0, ddof=1).max())

            def mx(a, b, mask=None):
                diff = np.abs(np.asarray(a) - np.asarray(b))
                return diff[mask].max() if mask is not None else diff.max()

            rows.append((seed, gamma, mx(e.shapley, tb), mx(e.banzhaf, tb),
                         mx(e.interactions, tJ, off), spread, mx(e.shapley, phi),
                         mx(e.banzhaf, beta), mx(e.interactions, J, off), mx(tb, phi),
                         mx(tb, beta), np.abs(phi).max(), np.abs(J[off]).max()))
            if seed == seeds[0]:
                detail.append((gamma, np.asarray(e.shapley), np.asarray(e.banzhaf), tb))
        if seed == seeds[0]:
            detail_exact = (phi, beta)
            game0 = game

    # finite-K bias on the first game, γ = 1, the player where β^γ − φ is largest
    gamma = 1.0
    tb0 = np.asarray(co.gibbs_banzhaf(game0, n, gamma=gamma))
    i = int(np.argmax(np.abs(tb0 - detail_exact[0])))
    mu, lead = leading_bias(game0, n, i, gamma)
    bias_rows = []
    for K in (1, 2, 4, 8, 16, 64, 256, 1024):
        # the spread shrinks like 1/√K: fewer runs at large K give a similar standard error
        R = max(reps * 16 // max(K, 16), min(reps, 500))
        f = jax.jit(lambda keys, K=K: jax.lax.map(
            lambda key: co.ngt_estimates(game0, n, key=key, num_samples=K, gamma=gamma)[:2],
            keys, batch_size=max(1, 4096 // K)))
        sh, bz = (np.asarray(x)[:, i] for x in f(jax.random.split(jax.random.key(K), R)))
        bias_rows.append((K, R, sh.mean(), sh.std(ddof=1) / np.sqrt(R),
                          mu - lead["shapley"] / K, bz.mean(), bz.std(ddof=1) / np.sqrt(R),
                          mu - lead["banzhaf"] / K))

    lines = [
        "# What NGT's Gibbs-weighted estimators converge to",
        "",
        f"Source: {CITE}, §4.2.1 (eqs. 31–36), §4.3 and Algorithm 1. Generated by "
        "`experiments/ngt_worked_example.py` (float64).",
        "",
        "## The claim and the derivation",
        "",
        "NGT weights each sampled coalition by e^{v(C)/γ}/p(C), p the proposal probability, "
        "normalises the K weights to sum to one, and calls the results unbiased and consistent "
        "estimates of the Shapley value, the Banzhaf index and the interactions. A "
        "self-normalised importance-sampling average with proposal q and unnormalised target g "
        "converges to the average under the target: Σ_k w_k Δ_k / Σ_k w_k → "
        "E_q[(g/q)Δ]/E_q[g/q] = Σ_C g(C)Δ(C) / Σ_C g(C). With m players:",
        "",
        "- **Banzhaf branch**: q = 2^-(m−1) is constant, so the limit is the Gibbs-tilted "
        "average β^γ_i = Σ_{C⊆N∖{i}} e^{v(C)/γ} Δ_i(C) / Σ_{C⊆N∖{i}} e^{v(C)/γ} "
        "(`coalitions.gibbs_banzhaf`), not β_i.",
        "- **Shapley branch**: r uniform in {0, …, m−1} then a uniform r-subset draws P with "
        "q(P) = r!(m−1−r)!/(m·(m−1)!) = p(P)/m. The weight e^{v/γ}/p is ∝ e^{v/γ}/q, so the "
        "limit is the **same** β^γ_i: the 1/p factor removes the Shapley weighting that the "
        "proposal carries. As γ → ∞ the Shapley branch tends to the Banzhaf index; it is "
        "consistent for the Shapley value at no temperature (unless φ = β).",
        "- **Pair branch**: the limit is J^γ_ij = Σ_{C⊆N∖{i,j}} e^{v(C)/γ} Δ_ij(C) / Σ e^{v(C)/γ} "
        "(`coalitions.gibbs_interactions`), which tends to J only as γ → ∞.",
        "- **Finite K**: self-normalisation adds a bias −E_q[w̃²(Δ − μ)]/K + O(1/K²) "
        "(w̃ the weight scaled to mean one under q, μ the limit). At K = 1 the single weight "
        "is 1, so the K = 1 expectation is E_q[Δ]: exactly φ_i for the Shapley branch and β_i "
        "for the Banzhaf branch. The estimators are unbiased only at K = 1 and drift to the "
        "tilted limit as K grows.",
        "",
        "## Summary",
        "",
        *summary(rows, gammas, num_samples, n, len(seeds), bias_rows, i, detail_exact, mu),
        "",
        f"## Numbers: K = {num_samples} draws per player and per pair",
        "",
        f"Random norm games v(C) = ‖Σ_{{i∈C}} V_i‖ (Algorithm 1's v), n = {n}, V_i ~ "
        f"N(0, I/{d}) in R^{d}, seeds {', '.join(map(str, seeds))}. Columns: max over players "
        "(pairs) of the absolute difference. `noise` is the largest standard deviation of φ̂ "
        "and β̂ over 4 independent keys (the Monte Carlo error at this K).",
        "",
        "| seed | γ | φ̂ − β^γ | β̂ − β^γ | Ĵ − J^γ | noise | **φ̂ − φ** | **β̂ − β** | "
        "**Ĵ − J** | β^γ − φ (exact) | β^γ − β (exact) | max φ | max J |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(f"| {row[0]} | {row[1]:g} | " + " | ".join(f"{x:.4f}" for x in row[2:])
                     + " |")
    lines += [
        "",
        f"Per player, seed {seeds[0]}:",
        "",
        "| player | φ | β | " + " | ".join(f"φ̂ (γ={g:g}) | β̂ (γ={g:g}) | β^γ (γ={g:g})"
                                          for g, *_ in detail) + " |",
        "|---|---|---|" + "---|" * (3 * len(detail)),
    ]
    for k in range(n):
        cells = [f"{detail_exact[0][k]:.4f}", f"{detail_exact[1][k]:.4f}"]
        for _, sh, bz, tb in detail:
            cells += [f"{sh[k]:.4f}", f"{bz[k]:.4f}", f"{tb[k]:.4f}"]
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
    lines += [
        "",
        f"## Finite K: the mean estimate for player {i} of seed {seeds[0]}, γ = {gamma:g}",
        "",
        "Mean over R independent runs (± standard error) against the leading-order "
        f"prediction μ − c/K. Exact: φ_{i} = {detail_exact[0][i]:.4f}, β_{i} = "
        f"{detail_exact[1][i]:.4f}, limit μ = β^γ_{i} = {mu:.4f}; c = {lead['shapley']:.4f} "
        f"(Shapley branch), {lead['banzhaf']:.4f} (Banzhaf branch). The K = 1 expectations "
        f"E_q[Δ] are {lead['shapley_k1']:.4f} and {lead['banzhaf_k1']:.4f} (= φ_{i}, β_{i}).",
        "",
        "| K | R | Shapley branch mean | μ − c/K | Banzhaf branch mean | μ − c/K |",
        "|---|---|---|---|---|---|",
    ]
    for K, R, sm, se, sp, bm, be, bp in bias_rows:
        lines.append(f"| {K} | {R} | {sm:.4f} ± {se:.4f} | {sp:.4f} | {bm:.4f} ± {be:.4f} | "
                     f"{bp:.4f} |")
    lines.append("")
    return "\n".join(lines)


def summary(rows, gammas, num_samples, n, num_games, bias_rows, i, exact, mu):
    """The finding in a few sentences, from the rows of the tables below."""
    rows = np.array([r for r in rows], dtype=float)
    out = []
    for gamma in gammas:
        sel = rows[rows[:, 1] == gamma]
        to_limit = sel[:, 2:5].max()
        noise = sel[:, 5].max()
        miss_phi = (sel[:, 6].min(), sel[:, 6].max())
        miss_beta = (sel[:, 7].min(), sel[:, 7].max())
        miss_J = (sel[:, 8].min(), sel[:, 8].max())
        out.append(
            f"- γ = {gamma:g}: all three estimators are within {to_limit:.4f} of the "
            f"Gibbs-tilted limits (Monte Carlo spread up to {noise:.4f}); the Shapley branch "
            f"misses φ by {miss_phi[0]:.3f}–{miss_phi[1]:.3f}, the Banzhaf branch misses β by "
            f"{miss_beta[0]:.4f}–{miss_beta[1]:.4f}, the pair branch misses J by "
            f"{miss_J[0]:.4f}–{miss_J[1]:.4f} (max over entries, range over the games).")
    k1 = bias_rows[0]
    out = [
        f"On {num_games} random norm games with n = {n} and K = {num_samples} draws, NGT's "
        "estimators converge to the Gibbs-tilted averages, not to the Shapley value and the "
        "Banzhaf index:",
        "",
        *out,
        "",
        "At γ = 100 the tilt is negligible: the Banzhaf and pair branches become consistent for "
        "β and J, while the Shapley branch still converges to β, missing φ by the full "
        "|β − φ|. At γ ≤ 1 all three are biased by an amount comparable to the values "
        "themselves.",
        "",
        f"Finite K (player {i} of the first game, γ = 1): the Shapley branch's mean is "
        f"{k1[2]:.4f} ± {k1[3]:.4f} at K = 1 (φ = {exact[0][i]:.4f}: one draw is plain "
        f"permutation sampling) and {bias_rows[-1][2]:.4f} ± {bias_rows[-1][3]:.4f} at "
        f"K = {bias_rows[-1][0]} (β^γ = {mu:.4f}); the Banzhaf branch's mean goes from "
        f"{k1[5]:.4f} ± {k1[6]:.4f} (β = {exact[1][i]:.4f}) to {bias_rows[-1][5]:.4f} ± "
        f"{bias_rows[-1][6]:.4f}. From K ≈ 4 on the drift follows the leading-order "
        "self-normalisation bias μ − c/K.",
    ]
    return out


def main(argv=None):
    parser = make_parser(__doc__, runs=False, results="ngt", commands=("run",))
    parser.add_argument("--quick", action="store_true", help="small sample sizes (smoke test)")
    dispatch(parser.parse_args(argv), run=run)


def run(args):
    args.results = pathlib.Path(args.results)
    args.results.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    with jax.enable_x64(True):
        we = worked_example(2**10 if args.quick else 2**18)
        (args.results / "worked_example.md").write_text(we)
        est = (estimators(2**8, 200, seeds=(0,)) if args.quick
               else estimators(2**14, 20000))
        (args.results / "estimators.md").write_text(est)
    print(f"wrote {args.results} in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    run_script(main)
