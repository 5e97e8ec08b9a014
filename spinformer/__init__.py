"""spinformer: attention as the response of a spin system, in JAX and Equinox."""

from . import solvers

__version__ = "0.1.0"

__all__ = ["solvers", "__version__"]
