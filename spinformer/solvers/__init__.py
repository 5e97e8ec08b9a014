"""Fixed points and roots, and how to differentiate them. No physics lives here.

```python
from spinformer import solvers

sol = solvers.fixed_point(lambda m, h: jnp.tanh(h + 0.5 * m), jnp.zeros(3), h,
                          solver=solvers.Anderson(tol=1e-6))
sol.value, sol.num_steps, sol.residual, sol.result == solvers.RESULTS.successful
```

Options are objects, not strings: a solver carries its stopping rule (`tol`, `max_steps`,
`norm`), an adjoint says how gradients flow, a linear solver how the adjoint system is
solved. This package knows nothing of configs and imports no other part of spinformer; a
config names these classes (`solver: {name: anderson, tol: 1e-4}`) and the config reader
builds the objects.
"""

from ._adjoint import (
    AbstractAdjoint,
    Implicit,
    OneStep,
    Phantom,
    Shine,
    Unrolled,
    backward_stats,
    jacobian_penalty,
    record_backward,
    spectral_radius,
)
from ._fixed_point import check_solver, fixed_point, root_find
from ._linear import AbstractLinearSolver, Auto, BiCGStab, Dense, GMRES
from ._results import RESULTS, Solution, backward_error_if
from ._reversible import Reversible, ReversibleAdjoint
from ._solvers import (
    AbstractFixedPointSolver,
    AbstractRootFinder,
    AbstractSolver,
    Anderson,
    Broyden,
    Newton,
    Picard,
    l2_norm,
    max_norm,
)

__all__ = [
    "AbstractAdjoint",
    "AbstractFixedPointSolver",
    "AbstractLinearSolver",
    "AbstractRootFinder",
    "AbstractSolver",
    "Anderson",
    "Auto",
    "BiCGStab",
    "Dense",
    "Broyden",
    "GMRES",
    "Implicit",
    "Newton",
    "OneStep",
    "Phantom",
    "Picard",
    "RESULTS",
    "Reversible",
    "ReversibleAdjoint",
    "Shine",
    "Solution",
    "Unrolled",
    "backward_error_if",
    "backward_stats",
    "check_solver",
    "fixed_point",
    "jacobian_penalty",
    "l2_norm",
    "max_norm",
    "record_backward",
    "root_find",
    "spectral_radius",
]
