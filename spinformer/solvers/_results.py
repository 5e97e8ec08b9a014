"""Result codes and the `Solution` returned by every solve."""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence, Union

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, PyTree


class _Code(NamedTuple):
    name: str
    message: str  # what happened
    hint: str  # what to do about it


# Every result code, defined once: its integer is its index here.
_CODES = (
    _Code("successful", "", ""),
    _Code(
        "max_steps_reached",
        "the solver reached max_steps without the residual falling below tol.",
        "Raise the solver's max_steps (e.g. Anderson(max_steps=500)), loosen its tol, add "
        "damping (Picard(damping=0.5)) or use Anderson; pass throw=False to get the Solution "
        "and inspect `result` and `residual`.",
    ),
    _Code(
        "nonfinite",
        "the iteration produced a non-finite value (NaN or inf): the map diverged or is "
        "undefined at an iterate.",
        "Check the inputs, lower the coupling strength, add damping, or pass throw=False to "
        "get the Solution and inspect `result`.",
    ),
)


class RESULTS:
    """Integer codes stored in `Solution.result`: `successful`, `max_steps_reached`,
    `nonfinite`.

    They are plain Python ints, so `sol.result == RESULTS.successful` works elementwise on the
    integer array a solve returns (also under `jit` and `vmap`). `RESULTS.name(code)` and
    `RESULTS.message(code)` explain a code.
    """

    successful = 0
    max_steps_reached = 1
    nonfinite = 2

    @staticmethod
    def name(code: int) -> str:
        """The name of a result code, e.g. `"max_steps_reached"`."""
        c = int(code)
        if not 0 <= c < len(_CODES):
            raise ValueError(f"unknown result code {code!r}; codes are 0..{len(_CODES) - 1}.")
        return _CODES[c].name

    @staticmethod
    def message(code: int) -> str:
        """What a result code means and what to do about it ("" for `successful`)."""
        c = _CODES[int(code)]
        return f"{c.message} {c.hint}".strip()


for _i, _c in enumerate(_CODES):  # the class attributes above are this table's indices
    assert getattr(RESULTS, _c.name) == _i, _c.name
del _i, _c


class Solution(eqx.Module):
    """The outcome of `fixed_point` or `root_find` for one problem.

    **Fields:**

    - `value`: the solution, a pytree with the structure of `x0`: the iterate with the smallest
      residual seen (the last one whenever the solve converged).
    - `num_steps`: iterations taken after the initial evaluation (int32 scalar).
    - `residual`: the residual norm at `value`, ‖fn(x) − x‖ for fixed points or ‖F(x)‖ for
      roots, in the solver's `norm` (∞-norm by default).
    - `final_residual`: the residual norm at the last iterate (larger than `residual` when
      the iteration moved away from its best point before stopping).
    - `result`: a `RESULTS` code (int32 scalar).
    - `trace`: with `trace=True`, the residual norm after every iteration `(max_steps + 1,)`
      (index 0: the initial guess; NaN after the last iteration); else None.
    - `aux`: with `has_aux=True`, the auxiliary output of `fn` at `value` (gradients flow
      through it); else None.

    Under `vmap` every field gains the batch dimension: each example has its own steps,
    residuals and result.
    """

    value: PyTree[Array]
    num_steps: Int[Array, ""]
    residual: Float[Array, ""]
    final_residual: Float[Array, ""]
    result: Int[Array, ""]
    trace: Optional[Float[Array, " T"]] = None
    aux: Optional[PyTree] = None


# ----------------------------------------------------------------------------- checks


def _nonfinite(tree) -> Bool[Array, ""]:
    leaves = [jnp.any(~jnp.isfinite(x))
              for x in jax.tree.leaves(tree) if eqx.is_inexact_array(x)]
    return jnp.any(jnp.stack(leaves)) if leaves else jnp.asarray(False)


@eqx.filter_custom_vjp
def _guard(value, pred, index, messages, nonfinite):
    del pred, index, messages, nonfinite
    return value


@_guard.def_fwd
def _guard_fwd(perturbed, value, pred, index, messages, nonfinite):
    del perturbed, pred, index, messages, nonfinite
    return value, None


@_guard.def_bwd
def _guard_bwd(residuals, g, perturbed, value, pred, index, messages, nonfinite):
    del residuals, perturbed, value
    if nonfinite:
        pred = pred | _nonfinite(g)
    return eqx.branched_error_if(g, pred, index, messages)


def backward_error_if(
    value: PyTree,
    pred: Union[bool, Bool[Array, ""]],
    index: Union[int, Int[Array, ""]],
    messages: Sequence[str],
    *,
    nonfinite: bool = False,
) -> PyTree:
    """`value` unchanged; gradients flowing back through it raise `messages[index]` where
    `pred` holds (and, with `nonfinite=True`, also where the incoming gradient is not
    finite).

    The one "raise in the backward pass" helper of the library: a forward
    `eqx.error_if(x, ...)` whose output only the discarded primal uses is removed as dead
    code under `jit(grad(...))`, so a failed solve would otherwise give gradients silently.
    `fixed_point`/`root_find` with `throw=True`, `spins.adaptive_tap` and
    `spins.free_energy` use it.

    **Arguments:**

    - `value`: any pytree (its inexact arrays receive the gradient check).
    - `pred`: boolean scalar (a Python bool or an array, may be traced): the failure.
    - `index`: which message to raise (an int or an int array, e.g. a `RESULTS` code).
    - `messages`: the messages, a sequence of strings (static).
    - `nonfinite`: also raise `messages[index]` when the cotangent has a NaN or inf.

    **Returns:** `value`.
    """
    return _guard(value, jnp.asarray(pred), jnp.asarray(index, jnp.int32), tuple(messages),
                  nonfinite)
