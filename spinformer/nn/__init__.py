"""Equinox modules: attention mechanisms, blocks, stacked transformers and sequence models.

Every module handles one example (`x: (n_tokens, d)` or `tokens: (n,)`); vmap over a batch.
Attention modules share one call signature,
`attn(x, *, context=None, mask=None, state=None, key=None, return_diagnostics=False)`,
and return an array shaped like `x` (plus a `Diagnostics` when asked).

```python
model = spinformer.nn.Tagger(vocab_size=12, num_classes=12, dim=32, depth=2,
                             attention="spin", causal=True, key=jax.random.key(0))
logits = jax.vmap(model)(tokens)            # (B, n, 12)
```

A new attention is one module plus one config dataclass, registered with
`register_attention(name, config=...)` (see `spinformer._schema`).
"""

# The shipped attentions register in this order (the order of `model.attention`'s choices).
from . import _softmax, _spin, _boltzmann, _neurogame, _implicit, _free_energy  # noqa: F401, I001
from . import _hopfield, _energy_transformer  # noqa: F401, I001
from ._attention_diagnostics import Diagnostics as Diagnostics
from ._attention_diagnostics import Stats as Stats
from ._attractor import AttractorNetwork as AttractorNetwork
from ._attractor import PixelSpinEmbedding as PixelSpinEmbedding
from ._attractor import attractor_sgd_step as attractor_sgd_step
from ._block import Block as Block
from ._block import FeedForward as FeedForward
from ._boltzmann import BoltzmannAttention as BoltzmannAttention
from ._boltzmann import BoltzmannConfig as BoltzmannConfig
from ._decode import DecodeState as DecodeState
from ._decode import decode_init as decode_init
from ._decode import decode_sequence as decode_sequence
from ._decode import decode_step as decode_step
from ._decode import generate as generate
from ._decode import prefill as prefill
from ._decode import with_solver as with_solver
from ._energy_transformer import EnergyTransformerAttention as EnergyTransformerAttention
from ._energy_transformer import EnergyTransformerConfig as EnergyTransformerConfig
from ._fixed_point_analysis import FixedPointAnalysis as FixedPointAnalysis
from ._fixed_point_analysis import ModelAnalysis as ModelAnalysis
from ._fixed_point_analysis import fixed_point_analysis as fixed_point_analysis
from ._fixed_point_analysis import model_analysis as model_analysis
from ._fixed_point_analysis import steady_state_analysis as steady_state_analysis
from ._free_energy import FreeEnergyAttention as FreeEnergyAttention
from ._free_energy import FreeEnergyConfig as FreeEnergyConfig
from ._groups import param_labels as param_labels
from ._hopfield import HopfieldAttention as HopfieldAttention
from ._hopfield import HopfieldConfig as HopfieldConfig
from ._image import ImageClassifier as ImageClassifier
from ._image import ImageReconstructor as ImageReconstructor
from ._implicit import ImplicitAttention as ImplicitAttention
from ._implicit import ImplicitConfig as ImplicitConfig
from ._masks import causal_mask as causal_mask
from ._neurogame import NeuroGameAttention as NeuroGameAttention
from ._neurogame import NeuroGameConfig as NeuroGameConfig
from ._neurogame import NeuroGameDiagnostics as NeuroGameDiagnostics
from ._pair import PairClassifier as PairClassifier
from ._pair import PairDiagnostics as PairDiagnostics
from ._pair import ClsPool as ClsPool
from ._pair import MeanPool as MeanPool
from ._pair import pool_settings as pool_settings
from ._reconstruct import PatchReconstructor as PatchReconstructor
from . import options as options
from .._schema import attention_names as attention_names
from .._schema import get_attention as get_attention
from .._schema import register_attention as register_attention
from ._softmax import SoftmaxAttention as SoftmaxAttention
from ._spin import SpinAttention as SpinAttention
from ._spin import SpinConfig as SpinConfig
from ._transformer import CausalLM as CausalLM
from ._transformer import Classifier as Classifier
from ._transformer import SequenceModel as SequenceModel
from ._transformer import Tagger as Tagger
from ._transformer import Transformer as Transformer


__all__ = [
    "AttractorNetwork",
    "Block",
    "BoltzmannAttention",
    "BoltzmannConfig",
    "CausalLM",
    "ClsPool",
    "Classifier",
    "DecodeState",
    "Diagnostics",
    "EnergyTransformerAttention",
    "EnergyTransformerConfig",
    "FeedForward",
    "FixedPointAnalysis",
    "FreeEnergyAttention",
    "FreeEnergyConfig",
    "HopfieldAttention",
    "HopfieldConfig",
    "ImageClassifier",
    "ImageReconstructor",
    "ImplicitAttention",
    "ImplicitConfig",
    "MeanPool",
    "ModelAnalysis",
    "NeuroGameAttention",
    "NeuroGameConfig",
    "NeuroGameDiagnostics",
    "PairClassifier",
    "PairDiagnostics",
    "PatchReconstructor",
    "PixelSpinEmbedding",
    "SequenceModel",
    "SoftmaxAttention",
    "SpinAttention",
    "SpinConfig",
    "Stats",
    "Tagger",
    "Transformer",
    "attention_names",
    "attractor_sgd_step",
    "causal_mask",
    "decode_init",
    "decode_sequence",
    "decode_step",
    "fixed_point_analysis",
    "generate",
    "get_attention",
    "model_analysis",
    "options",
    "param_labels",
    "pool_settings",
    "prefill",
    "register_attention",
    "steady_state_analysis",
    "with_solver",
]
