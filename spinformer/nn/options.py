"""Every option object of the attention families and models, in one namespace.

Options that select behaviour are frozen dataclasses registered under a kind and a name
(`spinformer._choices`); a config names them (`model.spin.update: tap`), Python passes the
object or the name (`SpinAttention(64, 4, update=options.TAPUpdate())`). The kinds:

- `spin.update`: `MeanFieldUpdate` (`mean_field`), `TAPUpdate` (`tap`);
  `spin.mode`: `SteadyState` (`fixed_point`), `TimeSteps` (`steps`);
  `spin.init`: `Reset`, `Learned`, `Carried`; `spin.output`: `Magnetization`, `Response`.
- `boltzmann.inference`: `ExactInference`, `MeanFieldInference`, `TAPInference`, `Gibbs`,
  `ParallelTempering`, `DQA` (the samplers carry their parameters).
- `neurogame.mode`: `QueryGames`, `PooledGame`; `neurogame.estimator`: `MonteCarloValues`,
  `ExactValues`, `PaperValues`; `neurogame.value_fn`: `IdentityNorm`, `TanhNorm`,
  `ReluNorm`; `neurogame.gate`: `LearnedGate`, `ShapleyGate`, `BanzhafGate`;
  `neurogame.normalize`: `NormalizeByPlayers`, `NormalizeBySum`, `NoNormalization`.
- `implicit.onsager`: `MLPOnsager`, `AdaptiveTAPOnsager`, `NaiveOnsager`.
- `attractor.objective`: `EnergyObjective`, `PseudoLikelihoodObjective`.
- `pair.pool`: `PairMeanPool`, `PairClsPool`, `PairNGTPool`.

`choice(kind, value)` resolves a name; `choice_names(kind)` lists a kind's names;
`register_choice(kind, name)` adds one.
"""

from .._schema import Choice, choice, choice_names, register_choice
from ._attractor import AttractorObjective, EnergyObjective, PseudoLikelihoodObjective
from ._boltzmann import (DQA, BoltzmannInference, BoltzmannSampler, ExactInference, Gibbs,
                         MeanFieldInference, ParallelTempering, TAPInference)
from ._implicit import AdaptiveTAPOnsager, MLPOnsager, NaiveOnsager, OnsagerTerm
from ._neurogame import (BanzhafGate, ExactValues, GameEstimator, GameValueFn, IdentityNorm,
                         LearnedGate, MonteCarloValues, NeuroGameGate, NeuroGameMode,
                         NoNormalization, NormalizeByPlayers, NormalizeBySum,
                         OutputNormalization, PaperValues, PooledGame, QueryGames, ReluNorm,
                         ShapleyGate, TanhNorm)
from ._pair import PairClsPool, PairMeanPool, PairNGTPool, PairPool
from ._spin import (Carried, Learned, Magnetization, MeanFieldUpdate, Reset, Response,
                    SpinInit, SpinMode, SpinOutput, SpinUpdate, SteadyState, TAPUpdate,
                    TimeSteps)

# written out (not computed) so that documentation tools read it without importing
__all__ = [
    "AdaptiveTAPOnsager",
    "AttractorObjective",
    "BanzhafGate",
    "BoltzmannInference",
    "BoltzmannSampler",
    "Carried",
    "Choice",
    "DQA",
    "EnergyObjective",
    "ExactInference",
    "ExactValues",
    "GameEstimator",
    "GameValueFn",
    "Gibbs",
    "IdentityNorm",
    "Learned",
    "LearnedGate",
    "MLPOnsager",
    "Magnetization",
    "MeanFieldInference",
    "MeanFieldUpdate",
    "MonteCarloValues",
    "NaiveOnsager",
    "NeuroGameGate",
    "NeuroGameMode",
    "NoNormalization",
    "NormalizeByPlayers",
    "NormalizeBySum",
    "OnsagerTerm",
    "OutputNormalization",
    "PairClsPool",
    "PairMeanPool",
    "PairNGTPool",
    "PairPool",
    "PaperValues",
    "ParallelTempering",
    "PooledGame",
    "PseudoLikelihoodObjective",
    "QueryGames",
    "ReluNorm",
    "Reset",
    "Response",
    "ShapleyGate",
    "SpinInit",
    "SpinMode",
    "SpinOutput",
    "SpinUpdate",
    "SteadyState",
    "TAPInference",
    "TAPUpdate",
    "TanhNorm",
    "TimeSteps",
    "choice",
    "choice_names",
    "register_choice",
]
