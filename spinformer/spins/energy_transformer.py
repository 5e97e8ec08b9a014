r"""The Energy Transformer's energy and its token dynamics (B. Hoover, Y. Liang, B. Pham,
R. Panda, H. Strobelt, D. H. Chau, M. J. Zaki, D. Krotov, "Energy Transformer", NeurIPS 2023,
arXiv:2302.07253).

N tokens x_A ∈ R^D (the rows of `x (N, D)`) go through an energy-based layer norm, the
gradient of the Lagrangian

    L(x_A) = D γ sqrt(var(x_A) + ε) + δ·x_A,   g_A = ∂L/∂x_A = γ (x_A − mean(x_A)) /
                                                     sqrt(var(x_A) + ε) + δ,

(`layer_norm_lagrangian`, `layer_norm`), and the normalised tokens g have the energy
E = E_ATT + E_HN:

- the attention energy, per head h with queries Q_hC = W^Q_h g_C and keys K_hB = W^K_h g_B
  (`W (H, Y, D)`, no values),
  E_ATT = −β⁻¹ Σ_h Σ_C ln Σ_{B≠C} exp(β K_hB·Q_hC) (`attention_energy`; a query that sees
  no key adds nothing);
- the Hopfield-network energy of M memories ξ_μ ∈ R^D (`xi (M, D)`),
  E_HN = −½ Σ_μ Σ_B relu(ξ_μ·g_B)² (`kind="relu"`), or the softmax variant
  −β_HN⁻¹ Σ_B ln Σ_μ exp(β_HN ξ_μ·g_B) (`kind="softmax"`) (`hopfield_energy`).

The tokens follow τ dx_A/dt = −∂E/∂g_A (the gradient with respect to g, not x), here in steps
x ← x − α ∂E/∂g (`descent`), with the same weights at every step. Along the continuous
dynamics dE/dt = −τ⁻¹ Σ_A (∂E/∂g_A)ᵀ (∂²L/∂x_A²) (∂E/∂g_A) ≤ 0 because the Lagrangian is
convex: this needs `γ > 0` (the paper's learned γ has no sign constraint stated; with
γ < 0 the Hessian is negative semi-definite and the energy rises; tested), so callers keep
γ positive. With a finite step the energy is non-increasing only while α is small enough
(checked in the tests and the notebook).

**The descent has no fixed point in x.** E depends on x only through g, which does not
change when x_A is shifted along (1, …, 1) or scaled, and ∂E/∂g generally has components
along those directions that never vanish (g lives on a sphere of radius γ√D around δ, where
a minimum of E need not be a zero of its gradient in R^D). So x keeps moving — ‖x‖ grows
about linearly with the number of steps — while g converges: the part of ∂E/∂g the layer
norm passes on (`stationarity`, zero at a stationary point of E on the layer-norm sphere)
decays (slowly, not monotonically), and slower the larger ‖x‖ is, since a step moves g by
~α/σ(x_A), while ‖∂E/∂g‖ itself stays of the same size (tested). "Tokens converge to a fixed point" holds for g,
not for x: anything that reads x_T (rather than LN(x_T)) drifts with the number of steps,
and an equilibrium mode (solve for the stationary point, differentiate implicitly) would
have to be posed on g's sphere, not as a fixed point of the x update.

`energy_grad` is ∂E/∂g in closed form (tested against autodiff of `energy`):
∂E_ATT/∂g = Σ_h [−(A_h K_h) W^Q_h − (A_hᵀ Q_h) W^K_h] with A_h the softmax over the visible
keys, and ∂E_HN/∂g = −relu(g ξᵀ) ξ (softmax variant: −softmax_μ(β_HN g ξᵀ) ξ).
"""

from __future__ import annotations

import typing
from typing import Literal, NamedTuple, Optional

import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Bool, Float

from ._common import Scalar, as_float, check_int

__all__ = ["Descent", "HopfieldEnergy", "Params", "attention_energy", "attention_weights",
           "descent", "energy", "energy_grad", "hopfield_energy", "layer_norm",
           "layer_norm_lagrangian", "stationarity"]

#: The Hopfield-network energy (`kind=`): `"relu"`, −½ Σ_μ Σ_B relu(ξ_μ·g_B)² (the paper's
#: main choice), or `"softmax"`, −β_HN⁻¹ Σ_B ln Σ_μ exp(β_HN ξ_μ·g_B) (its softmax variant).
HopfieldEnergy = Literal["relu", "softmax"]
KINDS = typing.get_args(HopfieldEnergy)
Tokens = Float[ArrayLike, "N D"]


