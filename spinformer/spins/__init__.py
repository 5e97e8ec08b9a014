"""The physics: spin systems as pure functions. No parameters, no training.

Every function handles one system (one set of fields and couplings); callers `vmap` over
batches. Three families live here:

- `ising`: binary spins in equilibrium (naive mean field, TAP, exact enumeration);
- `kinetic`: the asymmetric kinetic Ising model (Plefka[t-1,t] naive and TAP dynamics,
  correlations, entropy production);
- `vector`: D-dimensional spins on spheres of radius R (Bessel-ratio magnetizations, their
  large-D limit, naive and second-order TAP dynamics and the steady state);
- `samplers`: Gibbs, parallel tempering and simulated diabatic quantum annealing, and a
  straight-through estimator; `ising.boltzmann_marginals` gives exact Boltzmann-attention
  marginals for many queries sharing one coupling matrix.

```python
from spinformer.spins import ising
m = ising.tap(h, J, beta=0.5)
```
"""

from . import ising as ising
from . import kinetic as kinetic
from . import samplers as samplers
from . import vector as vector

__all__ = ["ising", "kinetic", "samplers", "vector"]
