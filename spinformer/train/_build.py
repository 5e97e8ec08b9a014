"""From a config to the objects a run is made of: the dataset, the model, the objective, the
device mesh and the optimizer (`build_*`); each refuses what it cannot build with a
`ConfigError` naming the key, before any training time is spent.

A data file that is empty, truncated or malformed, or a model the config cannot build, is
reported here (`build_dataset`, `build_model`, `check_objective`).
"""

from __future__ import annotations

import equinox as eqx
import jax

from .. import config as _config
from .. import data as _data
from .. import nn as _nn
from .. import solvers as _solvers
from . import _mesh
from ._objective import Objective, objective_for
from ._optim import optimizer_for


def build_dataset(cfg: "_config.Config"):
    """The dataset a config names.

    Raises `FileNotFoundError` for data that is not there (with the fetch or install command),
    and `ConfigError` for data that cannot be used: a `data.DataFileError` (an empty,
    truncated or malformed file, named with the line where the format has lines) as
    `data.path: ...`, and any other refusal of the dataset (e.g. a `data.seq_len` too short
    for the generated pairs) as `data (task ...): ...`.
    """
    d = cfg.data
    try:
        return _make_dataset(d)
    except _data.ImageDataNotFound as e:
        raise FileNotFoundError(str(e)) from None
    except FileNotFoundError:
        raise
    except _data.DataFileError as e:
        raise _config.ConfigError(f"data.path: {e}") from None
    except ImportError as e:  # a dataset whose reader is an optional dependency
        extra = (' (it comes with the notebooks and dev extras: pip install -e ".[notebooks]")'
                 if "scikit-learn" in str(e) else "")
        raise _config.ConfigError(f"data.task={d.task}: {e}{extra}") from None
    except ValueError as e:
        raise _config.ConfigError(f"data (task {d.task}): {e}") from None


def _make_dataset(d: "_config.DataConfig"):
    if d.corrupt is not None and d.task not in ("digits", "fashion_mnist"):
        raise _config.ConfigError(f"data.corrupt={d.corrupt}: only the image tasks (digits, "
                                  f"fashion_mnist) can be reconstructed; data.task is "
                                  f"{d.task}. Use data.corrupt: null.")
    if d.task == "brackets":
        return _data.BracketMatching(seq_len=d.seq_len, batch_size=d.batch_size, seed=d.seed)
    if d.task == "chars":
        return _data.CharText.from_path(
            d.path, seq_len=d.seq_len, batch_size=d.batch_size, seed=d.seed,
            val_fraction=d.val_fraction, test_fraction=d.test_fraction, max_chars=d.max_chars,
            stream=d.stream,
        )
    if d.task == "nli":
        phenomena = tuple(x.strip() for x in d.phenomena.split(",") if x.strip())
        return _data.GeneratedNLI(seq_len=d.seq_len, batch_size=d.batch_size, seed=d.seed,
                                  distractors=d.distractors, held_out=d.held_out,
                                  phenomena=phenomena)
    if d.task == "snli":
        return _data.NLIFile.from_path(d.path, seq_len=d.seq_len, batch_size=d.batch_size,
                                       seed=d.seed, max_vocab=d.max_vocab,
                                       max_examples=d.max_examples)
    if d.task in ("digits", "fashion_mnist"):
        if d.task == "digits":
            images = _data.ImageDataset.digits(batch_size=d.batch_size, seed=d.seed)
        else:
            default = _config.DataConfig.__dataclass_fields__["path"].default
            images = _data.ImageDataset.fashion_mnist(
                None if d.path == default else d.path, batch_size=d.batch_size, seed=d.seed,
                val_size=d.val_size, max_train=d.max_train)
        if d.corrupt is None:
            return images
        return _data.ImageReconstruction(images, d.corrupt, mask_fraction=d.mask_fraction,
                                         noise_variance=d.noise_variance)
    raise _config.ConfigError(f"data.task: unknown task {d.task!r}.")  # pragma: no cover