class Params(NamedTuple):
    """The weights of one Energy Transformer block (shared by every step of its descent).

    **Fields:** `gamma` `()` (> 0) and `delta` `(D,)`: the layer norm; `Wq`, `Wk`
    `(H, Y, D)`: queries and keys; `xi` `(M, D)`: the Hopfield memories; `beta`: the
    attention's inverse temperature (the paper: 1/√Y); `beta_hn`: the softmax Hopfield
    variant's; `eps`: the layer norm's ε."""

    gamma: Float[ArrayLike, ""]
    delta: Float[ArrayLike, " D"]
    Wq: Float[ArrayLike, "H Y D"]
    Wk: Float[ArrayLike, "H Y D"]
    xi: Float[ArrayLike, "M D"]
    beta: Scalar = 1.0
    beta_hn: Scalar = 1.0
    eps: float = 1e-5


def _check_tokens(name: str, x, D: Optional[int] = None) -> None:
    if jnp.ndim(x) != 2 or (D is not None and jnp.shape(x)[1] != D):
        want = "(N, D)" if D is None else f"(N, {D})"
        raise ValueError(f"{name}: tokens must have shape {want}, got {jnp.shape(x)}. Pass "
                         "one sequence per call; vmap over a batch.")


def layer_norm_lagrangian(x: Tokens, gamma: Scalar, delta, eps: float = 1e-5
                          ) -> Float[Array, ""]:
    """Σ_A [D γ sqrt(var(x_A) + ε) + δ·x_A], whose gradient is `layer_norm` (convex in x
    for γ > 0)."""
    _check_tokens("layer_norm_lagrangian", x)
    x, delta = as_float(x, delta)
    D = x.shape[-1]
    var = jnp.var(x, axis=-1)
    return jnp.sum(D * gamma * jnp.sqrt(var + eps) + x @ delta)


def layer_norm(x: Tokens, gamma: Scalar, delta, eps: float = 1e-5) -> Float[Array, "N D"]:
    """g_A = γ (x_A − mean(x_A)) / sqrt(var(x_A) + ε) + δ `(N, D)`, the gradient of
    `layer_norm_lagrangian`."""
    _check_tokens("layer_norm", x)
    x, delta = as_float(x, delta)
    c = x - jnp.mean(x, axis=-1, keepdims=True)
    return gamma * c / jnp.sqrt(jnp.mean(c * c, axis=-1, keepdims=True) + eps) + delta


def _allowed(N: int, mask) -> Bool[Array, "N N"]:
    """Query C may use key B: B ≠ C, and `mask[C, B]` if given."""
    allowed = ~jnp.eye(N, dtype=bool)
    return allowed if mask is None else allowed & mask


def _attention_parts(g, Wq, Wk, beta, mask):
    Q = jnp.einsum("hyd,nd->hny", Wq, g)
    K = jnp.einsum("hyd,nd->hny", Wk, g)
    allowed = _allowed(g.shape[0], mask)
    S = jnp.where(allowed, beta * jnp.einsum("hcy,hby->hcb", Q, K), -jnp.inf)
    sees = jnp.any(allowed, axis=-1)  # (N,) a query with no key adds nothing
    return Q, K, S, sees


def attention_energy(g: Tokens, Wq, Wk, *, beta: Scalar,
                     mask: Optional[Bool[ArrayLike, "N N"]] = None) -> Float[Array, ""]:
    """E_ATT = −β⁻¹ Σ_h Σ_C ln Σ_{B≠C} exp(β K_hB·Q_hC) over the normalised tokens `g (N, D)`;
    `mask (N, N)` (True = query C may use key B) removes more pairs."""
    _check_tokens("attention_energy", g)
    g, Wq, Wk = as_float(g, Wq, Wk)
    _, _, S, sees = _attention_parts(g, Wq, Wk, beta, mask)
    lse = jax.nn.logsumexp(jnp.where(sees[:, None], S, 0.0), axis=-1)
    return -jnp.sum(jnp.where(sees, lse, 0.0)) / beta


def attention_weights(g: Tokens, Wq, Wk, *, beta: Scalar,
                      mask: Optional[Bool[ArrayLike, "N N"]] = None) -> Float[Array, "H N N"]:
    """The attention of each head `(H, N, N)`: softmax over the keys B ≠ C a query C may use
    (rows of queries that see no key are zero); −(1/β)∂E_ATT/∂S in the module docstring."""
    _check_tokens("attention_weights", g)
    g, Wq, Wk = as_float(g, Wq, Wk)
    _, _, S, sees = _attention_parts(g, Wq, Wk, beta, mask)
    return _softmax_rows(S, sees)


def _softmax_rows(S, sees):
    A = jax.nn.softmax(jnp.where(sees[:, None], S, 0.0), axis=-1)
    return jnp.where(sees[:, None] & jnp.isfinite(S), A, 0.0)


