"""A sentence-pair classifier (natural language inference): a transformer encoder over
`[CLS] premise [SEP] hypothesis [SEP]` with segment embeddings and a padding mask, a pooled
summary of the sequence, and a feed-forward classifier (the head of the NeuroGame
Transformer paper, eqs. 28–30)."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Literal, Optional, Union

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Int, PRNGKeyArray

from ._attention_diagnostics import Diagnostics
from ._literal import check_literal
from ._neurogame import NeuroGameAttention, NeuroGameConfig
from .._schema import Choice, get_attention, name_of, register_choice
from ._transformer import Transformer

PAD = 0  # token id 0 is padding


class PairDiagnostics(eqx.Module):
    """Diagnostics of a `PairClassifier`: `encoder` (the blocks', stacked over layers) and
    `head` (the NeuroGame pooling head's, or None). `solver` is the encoder's solver
    statistics (what the trainer logs per layer as `solver_steps/i`); the head's are logged
    as `head_solver_steps`."""

    encoder: Diagnostics
    head: Optional[Diagnostics] = None

    @property
    def solver(self):
        return self.encoder.solver


# -- how the encoded pair becomes one vector (`pool`; the config key `model.pool`) -------------

#: how a `PairClassifier` pools the encoded sequence into one vector: the mean of the
#: non-padded hidden states, the first position (`[CLS]`), or the NeuroGame paper's head
Pool = Literal["mean", "cls", "ngt"]


@register_choice("pool", "mean")
@dataclasses.dataclass(frozen=True)
class MeanPool(Choice):
    """The config's pooling head `mean`: the mean of the non-padded hidden states."""


@register_choice("pool", "cls")
@dataclasses.dataclass(frozen=True)
class ClsPool(Choice):
    """The config's pooling head `cls`: the hidden state of the first position (`[CLS]`)."""


# the config's pooling head `neurogame`: the NeuroGame paper's pooled game (`pool="ngt"`),
# with the settings of NeuroGame attention (`model.pool: {name: neurogame, estimator: exact}`)
register_choice("pool", "neurogame")(NeuroGameConfig)


def pool_settings(pool) -> tuple[Pool, Optional[dict[str, Any]]]:
    """`(pool, pool_kwargs)` of `PairClassifier` for the config's pooling head `pool` (a
    `MeanPool`, `ClsPool` or `NeuroGameConfig`)."""
    if isinstance(pool, NeuroGameConfig):
        return "ngt", get_attention(NeuroGameAttention).kwargs_from(pool)
    return name_of("pool", pool), None


class PairClassifier(eqx.Module):
    """Classify a sentence pair: `inputs (2, n) -> logits (num_classes,)`.

    `inputs[0]` holds token ids (0 = padding, only at the end), `inputs[1]` segment ids
    (0 padding, 1 premise, 2 hypothesis), as `spinformer.data.GeneratedNLI` and
    `spinformer.data.NLIFile` produce them. Padded tokens are masked out of every attention
    (keys) and of the pooling.

    **Arguments:**

    - `vocab_size`, `num_classes`: token ids and classes (3 for NLI).
    - `dim`, `depth`, `num_heads`, `max_len`, `attention`, `attention_kwargs`, `ffn_hidden`,
      `dropout`: the encoder, as `Transformer` (never causal). `depth=0` is not allowed: the
      encoder has at least one block.
    - `pool`: how the sequence becomes one vector: `"mean"` (the mean of the non-padded
      hidden states), `"cls"` (the first position) or `"ngt"` (the NeuroGame paper's head,
      one game over the non-padded tokens, z = Σ α_i V_i, `NeuroGameAttention.pool` of a
      `"pooled"`-mode `head`).
    - `pool_kwargs`: keyword arguments of the `NeuroGameAttention` head (`pool="ngt"`).
    - `num_segments`: segment ids the embedding knows (3).
    - `key`: PRNG key.

    The classifier is `Linear(D, D) → GELU → Linear(D, num_classes)` for every pool (the
    feed-forward network of eqs. 28–29 with one hidden layer).
    """

    encoder: Transformer
    head: Optional[NeuroGameAttention]
    hidden: eqx.nn.Linear
    readout: eqx.nn.Linear
    pool: Pool = eqx.field(static=True)

    def __init__(
        self,
        vocab_size: int,
        num_classes: int,
        dim: int,
        depth: int,
        num_heads: int = 1,
        max_len: int = 512,
        attention: Union[str, Callable[..., eqx.Module]] = "softmax",
        attention_kwargs: Optional[dict[str, Any]] = None,
        ffn_hidden: int = 0,
        dropout: float = 0.0,
        pool: Pool = "mean",
        pool_kwargs: Optional[dict[str, Any]] = None,
        num_segments: int = 3,
        *,
        key: PRNGKeyArray,
    ):
        check_literal("PairClassifier", "pool", pool, Pool)
        ke, kp, kh, kr = jax.random.split(key, 4)
        self.encoder = Transformer(
            vocab_size, dim, depth, num_heads=num_heads, max_len=max_len, attention=attention,
            attention_kwargs=attention_kwargs, causal=False, ffn_hidden=ffn_hidden,
            dropout=dropout, num_segments=num_segments, key=ke,
        )
        self.head = (NeuroGameAttention(dim, num_heads, key=kp,
                                        **{**(pool_kwargs or {}), "mode": "pooled"})
                     if pool == "ngt" else None)
        self.hidden = eqx.nn.Linear(dim, dim, key=kh)
        self.readout = eqx.nn.Linear(dim, num_classes, key=kr)
        self.pool = pool

    def __call__(self, inputs: Int[Array, "2 n"], *, key: Optional[PRNGKeyArray] = None,
                 return_diagnostics: bool = False, **unused):
        """**Arguments:**

        - `inputs`: `(2, n)` int: token ids and segment ids.
        - `key`: PRNG key (dropout, Monte Carlo draws); None for inference.
        - `return_diagnostics`: also return `PairDiagnostics`.

        **Returns:** logits `(num_classes,)`, or `(logits, diagnostics)`.
        """
        if unused:
            raise TypeError(f"PairClassifier: unexpected arguments {sorted(unused)}.")
        if inputs.ndim != 2 or inputs.shape[0] != 2:
            raise ValueError(
                f"PairClassifier: inputs must have shape (2, n) (token ids, segment ids); got "
                f"{inputs.shape}. Use jax.vmap(model)(inputs) for a batch."
            )
        tokens, segments = inputs[0], inputs[1]
        valid = tokens != PAD
        mask = jnp.broadcast_to(valid[None, :], (tokens.shape[0], tokens.shape[0]))
        ke = kh = None
        if key is not None:
            ke, kh = jax.random.split(key)
        h, diag = self.encoder(tokens, segments=segments, mask=mask, key=ke,
                               return_diagnostics=True)
        head_diag = None
        if self.pool == "mean":
            w = valid.astype(h.dtype)
            z = (w @ h) / jnp.maximum(jnp.sum(w), 1.0)
        elif self.pool == "cls":
            z = h[0]
        else:
            z, head_diag = self.head.pool(h, players=valid, key=kh, return_diagnostics=True)
        logits = self.readout(jax.nn.gelu(self.hidden(z)))
        if return_diagnostics:
            return logits, PairDiagnostics(diag, head_diag)
        return logits
