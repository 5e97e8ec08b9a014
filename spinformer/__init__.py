"""spinformer: attention as the response of a spin system, in JAX and Equinox.

- `spinformer.solvers`: fixed points and roots (Picard, Anderson, Broyden, Newton) and how to
  differentiate them (implicit, unrolled, phantom, one-step).
- `spinformer.spins`: the physics as pure functions (binary Ising, kinetic Ising, vector spins).
- `spinformer.nn`: Equinox attention modules, blocks, stacked transformers and heads.
- `spinformer.data`, `spinformer.train`, `spinformer.config`: datasets, the training loop
  and typed experiment configs behind the `spinformer` command.
"""

from . import config, data, nn, solvers, spins, train

__version__ = "0.1.0"

__all__ = ["config", "data", "nn", "solvers", "spins", "train", "__version__"]
