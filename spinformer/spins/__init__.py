"""The physics: spin systems as pure functions. No parameters, no training.

Every function handles one system (one set of fields and couplings); callers `vmap` over
batches. The families:

- `ising`: binary spins in equilibrium (first-order mean field, TAP, exact enumeration, and
  `boltzmann_marginals`: exact Boltzmann-attention marginals for many queries sharing one
  coupling matrix);
- `kinetic`: the asymmetric kinetic Ising model (Plefka[t-1,t] mean-field and TAP dynamics,
  correlations, entropy production);
- `vector`: D-dimensional spins on spheres of radius R (Bessel-ratio magnetizations, their
  large-D limit, mean-field and second-order TAP dynamics and their steady states);
- `samplers`: Gibbs, parallel tempering and simulated diabatic quantum annealing, and
  straight-through estimators that carry mean-field gradients through sampled means;
- `coalitions`: cooperative games (exact and Monte Carlo Shapley, Banzhaf and interaction
  values, the NeuroGame estimators);
- `adaptive_tap`: adaptive TAP (Opper–Winther) for vector spins with d × d coupling blocks,
  Gaussian or binary priors, cavity variances from linear response;
- `attractor`: self-attention as an attractor network of unit vectors with position-dependent
  d × d couplings (local energies, their dynamics, the exact pseudo-likelihood on the sphere);
- `free_energy`: the steepest-descent (large-D) free energy of vector spins on spheres, its
  saddle, and magnetizations as derivatives of log Z;
- `hopfield`: modern (exponential) Hopfield networks: the energy, the update (one step is
  softmax attention) and retrieval to its fixed point;
- `energy_transformer`: the Energy Transformer's energy-based layer norm, attention and
  Hopfield energies, their closed-form gradients and the token descent.

Which attention family (a module of `spinformer.nn`, a `model.attention` word) computes
with which of them:

| family (`model.attention`) | module | physics |
|---|---|---|
| `spin` | `nn/_spin.py` (`SpinAttention`) | `vector` (mean-field / TAP steps and steady states) |
| `boltzmann` | `nn/_boltzmann.py` (`BoltzmannAttention`) | `ising` (exact, mean-field, TAP marginals), `samplers` |
| `neurogame` | `nn/_neurogame.py` (`NeuroGameAttention`) | `coalitions` (game values), `ising` (mean field) |
| `implicit` | `nn/_implicit.py` (`ImplicitAttention`) | its own mean-field map; `adaptive_tap` for `onsager="adaptive_tap"` |
| `free_energy` | `nn/_free_energy.py` (`FreeEnergyAttention`) | `free_energy` |
| `hopfield` | `nn/_hopfield.py` (`HopfieldAttention`) | `hopfield` |
| `energy_transformer` | `nn/_energy_transformer.py` (`EnergyTransformerAttention`) | `energy_transformer` |
| (a model of its own) | `nn/_attractor.py` (`AttractorNetwork`) | `attractor` |
| `softmax` | `nn/_softmax.py` (`SoftmaxAttention`) | none (the reference) |

`kinetic` (binary spins) has no attention of its own; `vector.entropy_production`, which
spin attention reports, is its formula applied to vector spins.

Iterative solutions (`ising.mean_field`, `ising.tap`, `kinetic.tap_step`, `vector.tap_step`,
`vector.tap_ness`, `vector.mean_field_ness`) return a `spinformer.solvers.Solution` and take
`solver=`, `adjoint=`, `throw=` (the solver object carries the tolerance and step budget).

```python
from spinformer.spins import ising
m = ising.tap(h, J, beta=0.5)
```
"""

from . import adaptive_tap as adaptive_tap
from . import attractor as attractor
from . import coalitions as coalitions
from . import energy_transformer as energy_transformer
from . import free_energy as free_energy
from . import hopfield as hopfield
from . import ising as ising
from . import kinetic as kinetic
from . import samplers as samplers
from . import vector as vector

__all__ = ["adaptive_tap", "attractor", "coalitions", "energy_transformer", "free_energy",
           "hopfield", "ising", "kinetic", "samplers", "vector"]
