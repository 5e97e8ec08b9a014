"""Equinox modules: attention mechanisms, blocks, stacked transformers and task heads.

Every module handles one example (`x: (n_tokens, d)` or `tokens: (n,)`); vmap over a batch.
Attention modules share one call signature,
`attn(x, *, context=None, mask=None, state=None, key=None, return_diagnostics=False)`,
and return an array shaped like `x` (plus a dict of diagnostics when asked).

```python
model = spinformer.nn.Tagger(vocab_size=12, num_classes=12, dim=32, depth=2,
                             attention="spin", causal=True, key=jax.random.key(0))
logits = jax.vmap(model)(tokens)            # (B, n, 12)
```
"""

from ._block import Block as Block
from ._boltzmann import BoltzmannAttention as BoltzmannAttention
from ._block import FeedForward as FeedForward
from ._groups import param_labels as param_labels
from ._masks import causal_mask as causal_mask
from ._softmax import SoftmaxAttention as SoftmaxAttention
from ._spin import SpinAttention as SpinAttention
from ._transformer import ATTENTIONS as ATTENTIONS
from ._transformer import CausalLM as CausalLM
from ._transformer import Classifier as Classifier
from ._transformer import Tagger as Tagger
from ._transformer import Transformer as Transformer

__all__ = [
    "ATTENTIONS",
    "Block",
    "BoltzmannAttention",
    "CausalLM",
    "Classifier",
    "FeedForward",
    "SoftmaxAttention",
    "SpinAttention",
    "Tagger",
    "Transformer",
    "causal_mask",
    "param_labels",
]
