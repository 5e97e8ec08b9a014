"""From a config to a finished run directory."""

from __future__ import annotations

import pathlib
from typing import Optional

import jax

from .. import config as _config
from .. import data as _data
from .. import nn as _nn
from . import _mesh
from ._checkpoint import load_latest
from ._loop import fit
from ._step import init_opt_state
from ._step import make_optimizer, make_schedule, num_params


def build_dataset(cfg: "_config.Config"):
    """The dataset a config names (raises with the fetch command if it is not downloaded)."""
    d = cfg.data
    if d.task == "brackets":
        return _data.BracketMatching(seq_len=d.seq_len, batch_size=d.batch_size, seed=d.seed)
    if d.task == "chars":
        return _data.CharText.from_path(
            d.path, seq_len=d.seq_len, batch_size=d.batch_size, seed=d.seed,
            val_fraction=d.val_fraction, max_chars=d.max_chars,
        )
    if d.task == "nli":
        phenomena = tuple(x.strip() for x in d.phenomena.split(",") if x.strip())
        try:
            return _data.GeneratedNLI(seq_len=d.seq_len, batch_size=d.batch_size, seed=d.seed,
                                      distractors=d.distractors, held_out=d.held_out,
                                      phenomena=phenomena)
        except ValueError as e:
            raise _config.ConfigError(f"data (task nli): {e}") from None
    if d.task == "snli":
        return _data.NLIFile.from_path(d.path, seq_len=d.seq_len, batch_size=d.batch_size,
                                       seed=d.seed, max_vocab=d.max_vocab,
                                       max_examples=d.max_examples)
    if d.task == "digits":
        return _data.ImageDataset.digits(batch_size=d.batch_size, seed=d.seed)
    if d.task == "fashion_mnist":
        default = _config.DataConfig.__dataclass_fields__["path"].default
        try:
            return _data.ImageDataset.fashion_mnist(
                None if d.path == default else d.path, batch_size=d.batch_size, seed=d.seed,
                val_size=d.val_size, max_train=d.max_train)
        except _data.ImageDataNotFound as e:
            raise FileNotFoundError(str(e)) from None
        except _data.ImageDataError as e:
            raise _config.ConfigError(f"data (task fashion_mnist): {e}") from None
    raise _config.ConfigError(f"data.task: unknown task {d.task!r}.")  # pragma: no cover


def build_model(cfg: "_config.Config", dataset, *, key):
    """The model for a config and dataset: a `CausalLM` for text, a `Tagger` for tagging, an
    `ImageClassifier` for images (`model.embed`, `model.residual`, ...), a
    `PairClassifier` for sentence pairs (`model.pool`; the NeuroGame pooled head takes its
    options from `model.neurogame`).

    The attention is looked up in the registry (`nn.register_attention`); its class turns the
    config section `model.<attention>` into constructor arguments (`from_config`)."""
    m = cfg.model
    reg = _nn.get_attention(m.attention)
    section = getattr(m, reg.name) if reg.config is not None else None
    common = dict(
        dim=m.dim, depth=m.depth, num_heads=m.num_heads, max_len=dataset.seq_len,
        attention=reg.cls, attention_kwargs=reg.kwargs_from(section),
        ffn_hidden=m.ffn_hidden, dropout=m.dropout,
    )

    def make(k):
        if dataset.kind == "image_classification":
            return _nn.ImageClassifier(
                tuple(dataset.image_shape), dataset.num_classes, dim=m.dim, depth=m.depth,
                num_heads=m.num_heads, attention=reg.cls,
                attention_kwargs=reg.kwargs_from(section), embed=m.embed, patch=m.patch,
                conv_channels=m.conv_channels, residual=m.residual, ffn_hidden=m.ffn_hidden,
                positions=m.positions, dropout=m.dropout, key=k)
        if dataset.kind == "pair_classification":
            ngt = _nn.get_attention("neurogame")
            return _nn.PairClassifier(
                dataset.vocab_size, dataset.num_classes, pool=m.pool,
                pool_kwargs=ngt.kwargs_from(m.neurogame) if m.pool == "ngt" else None,
                key=k, **common)
        if dataset.kind == "lm":
            return _nn.CausalLM(dataset.vocab_size, key=k, **common)
        return _nn.Tagger(dataset.vocab_size, dataset.num_classes, causal=True, key=k, **common)

    return make(key)


