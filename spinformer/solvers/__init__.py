"""Fixed points and roots, and how to differentiate them. No physics lives here.

```python
from spinformer import solvers

sol = solvers.fixed_point(lambda m, h: jnp.tanh(h + 0.5 * m), jnp.zeros(3), h)
sol.value, sol.num_steps, sol.residual, sol.result == solvers.RESULTS.successful
```
"""

from ._adjoint import (
    AbstractAdjoint,
    Implicit,
    OneStep,
    Phantom,
    Unrolled,
    jacobian_penalty,
    spectral_radius,
)
from ._fixed_point import fixed_point, root_find
from ._results import RESULTS, Solution
from ._solvers import (
    AbstractSolver,
    Anderson,
    Broyden,
    JaxoptAnderson,
    Newton,
    Picard,
    l2_norm,
    max_norm,
)

__all__ = [
    "AbstractAdjoint",
    "AbstractSolver",
    "Anderson",
    "Broyden",
    "Implicit",
    "JaxoptAnderson",
    "Newton",
    "OneStep",
    "Phantom",
    "Picard",
    "RESULTS",
    "Solution",
    "Unrolled",
    "fixed_point",
    "jacobian_penalty",
    "l2_norm",
    "max_norm",
    "root_find",
    "spectral_radius",
]
