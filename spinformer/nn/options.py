"""The algorithm choices of the attention families, in one namespace.

A choice that carries an algorithm (an update rule, an inference method, an estimator, an
Onsager term, an objective) is a frozen dataclass registered under a kind and a name in the
one name table (`spinformer._schema`); it receives arrays, not the module that holds it. A
config names it (`model.attention.update: tap`), Python passes the object or the name
(`SpinAttention(64, 4, update=options.TAPUpdate())`). Choices that only switch a term or a
readout are `Literal` fields of the modules instead (`SpinAttention(mode="steps")`). The
kinds:

- `spin.update`: `MeanFieldUpdate` (`mean_field`), `TAPUpdate` (`tap`).
- `boltzmann.inference`: `ExactInference`, `MeanFieldInference`, `TAPInference`, `Gibbs`,
  `ParallelTempering`, `DQA` (the samplers carry their parameters).
- `neurogame.estimator`: `MonteCarloValues`, `ExactValues`, `PaperValues`.
- `implicit.onsager`: `MLPOnsager`, `AdaptiveTAPOnsager`, `NaiveOnsager`.
- `attractor.objective`: `EnergyObjective`, `PseudoLikelihoodObjective`.

`choice(kind, value)` resolves a name; `choice_names(kind)` lists a kind's names;
`register_choice(kind, name)` adds one.
"""

from .._schema import Choice, choice, choice_names, register_choice
from ._attractor import AttractorObjective, EnergyObjective, PseudoLikelihoodObjective
from ._boltzmann import (DQA, BoltzmannInference, BoltzmannSampler, ExactInference, Gibbs,
                         MeanFieldInference, ParallelTempering, TAPInference)
from ._implicit import AdaptiveTAPOnsager, MLPOnsager, NaiveOnsager, OnsagerTerm
from ._neurogame import ExactValues, GameEstimator, MonteCarloValues, PaperValues
from ._spin import MeanFieldUpdate, SpinUpdate, TAPUpdate

# written out (not computed) so that documentation tools read it without importing
__all__ = [
    "AdaptiveTAPOnsager",
    "AttractorObjective",
    "BoltzmannInference",
    "BoltzmannSampler",
    "Choice",
    "DQA",
    "EnergyObjective",
    "ExactInference",
    "ExactValues",
    "GameEstimator",
    "Gibbs",
    "MLPOnsager",
    "MeanFieldInference",
    "MeanFieldUpdate",
    "MonteCarloValues",
    "NaiveOnsager",
    "OnsagerTerm",
    "PaperValues",
    "ParallelTempering",
    "PseudoLikelihoodObjective",
    "SpinUpdate",
    "TAPInference",
    "TAPUpdate",
    "choice",
    "choice_names",
    "register_choice",
]