def build_mesh(cfg: "_config.Config"):
    """The device mesh of `train.mesh` (None on a single device with no mesh asked for:
    training then runs unsharded, as it always has). Raises `ConfigError` when the mesh does
    not fit the devices or `data.batch_size` does not split over its `data` axis."""
    if cfg.train.mesh is None and jax.device_count() == 1:
        return None
    mesh = _mesh.make_mesh(cfg.train.mesh)
    _mesh.check_batch_size(cfg.data.batch_size, mesh)
    return mesh


def build_optimizer(cfg: "_config.Config"):
    t = cfg.train
    return make_optimizer(
        steps=t.steps, lr=t.lr, coupling_lr=t.coupling_lr, weight_decay=t.weight_decay,
        coupling_weight_decay=t.coupling_weight_decay,
        warmup_steps=t.warmup_steps, min_lr_ratio=t.min_lr_ratio, grad_clip=t.grad_clip,
    )


def _diff(a: dict, b: dict, prefix="") -> list[str]:
    keys = []
    for k in sorted(set(a) | set(b)):
        va, vb = a.get(k), b.get(k)
        if isinstance(va, dict) and isinstance(vb, dict):
            keys += _diff(va, vb, prefix + k + ".")
        elif va != vb:
            keys.append(prefix + k)
    return keys


_RESUMABLE_CHANGES = {"train.progress", "description"}


def run(cfg: "_config.Config", out_dir, *, resume: bool = False, progress: Optional[bool] = None):
    """Train the experiment `cfg` into `out_dir` (see `fit`); returns the summary dict.

    The resolved config is saved as `out_dir/config.yaml`. With `resume=True` the saved config
    must match `cfg` (apart from `train.progress`), and training continues from the newest
    intact checkpoint.
    """
    out = pathlib.Path(out_dir)
    saved = out / "config.yaml"
    if resume and saved.exists():
        old = _config.to_dict(_config.load_config(saved))
        changed = [k for k in _diff(old, _config.to_dict(cfg)) if k not in _RESUMABLE_CHANGES]
        if changed:
            raise _config.ConfigError(
                f"--resume: the config differs from the one saved in {saved} at "
                f"{', '.join(changed)}; resume with the same config, or start a new run with "
                "another --out."
            )
    mesh = build_mesh(cfg)
    dataset = build_dataset(cfg)
    model = build_model(cfg, dataset, key=jax.random.key(cfg.train.seed))
    optimizer = build_optimizer(cfg)
    if _mesh.is_writer():  # with several processes only process 0 writes
        out.mkdir(parents=True, exist_ok=True)
        _config.save_config(cfg, saved)
        if callable(getattr(dataset, "save", None)):  # e.g. the vocabulary of a tokenizer
            dataset.save(out)
    t = cfg.train
    extra = {
        "num_params": num_params(model),
        "description": cfg.description,
        "baselines": dataset.baselines(dataset.batch(0, "val")),
    }
    _, summary = fit(
        model, optimizer, dataset, out_dir=out, steps=t.steps, seed=t.seed,
        eval_batches=cfg.data.eval_batches, log_every=t.log_every, eval_every=t.eval_every,
        patience=t.patience, checkpoint_every=t.checkpoint_every,
        keep_checkpoints=t.keep_checkpoints, resume=resume,
        progress=t.progress if progress is None else progress,
        lr_schedule=make_schedule(t.lr, t.steps, t.warmup_steps, t.min_lr_ratio),
        extra_summary=extra, max_bad_steps=t.max_bad_steps, accumulate=t.accumulate,
        precision=t.precision, mesh=mesh,
    )
    return summary


def load_run(run_dir):
    """The trained model of a run directory: `(cfg, dataset, model)` from its saved
    `config.yaml` and newest intact checkpoint (raises `FileNotFoundError` if there is
    none)."""
    run_dir = pathlib.Path(run_dir)
    saved = run_dir / "config.yaml"
    if not saved.exists():
        raise FileNotFoundError(f"{run_dir}: no config.yaml; is this a run directory?")
    cfg = _config.load_config(saved)
    dataset = build_dataset(cfg)
    like = build_model(cfg, dataset, key=jax.random.key(cfg.train.seed))
    got = load_latest(run_dir, (like, init_opt_state(build_optimizer(cfg), like)))
    if got is None:
        raise FileNotFoundError(f"{run_dir}: no checkpoint to load (the run wrote none yet).")
    return cfg, dataset, got[1]