def hopfield_energy(g: Tokens, xi, *, kind: HopfieldEnergy = "relu",
                    beta_hn: Scalar = 1.0) -> Float[Array, ""]:
    """E_HN over `g (N, D)` with memories `xi (M, D)`: −½ Σ relu(g ξᵀ)² (`"relu"`) or
    −β_HN⁻¹ Σ_B ln Σ_μ exp(β_HN ξ_μ·g_B) (`"softmax"`)."""
    _check_tokens("hopfield_energy", g)
    if kind not in KINDS:
        raise ValueError(f"hopfield_energy: kind={kind!r}; choose one of {KINDS}.")
    g, xi = as_float(g, xi)
    P = g @ xi.T
    if kind == "relu":
        return -0.5 * jnp.sum(jax.nn.relu(P) ** 2)
    return -jnp.sum(jax.nn.logsumexp(beta_hn * P, axis=-1)) / beta_hn


def energy(g: Tokens, params: Params, *, kind: HopfieldEnergy = "relu",
           mask: Optional[Bool[ArrayLike, "N N"]] = None) -> Float[Array, ""]:
    """E = E_ATT + E_HN of the normalised tokens `g (N, D)`."""
    return (attention_energy(g, params.Wq, params.Wk, beta=params.beta, mask=mask)
            + hopfield_energy(g, params.xi, kind=kind, beta_hn=params.beta_hn))


def energy_grad(g: Tokens, params: Params, *, kind: HopfieldEnergy = "relu",
                mask: Optional[Bool[ArrayLike, "N N"]] = None) -> Float[Array, "N D"]:
    """∂E/∂g `(N, D)` in closed form (see the module docstring)."""
    _check_tokens("energy_grad", g)
    if kind not in KINDS:
        raise ValueError(f"energy_grad: kind={kind!r}; choose one of {KINDS}.")
    g, Wq, Wk, xi = as_float(g, params.Wq, params.Wk, params.xi)
    Q, K, S, sees = _attention_parts(g, Wq, Wk, params.beta, mask)
    A = _softmax_rows(S, sees)
    dQ = -jnp.einsum("hcb,hby->hcy", A, K)
    dK = -jnp.einsum("hcb,hcy->hby", A, Q)
    grad = jnp.einsum("hny,hyd->nd", dQ, Wq) + jnp.einsum("hny,hyd->nd", dK, Wk)
    P = g @ xi.T
    if kind == "relu":
        return grad - jax.nn.relu(P) @ xi
    return grad - jax.nn.softmax(params.beta_hn * P, axis=-1) @ xi


def stationarity(x: Tokens, params: Params, *, kind: HopfieldEnergy = "relu",
                 mask: Optional[Bool[ArrayLike, "N N"]] = None) -> Float[Array, " N"]:
    """‖P_A ∂E/∂g_A‖ per token `(N,)`: the part of the energy's gradient that moves g = LN(x),
    with P_A the projection off the all-ones direction and the centred token x_A − mean(x_A)
    (∂g_A/∂x_A = (γ/σ_A) P_A for ε → 0). Zero exactly where g is a stationary point of E on
    the layer-norm sphere; ∂E/∂g itself need not vanish there (see the module docstring)."""
    _check_tokens("stationarity", x)
    x = as_float(x)[0]
    G = energy_grad(layer_norm(x, params.gamma, params.delta, params.eps), params, kind=kind,
                    mask=mask)
    c = x - jnp.mean(x, axis=-1, keepdims=True)
    G = G - jnp.mean(G, axis=-1, keepdims=True)
    G = G - c * jnp.sum(G * c, axis=-1, keepdims=True) / jnp.sum(c * c, axis=-1, keepdims=True)
    return jnp.linalg.norm(G, axis=-1)


class Descent(NamedTuple):
    """The result of `descent`: the final tokens `x (N, D)` and the energy before every step
    and after the last, `energies (steps + 1,)`."""

    x: Float[Array, "N D"]
    energies: Float[Array, " T"]


def descent(x0: Tokens, params: Params, *, steps: int, alpha: Scalar,
            kind: HopfieldEnergy = "relu",
            mask: Optional[Bool[ArrayLike, "N N"]] = None) -> Descent:
    """`steps` steps x ← x − α ∂E/∂g(LN(x)) from `x0 (N, D)` (an unrolled `lax.scan`: its
    gradient is backpropagation through every step), with the energy of LN(x) recorded."""
    _check_tokens("descent", x0)
    check_int("descent", "steps", steps, 1)
    x0 = as_float(x0)[0]

    def norm(x):
        return layer_norm(x, params.gamma, params.delta, params.eps)

    def body(x, _):
        g = norm(x)
        e = energy(g, params, kind=kind, mask=mask)
        return x - alpha * energy_grad(g, params, kind=kind, mask=mask), e

    x, es = jax.lax.scan(body, x0, None, length=steps)
    last = energy(norm(x), params, kind=kind, mask=mask)
    return Descent(x, jnp.concatenate([es, last[None]]))