def build_model(cfg: "_config.Config", dataset, *, key):
    """The model for a config and dataset: a `CausalLM` for text, a `Tagger` for tagging, an
    `ImageClassifier` for images (`model.embed`, `model.residual`, ...), an
    `ImageReconstructor` for corrupted images (`data.corrupt`; `model.embed=patch`), a
    `PairClassifier` for sentence pairs (`model.pool`). With `train.local_losses` the text
    models stop gradients between blocks (`detach_layers=True`).

    The attention's registration (`nn.get_attention(cfg.model.attention)`, looked up once and
    passed to the model) turns its settings into constructor arguments
    (`Registration.kwargs_from`: the fields by name). A model
    the modules refuse to build (a `ValueError`, e.g. free-energy attention in a causal
    model, or a patch size that does not divide the images) is a `ConfigError` naming the
    attention and the task.

    The training step logs the backward solves of the model's implicit adjoints
    (`solvers.backward_stats`), so the model gets recorded adjoints
    (`solvers.record_backward`, before the layers are stacked: one probe per layer)."""
    m = cfg.model
    reg = _nn.get_attention(m.attention)
    section = m.attention
    attention_kwargs = _solvers.record_backward(reg.kwargs_from(section))
    common = dict(
        dim=m.dim, depth=m.depth, num_heads=m.num_heads, max_len=dataset.seq_len,
        attention=reg, attention_kwargs=attention_kwargs,
        ffn_hidden=m.ffn_hidden, dropout=m.dropout,
    )
    sequence = dict(detach_layers=cfg.train.local_losses)

    def make(k):
        if dataset.kind == "image_classification":
            return _nn.ImageClassifier(
                tuple(dataset.image_shape), dataset.num_classes, dim=m.dim, depth=m.depth,
                num_heads=m.num_heads, attention=reg,
                attention_kwargs=attention_kwargs,
                embed=m.embed, patch=m.patch,
                conv_channels=m.conv_channels, residual=m.residual, ffn_hidden=m.ffn_hidden,
                positions=m.positions, dropout=m.dropout, key=k)
        if dataset.kind == "reconstruction":
            if m.embed != "patch":
                raise ValueError("reconstruction maps each patch back to its pixels: use "
                                 "model.embed=patch (with model.patch dividing the image)")
            return _nn.ImageReconstructor(
                tuple(dataset.image_shape), dim=m.dim, depth=m.depth, num_heads=m.num_heads,
                attention=reg, attention_kwargs=attention_kwargs, patch=m.patch,
                residual=m.residual, ffn_hidden=m.ffn_hidden, positions=m.positions,
                dropout=m.dropout, key=k)
        if dataset.kind == "pair_classification":
            pool, pool_kwargs = _nn.pool_settings(m.pool)
            return _nn.PairClassifier(dataset.vocab_size, dataset.num_classes, pool=pool,
                                      pool_kwargs=_solvers.record_backward(pool_kwargs),
                                      key=k, **common)
        if dataset.kind == "lm":
            return _nn.CausalLM(dataset.vocab_size, key=k, **common, **sequence)
        return _nn.Tagger(dataset.vocab_size, dataset.num_classes, causal=True, key=k, **common,
                          **sequence)

    try:
        return make(key)
    except ValueError as e:
        raise _config.ConfigError(f"model.attention={reg.name} with data.task="
                                  f"{cfg.data.task}: {e}") from None


def build_objective(cfg: "_config.Config") -> Objective:
    """What training minimises: the cross-entropy, plus `train.entropy_weight` times the
    entropy production, or with `train.local_losses` the sum of the layers' own losses."""
    return objective_for(cfg.train)


def check_objective(cfg: "_config.Config", model, dataset) -> None:
    """Refuse, before training, an objective the model cannot serve: a nonzero
    `train.entropy_weight` with a model that reports no entropy production, or local losses
    or streaming with a model that reports no per-layer outputs or no state. Traced once
    on one example (`jax.eval_shape`: nothing is computed); a `ConfigError` naming the keys."""
    t = cfg.train
    if not (t.entropy_weight or t.local_losses or cfg.data.stream):
        return
    batch = dataset.batch(0, "train")
    x = jax.numpy.asarray(batch["inputs"][0])
    diag = eqx.filter_eval_shape(lambda m, x: m(x, return_diagnostics=True)[1], model, x)
    if t.entropy_weight and getattr(diag, "entropy_production", None) is None:
        raise _config.ConfigError(
            f"train.entropy_weight={t.entropy_weight}: the model for data.task={cfg.data.task} "
            f"with model.attention={cfg.model.attention.name} reports no entropy production; use "
            "model.attention=spin, or train.entropy_weight=0.")
    if t.local_losses and (getattr(diag, "hidden", None) is None
                           or not hasattr(model, "layer_logits")):
        raise _config.ConfigError(
            f"train.local_losses=true: the model for data.task={cfg.data.task} with "
            f"model.attention={cfg.model.attention.name} has no per-layer readouts; use "
            "train.local_losses=false.")
    if cfg.data.stream and getattr(diag, "state", None) is None:
        raise _config.ConfigError(  # pragma: no cover - the config already checks this
            f"data.stream=true: model.attention={cfg.model.attention.name} carries no state.")


def build_mesh(cfg: "_config.Config"):
    """The device mesh of `train.mesh` (`mesh_for`; None on a single device with no mesh
    asked for: training then runs unsharded). Raises `ConfigError` when the mesh does not fit
    the devices or `data.batch_size` does not split over its `data` axis."""
    mesh = _mesh.mesh_for(cfg.train.mesh)
    if mesh is not None:
        _mesh.check_batch_size(cfg.data.batch_size, mesh)
    return mesh


def build_optimizer(cfg: "_config.Config"):
    """The optimizer of `cfg.train` (`optimizer_for`: AdamW with its warmup-cosine
    schedule and coupling group, `make_optimizer`)."""
    return optimizer_for(cfg.train)
