"""Experiment configuration: YAML files read into frozen dataclasses.

Every field has a default and a one-line meaning (`describe()` prints them). An unknown or
mistyped key is an error that names the key and the nearest valid one. Changes are a mapping
of dotted keys to values, checked like the file: `cfg.replace({...})` on a config, and the
command line's `--set a.b=v` (read as YAML scalars) on top of a file.

```python
cfg = load_config("configs/quickstart.yaml", overrides=["train.steps=200"])
cfg.train.steps  # 200
cfg.replace({"train.steps": 5, "model.spin.update": "mean_field"}).train.steps  # 5
```

The model section holds the options of its attention as a sub-section named after it
(`model.spin`, `model.boltzmann`, ...): each attention module declares its own config
dataclass with `spinformer.nn.register_attention`, and every `ModelConfig` reads the registry
when it is made. `keys(section)` lists a section's keys with their defaults, meanings and
choices; this module is also the one walk of the schema that reading, `--set`, `describe`
and the tests use.
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
import types
import typing
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Union

import yaml

from . import _schema
from ._schema import AdjointOptions, ConfigError, SolverOptions, option
from .nn import _image, _pair

__all__ = [
    "AdjointOptions",
    "Config",
    "ConfigError",
    "DataConfig",
    "Key",
    "ModelConfig",
    "SolverOptions",
    "TrainConfig",
    "describe",
    "from_dict",
    "keys",
    "load_config",
    "option",
    "parse_overrides",
    "reference_markdown",
    "save_config",
    "to_dict",
]


_f = option


def _need(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


def _at_least(section, minimum, *names: str) -> None:
    """Each named field of `section` (skipped when null) must be >= `minimum`."""
    for name in names:
        value = getattr(section, name)
        _need(value is None or value >= minimum, f"{name}={value} must be >= {minimum}.")


def _positive(section, *names: str) -> None:
    """Each named field of `section` (skipped when null) must be > 0."""
    for name in names:
        value = getattr(section, name)
        _need(value is None or value > 0, f"{name}={value} must be > 0.")


@dataclass(frozen=True)
class DataConfig:
    task: str = _f("brackets", "which dataset: brackets (Dyck-1 matching), chars "
                   "(character-level language modelling), nli (generated natural language "
                   "inference), snli (SNLI/MNLI JSON-lines files at data.path), fashion_mnist "
                   "(IDX files; the Debian package dataset-fashion-mnist or data.path) or "
                   "digits (scikit-learn's 8x8 digits)",
                   ("brackets", "chars", "nli", "snli", "fashion_mnist", "digits"))
    seq_len: int = _f(12, "sequence length T (tokens per example)")
    batch_size: int = _f(32, "examples per training batch")
    path: str = _f("shakespeare", "chars: a text file, or a fetched dataset name "
                   "(`spinformer data fetch shakespeare`); snli: the data directory; "
                   "fashion_mnist: a directory of MNIST-format IDX files (the default value "
                   "means the Debian package's /usr/share/datasets/fashion-mnist)")
    max_chars: Optional[int] = _f(None, "chars only: use only the first max_chars characters "
                                  "of the text (null: all)")
    val_fraction: float = _f(0.1, "chars only: the last fraction of the text held out for "
                             "validation")
    distractors: int = _f(0, "nli only: irrelevant modifiers inserted into each sentence "
                          "(difficulty; labels unchanged)")
    held_out: bool = _f(True, "nli only: val/test use words and templates never seen in "
                        "training")
    phenomena: str = _f("negation,quantifier,order,lexical", "nli only: comma-separated "
                        "phenomena the pairs test (negation, quantifier, order, lexical); "
                        "without order every pair fits in 13 tokens")
    max_vocab: int = _f(20000, "snli only: the most frequent training words kept (others "
                        "become [UNK])")
    max_examples: Optional[int] = _f(None, "snli only: use only the first max_examples "
                                     "training pairs (null: all)")
    val_size: int = _f(5000, "fashion_mnist only: the last val_size training images are "
                       "held out for validation (the test split is the t10k file)")
    max_train: Optional[int] = _f(None, "images only: use only the first max_train training "
                                  "images (null: all)")
    corrupt: Optional[str] = _f(None, "images only: reconstruct images corrupted this way "
                                "instead of classifying them: mask (a fraction "
                                "data.mask_fraction of the pixels set to 0) or noise (Gaussian "
                                "noise of variance data.noise_variance); the loss is the mean "
                                "squared error per pixel (null: classification)",
                                choices=(None, "mask", "noise"))
    mask_fraction: float = _f(0.3, "corrupt=mask only: the fraction of pixels masked")
    noise_variance: float = _f(0.7, "corrupt=noise only: the variance of the added noise")
    eval_batches: int = _f(8, "validation batches per evaluation")
    seed: int = _f(0, "seed of the data stream (batch i depends only on seed, split and i)")
    stream: bool = _f(False, "chars only: read the text in order as batch_size contiguous "
                      "streams, batch i holding chunk i of every stream, and carry the "
                      "attention's state from one batch to the next (truncated "
                      "backpropagation through time; needs model.attention=spin with "
                      "model.spin.mode=steps and model.spin.init=carried)")

    def __post_init__(self):
        _need(self.seq_len >= 2, f"seq_len={self.seq_len} must be >= 2.")
        _at_least(self, 1, "batch_size", "eval_batches", "max_chars", "max_examples",
                  "val_size", "max_train")
        _at_least(self, 0, "distractors", "seed")
        # four special tokens and at least one word (`data.build_vocab`)
        _need(self.max_vocab >= 5, f"max_vocab={self.max_vocab} must be >= 5.")
        _need(0.0 < self.val_fraction < 1.0,
              f"val_fraction={self.val_fraction} must be in (0, 1).")
        _need(not self.stream or self.task == "chars",
              f"stream=true reads a text in order: it needs task=chars; got task={self.task}.")


def _attention_help() -> str:
    regs = _schema.registrations()
    described = ", ".join(f"{r.name} ({r.help})" if r.help else r.name for r in regs)
    return f"attention mechanism: {described}"


def _section_help(name: str) -> str:
    return f"options of {name} attention (used only by attention={name})"


@dataclass(frozen=True)
class ModelConfig:
    """The model: the attention, the sizes, and one section of options per registered
    attention that declares a config (`model.spin`, `model.boltzmann`, ...).

    The attention sections are read from the registry (`spinformer.nn.register_attention`)
    whenever a `ModelConfig` is made, so an attention registered after this module was
    imported has its section at once. They are reached as attributes (`cfg.model.spin`) or
    with `section(name)`; in Python, pass them as `ModelConfig(sections={"spin":
    SpinConfig(beta=3.0)})` (a section not given takes its defaults).
    """

    attention: str = dataclasses.field(
        default_factory=lambda: _schema.default_attention(),
        metadata={"help": _attention_help, "choices": _schema.attention_names})
    dim: int = _f(32, "model width D")
    depth: int = _f(1, "number of blocks")
    num_heads: int = _f(1, "attention heads per block (D must be divisible by it)")
    ffn_hidden: int = _f(64, "hidden width of each block's feed-forward network (0: none)")
    dropout: float = _f(0.0, "dropout rate on the residual branches")
    pool: _pair.Pool = _f("mean", "pair classification (nli, snli) only: how the encoded "
                          "pair becomes one vector: mean (of the tokens), cls (first token) or "
                          "ngt (the NeuroGame paper's pooled game head, options from "
                          "model.neurogame)")
    embed: _image.ImageEmbed = _f("conv", "images only: conv (two conv+pool stages to a grid "
                                  "of sites, as in the Deep Implicit Attention post; images >= "
                                  "16x16) or patch (linear embedding of patch x patch patches)")
    patch: int = _f(4, "images, embed=patch only: patch side in pixels")
    conv_channels: int = _f(32, "images, embed=conv only: channels of the convolutions")
    residual: bool = _f(True, "images only: wrap each attention in a pre-norm residual block "
                        "with FFN (false: the attentions alone, one after the other, as a DEQ "
                        "layer)")
    positions: bool = _f(True, "images only: learned position embedding of the sites")
    # (name, section) of the attentions this model uses that declare a config: the chosen
    # attention's and, with pool=ngt, the NeuroGame head's; not a YAML key: the sections
    # appear as `model.<name>`
    sections: tuple = dataclasses.field(default=(), metadata={"sections": True})

    def __post_init__(self):
        _check_model(self)
        given = dict(self.sections)
        regs = {r.name: r for r in _schema.registrations() if r.config is not None}
        used = [name for name in _used_sections(self) if name in regs]
        for name in sorted(set(given) - set(used)):
            if name not in regs:
                raise ConfigError(f"{name}: attention {name!r} declares no config section.")
            changed = ", ".join(f"model.{name}.{k}={v!r}" for k, v in
                                _flat_diff(given[name], regs[name].config()))
            changed = f" ({changed})" if changed else ""
            raise ConfigError(f"{name}: options of {name} attention{changed}, but "
                              f"model.attention is {self.attention}; remove the section, or "
                              f"set model.attention={name}.")
        for name, section in given.items():
            if not isinstance(section, regs[name].config):
                raise ConfigError(f"{name}: expected a {regs[name].config.__name__}, got "
                                  f"{type(section).__name__}.")
        object.__setattr__(self, "sections", tuple(
            (name, given[name] if name in given else regs[name].config()) for name in used))

    def __getattr__(self, name: str):
        # reached only when ordinary lookup fails: the attention sections
        if name.startswith("__"):
            raise AttributeError(name)
        try:
            sections = object.__getattribute__(self, "sections")
        except AttributeError:
            raise AttributeError(name) from None
        for key, section in sections:
            if key == name:
                return section
        raise AttributeError(f"ModelConfig has no field or attention section {name!r}.")

    @staticmethod
    def _open_sections():
        """`(name, section class, help)` of every registered attention with a config: the
        keys `model.<name>` beside the fields (read by `keys`)."""
        return tuple((r.name, r.config, _section_help(r.name))
                     for r in _schema.registrations() if r.config is not None)

    def section(self, name: Optional[str] = None):
        """The options section of attention `name` (default: `self.attention`), or None when
        that attention declares no config."""
        return dict(self.sections).get(self.attention if name is None else name)


def _flat_diff(section, default, prefix: str = "") -> list[tuple[str, Any]]:
    """`(dotted key, value)` where `section` differs from `default` (both config sections)."""
    out = []
    for f in dataclasses.fields(section):
        v, d = getattr(section, f.name), getattr(default, f.name)
        if dataclasses.is_dataclass(v) and dataclasses.is_dataclass(d):
            out += _flat_diff(v, d, f"{prefix}{f.name}.")
        elif v != d:
            out.append((prefix + f.name, v))
    return out


def _used_sections(model) -> list[str]:
    """The attentions whose sections `model` reads: its attention and its pooled head's."""
    from .nn import pool_attention

    head = pool_attention(model.pool)
    return [model.attention] + ([head.name] if head and head.name != model.attention else [])


def _check_model(self):
    if not (self.dim >= 1 and self.depth >= 1 and self.num_heads >= 1):
        raise ConfigError("dim, depth and num_heads must be >= 1.")
    if self.dim % self.num_heads:
        raise ConfigError(f"dim={self.dim} is not divisible by num_heads={self.num_heads}.")
    try:
        reg = _schema.get_attention(self.attention)
    except ValueError as e:
        raise ConfigError(f"attention: {e}") from None
    least = reg.min_head_dim
    if self.dim // self.num_heads < least:
        raise ConfigError(f"{self.attention} attention needs a head width dim/num_heads >= "
                          f"{least}; got {self.dim // self.num_heads}.")
    if not 0.0 <= self.dropout < 1.0:
        raise ConfigError(f"dropout={self.dropout} must be in [0, 1).")
    if self.patch < 1 or self.conv_channels < 1:
        raise ConfigError(f"patch={self.patch} and conv_channels={self.conv_channels} must be "
                          ">= 1.")
    _at_least(self, 0, "ffn_hidden")


@dataclass(frozen=True)
class TrainConfig:
    steps: int = _f(1000, "number of optimizer steps")
    lr: float = _f(1e-3, "peak learning rate (AdamW, linear warmup then cosine decay)")
    coupling_lr: Optional[float] = _f(None, "peak learning rate of the coupling parameters "
                                      "(query/key maps of softmax/spin attention, the Ising "
                                      "couplings J, K of boltzmann attention); null: same as lr")
    weight_decay: float = _f(0.01, "AdamW decoupled weight decay")
    coupling_weight_decay: Optional[float] = _f(None, "weight decay of the coupling parameters; "
                                                "null: same as weight_decay")
    warmup_steps: int = _f(100, "linear warmup steps")
    min_lr_ratio: float = _f(0.1, "final learning rate as a fraction of the peak")
    grad_clip: float = _f(1.0, "clip gradients to this global norm (0: no clipping)")
    log_every: int = _f(10, "append training metrics to metrics.jsonl every this many steps")
    eval_every: int = _f(100, "evaluate on the validation split every this many steps")
    patience: int = _f(0, "stop after this many evaluations without a better validation "
                       "loss (0: never stop early)")
    checkpoint_every: int = _f(0, "write a checkpoint every this many steps (0: only at "
                               "the end)")
    keep_checkpoints: int = _f(3, "how many recent checkpoints to keep")
    seed: int = _f(0, "seed of the model initialisation and dropout")
    progress: bool = _f(True, "show a progress bar")
    max_bad_steps: int = _f(20, "a step whose loss or gradient is NaN or infinite is skipped "
                            "(parameters and optimiser state unchanged, counted as bad_steps); "
                            "this many in a row stop the run, keeping its checkpoints")
    accumulate: int = _f(1, "gradient accumulation: each optimizer step averages the gradients "
                         "of this many micro-batches of data.batch_size examples (effective "
                         "batch accumulate * batch_size)")
    precision: str = _f("float32", "float32, or bfloat16: matrix products in bfloat16 with "
                        "float32 parameters, optimiser state and fixed-point solves",
                        ("float32", "bfloat16"))
    mesh: Optional[dict] = _f(None, "device mesh for data parallelism, axis name -> size, e.g. "
                              "{data: 4} or {data: 2, model: 2} (a size -1 takes the remaining "
                              "devices); null: every device on the data axis")
    tensorboard: bool = _f(False, "also write every metrics.jsonl record as TensorBoard "
                           "scalars (<split>/<metric>) and the run's figures as images at the "
                           "end, into <run>/tensorboard (needs tensorboardX: pip install -e "
                           "\".[track]\")")
    checkpointer: str = _f("auto", "checkpoint files: native (one checksummed file, written "
                           "by process 0), orbax (orbax-checkpoint: every process writes its "
                           "shards), or auto (orbax only when a model axis spans several "
                           "processes)", ("auto", "native", "orbax"))
    entropy_weight: float = _f(0.0, "add entropy_weight * (entropy production, summed over "
                               "layers, averaged over examples and heads) to the loss: > 0 "
                               "minimises it, < 0 maximises it (an attention that reports it: "
                               "spin)")
    local_losses: bool = _f(False, "per-layer local losses: stop gradients between blocks and "
                            "train each block on the cross-entropy of its own readout (final "
                            "norm + readout of its output), summed over layers; loss and "
                            "accuracy stay the last layer's (per-position tasks: brackets, "
                            "chars)")

    def __post_init__(self):
        _need(self.steps >= 1, f"steps={self.steps} must be >= 1.")
        _need(self.max_bad_steps >= 1, f"max_bad_steps={self.max_bad_steps} must be >= 1.")
        _need(self.accumulate >= 1, f"accumulate={self.accumulate} must be >= 1.")
        if self.mesh is not None:
            _need(isinstance(self.mesh, dict) and len(self.mesh) > 0,
                  f"mesh={self.mesh!r} must be a mapping of axis names to sizes, e.g. "
                  "{data: 4}, or null.")
            unknown = sorted(set(self.mesh) - {"data", "model"})
            _need(not unknown, f"mesh: unknown axis {unknown[0]!r}; the axes are data and "
                  "model." if unknown else "")
            for name, size in self.mesh.items():
                _need(isinstance(size, int) and not isinstance(size, bool)
                      and (size >= 1 or size == -1),
                      f"mesh.{name}={size!r} must be a positive integer or -1 (the rest).")
            _need(sum(1 for v in self.mesh.values() if v == -1) <= 1,
                  "mesh: at most one axis may have size -1.")
        _need(self.lr > 0, f"lr={self.lr} must be > 0.")
        _need(self.log_every >= 1 and self.eval_every >= 1,
              "log_every and eval_every must be >= 1.")
        _need(self.keep_checkpoints >= 1, "keep_checkpoints must be >= 1.")
        _need(self.patience >= 0 and self.checkpoint_every >= 0,
              "patience and checkpoint_every must be >= 0.")
        _at_least(self, 0, "coupling_lr", "weight_decay", "coupling_weight_decay",
                  "warmup_steps", "grad_clip", "seed")
        _need(0.0 <= self.min_lr_ratio <= 1.0,
              f"min_lr_ratio={self.min_lr_ratio} must be in [0, 1].")


@dataclass(frozen=True)
class Config:
    description: str = _f("", "one line saying what this experiment is")
    data: DataConfig = _f(DataConfig, "the dataset")
    model: ModelConfig = _f(ModelConfig, "the model")
    train: TrainConfig = _f(TrainConfig, "the optimisation loop")

    def __post_init__(self):
        # checks across sections (a section's own are in its `__post_init__`)
        if self.data.stream:
            reg = _schema.get_attention(self.model.attention)
            section = self.model.section()
            if reg.carries_state is None or not reg.carries_state(section):
                able = [f"model.attention={r.name} with {r.carries_state_when}"
                        for r in _schema.registrations() if r.carries_state is not None]
                raise ConfigError(
                    "data.stream=true carries the attention's state from one batch to the "
                    f"next: it needs {' or '.join(able) or 'an attention that carries state'}"
                    f"; got model.attention={self.model.attention}"
                    + "".join(f", model.{reg.name}.{k}={getattr(section, k)}"
                              for k in reg.carries_state_keys) + ".")
        _need(not self.train.local_losses or self.data.task in ("brackets", "chars"),
              "train.local_losses=true trains each layer on its own per-position readout: it "
              f"needs a per-position task (data.task brackets or chars); got data.task="
              f"{self.data.task}.")

    def replace(self, changes: Mapping[str, Any]) -> "Config":
        """A copy with changes, checked like a config file.

        **Arguments:**

        - `changes`: a mapping of dotted keys to Python values, e.g.
          `cfg.replace({"train.steps": 5, "model.boltzmann.mode": "h"})`.

        **Returns:** a new frozen `Config`. Raises `ConfigError` naming any bad key or value.
        """
        return _build(to_dict(self), dict(changes))


# ------------------------------------------------ reading and writing sections (the schema walk)

# integers are sizes, counts and seeds, used as int32 by JAX (a larger seed would be
# silently truncated to 32 bits)
_INT_LIMIT = 2**31


def _hints(cls) -> dict[str, Any]:
    return typing.get_type_hints(cls)


@dataclass(frozen=True)
class Key:
    """One key of a config section, as `keys` lists it.

    **Fields:** `name`; `type` (a Python type, `Optional[...]`, or a section's dataclass);
    `default` (a section's dataclass for a section); `help` (one line); `choices` (the
    allowed values, or None).
    """

    name: str
    type: Any
    default: Any
    help: str
    choices: Optional[tuple] = None

    @property
    def is_section(self) -> bool:
        return dataclasses.is_dataclass(self.type)


def _keys(cls) -> dict[str, Key]:
    """The keys of a config section (default: the whole `Config`), in order: its fields and,
    for `ModelConfig`, the section of every registered attention that declares one (read
    from the registry now). The one walk of the schema: reading, `--set`, `describe` and the
    tests all use it. Given a section instance instead of its class, the defaults are that
    instance's values (a family's own solver defaults, for example)."""
    if not isinstance(cls, type):
        return {name: dataclasses.replace(k, default=getattr(cls, name))
                for name, k in _keys(type(cls)).items()}
    hints = _hints(cls)
    out: dict[str, Key] = {}
    for f in dataclasses.fields(cls):
        if f.metadata.get("sections"):
            continue
        meta = f.metadata
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif dataclasses.is_dataclass(hints[f.name]):
            default = hints[f.name]
        else:
            default = f.default_factory()
        help_, choices = meta.get("help", ""), meta.get("choices")
        if choices is None and typing.get_origin(hints[f.name]) is typing.Literal:
            choices = typing.get_args(hints[f.name])  # a Literal field: its values
        out[f.name] = Key(f.name, hints[f.name], default,
                          help_() if callable(help_) else help_,
                          tuple(choices()) if callable(choices) else choices)
    for name, tp, help_ in getattr(cls, "_open_sections", lambda: ())():
        out[name] = Key(name, tp, tp, help_)
    return out


def _unwrap_optional(tp):
    origin = typing.get_origin(tp)
    if origin in (Union, getattr(types, "UnionType", Union)):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(tp)) == 2:
            return args[0], True
    return tp, False


def _coerce(value, tp, where: str):
    tp, optional = _unwrap_optional(tp)
    if typing.get_origin(tp) is typing.Literal:  # the allowed values are checked next
        tp = type(typing.get_args(tp)[0])
    if value is None:
        if optional:
            return None
        raise ConfigError(f"{where}: null is not allowed; give a {tp.__name__}.")
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{where}: expected true or false, got {value!r}.")
    if tp is int:
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, int) and not isinstance(value, bool):
            if not -_INT_LIMIT <= value < _INT_LIMIT:
                raise ConfigError(f"{where}: {value} is out of range; config integers lie "
                                  "between -2**31 and 2**31 - 1.")
            return value
        raise ConfigError(f"{where}: expected an integer, got {value!r}.")
    if tp is float:
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value) if abs(value) < 2**1024 else math.inf
        elif isinstance(value, str):
            try:
                number = float(value)  # YAML 1.1 reads "1e-3" as a string
            except ValueError:
                pass
        if number is None:
            raise ConfigError(f"{where}: expected a number, got {value!r}.")
        if not math.isfinite(number):
            raise ConfigError(f"{where}: expected a finite number, got {value!r}.")
        return number
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{where}: expected a string, got {value!r}.")
    if tp is dict:
        if isinstance(value, Mapping) and all(isinstance(k, str) for k in value):
            return dict(value)
        raise ConfigError(f"{where}: expected a mapping such as {{data: 2}}, got {value!r}.")
    raise ConfigError(f"{where}: unsupported field type {tp!r}.")  # pragma: no cover


def _unknown_key(key: str, valid: list[str], prefix: str) -> ConfigError:
    full = prefix + key
    hint = _schema.did_you_mean(key, valid, cutoff=0.5, prefix=prefix)
    return ConfigError(
        f"unknown config key {full!r}.{hint} Valid keys here: {', '.join(prefix + v for v in valid)}."
    )


def _from_dict(raw: Optional[dict], cls, prefix: str = "", *, base=None):
    """Build `cls` (a config dataclass) from a nested dict, checking every key and type.
    `base`: an instance of `cls` whose values are the defaults (a section whose default is
    an instance, such as a family's `solver`)."""
    raw = {} if raw is None else raw
    if not isinstance(raw, dict):
        raise ConfigError(
            f"{prefix.rstrip('.') or 'config'}: expected a mapping of keys to values, got "
            f"{raw!r}."
        )
    if base is not None:
        raw = {**to_dict(base), **raw}
    schema = _keys(cls)
    fields = {f.name for f in dataclasses.fields(cls)}
    kwargs, sections = {}, {}
    for key, value in raw.items():
        if key not in schema:
            raise _unknown_key(str(key), list(schema), prefix)
        k = schema[key]
        where = prefix + key
        if k.is_section:
            default = None if isinstance(k.default, type) else k.default
            (kwargs if key in fields else sections)[key] = _from_dict(
                value, k.type, where + ".", base=default)
            continue
        v = _coerce(value, k.type, where)
        choices = k.choices
        if choices is not None and v not in choices:
            raise ConfigError(f"{where}: {v!r} is not one of {list(choices)}."
                              f"{_schema.did_you_mean(v, choices)}")
        kwargs[key] = v
    if sections:
        kwargs["sections"] = sections
    try:
        return cls(**kwargs)
    except ConfigError as e:  # a section's own checks (`__post_init__`), named by its place
        raise ConfigError(prefix + str(e)) from None


def to_dict(cfg) -> dict:
    """The config as a plain nested dict (what `save_config` writes)."""
    out = {}
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if f.metadata.get("sections"):
            out.update((name, to_dict(section)) for name, section in value)
        elif dataclasses.is_dataclass(value):
            out[f.name] = to_dict(value)
        else:
            out[f.name] = dict(value) if isinstance(value, dict) else value
    return out


def _set_dotted(raw: dict, dotted: str, value, root):
    parts = dotted.split(".")
    cls = root
    node = raw
    for i, part in enumerate(parts):
        prefix = ".".join(parts[:i]) + ("." if i else "")
        schema = _keys(cls)
        if part not in schema:
            raise _unknown_key(part, list(schema), prefix)
        tp = schema[part].type
        if i == len(parts) - 1:
            if dataclasses.is_dataclass(tp):
                raise ConfigError(f"{dotted!r} is a section, not a value; set one of its "
                                  f"keys, e.g. {dotted}.{dataclasses.fields(tp)[0].name}=...")
            node[part] = value
            return
        if not dataclasses.is_dataclass(tp):
            raise ConfigError(f"{prefix + part!r} is a value, not a section; cannot set {dotted!r}.")
        parent = node
        node = parent.setdefault(part, {})
        if node is None:
            node = parent[part] = {}
        if not isinstance(node, dict):
            _from_dict(node, tp, prefix + part + ".")  # raises: names the key and the fix
        cls = tp


def _build_from(raw: dict, changes: Mapping[str, Any], root):
    """`_from_dict(raw, root)` after setting each dotted key of `changes` (the one place where
    changes are applied: `Config.replace` and `load_config`'s overrides both come here)."""
    for k, v in changes.items():
        _set_dotted(raw, k, v, root)
    return _from_dict(raw, root)


def parse_overrides(overrides: list[str]) -> dict[str, Any]:
    """Parse `["a.b=v", ...]` (the command line's `--set`) into `{"a.b": value, ...}`, values
    read as YAML scalars; a later key wins."""
    out: dict[str, Any] = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE, e.g. --set train.steps=200.")
        k, v = item.split("=", 1)
        k = k.strip()
        if not k:
            raise ConfigError(f"--set {item!r}: the key is empty.")
        out[k] = yaml.safe_load(v) if v.strip() else ""
    return out


def _describe(cls, prefix: str = "") -> str:
    """Every field of section `cls` (a class or an instance) with its default and its
    one-line meaning, one per line."""
    lines = []
    for k in _keys(cls).values():
        if k.is_section:
            lines.append(f"{prefix}{k.name}:  # {k.help}")
            lines.append(_describe(k.type if isinstance(k.default, type) else k.default,
                                  prefix + k.name + "."))
        else:
            lines.append(f"{prefix}{k.name} = {k.default!r}  # {k.help}")
    return "\n".join(lines)


def read_yaml(path) -> dict:
    """The mapping in a YAML config file, with a `ConfigError` naming the file for a missing,
    unreadable, non-UTF-8 or non-YAML one, or one whose top level is not a mapping."""
    p = pathlib.Path(path)
    if not p.exists():
        raise ConfigError(f"config file {str(p)!r} not found; `spinformer list` shows the "
                          "shipped configs.")
    try:
        text = p.read_bytes().decode("utf-8")
    except IsADirectoryError:
        raise ConfigError(f"config file {str(p)!r} is a directory; give a YAML file.") from None
    except OSError as e:
        raise ConfigError(f"config file {str(p)!r} cannot be read ({e.strerror or e})."
                          ) from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{p}: not a UTF-8 text file (byte 0x{e.object[e.start]:02x} at "
                          f"offset {e.start}); a config is a YAML text.") from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"{p}: not valid YAML: {e}") from e
    if raw is None:  # an empty file would silently train every default
        raise ConfigError(f"{p}: the file is empty; a config names at least its data, model "
                          "or train settings (start from a shipped one: `spinformer list`).")
    if not isinstance(raw, dict):
        raise ConfigError(f"{p}: the top level must be a mapping of sections.")
    if "experiment" in raw:
        raise ConfigError(f"{p}: an experiment config (experiment: {raw['experiment']}), "
                          f"not a training run; run it with `python experiments/"
                          f"{raw['experiment']}.py all --config {p}`.")
    return raw


# ----------------------------------------------------------------- the machinery, on Config


def keys(cls=None) -> dict[str, Key]:
    """The keys of a config section (default: the whole `Config`), in order: its fields and,
    for `ModelConfig`, the section of every registered attention that declares one (read
    from the registry now). The one walk of the schema: reading, `--set`, `describe` and the
    tests all use it. Given a section instance instead of its class, the defaults are that
    instance's values (a family's own solver defaults, for example)."""
    return _keys(Config if cls is None else cls)


def from_dict(raw: Optional[dict], cls=None, prefix: str = "", *, base=None):
    """Build `cls` (a config dataclass; default `Config`) from a nested dict, checking every
    key and type. `base`: an instance of `cls` whose values are the defaults."""
    return _from_dict(raw, Config if cls is None else cls, prefix, base=base)


def reference_markdown(cls=None) -> str:
    """Every key of the config schema as a Markdown table (key, default, allowed values,
    meaning), sections in order, every registered attention's section included: the
    documentation's config reference is generated from this, never written by hand."""
    rows = ["| key | default | allowed values | meaning |", "|---|---|---|---|"]

    def cell(text) -> str:
        return str(text).replace("|", "\\|").replace("\n", " ")

    def walk(section, prefix):
        for k in keys(section).values():
            if k.is_section:
                rows.append(f"| **`{prefix}{k.name}`** | | | {cell(k.help)} |")
                walk(k.type if isinstance(k.default, type) else k.default,
                     prefix + k.name + ".")
            else:
                choices = ", ".join(f"`{c}`" for c in k.choices) if k.choices else ""
                rows.append(f"| `{prefix}{k.name}` | `{k.default!r}` | {cell(choices)} | "
                            f"{cell(k.help)} |")

    walk(Config if cls is None else cls, "")
    return "\n".join(rows) + "\n"


def describe(cls=None, prefix: str = "") -> str:
    """Every field with its default and its one-line meaning, one per line (default: the
    whole `Config`)."""
    return _describe(Config if cls is None else cls, prefix)


def load_config(path: Union[str, pathlib.Path, None] = None, overrides: Optional[list] = None
                ) -> Config:
    """Read a YAML config (or the defaults if `path` is None) and apply `--set` overrides.

    **Arguments:**

    - `path`: a YAML file.
    - `overrides`: `["a.b=v", ...]` strings (`--set`), or a mapping `{"a.b": value}` of
      typed values as for `Config.replace`.

    **Returns:** a frozen `Config`. Raises `ConfigError` naming any bad key or value.
    """
    raw: dict = {}
    if path is not None:
        p = pathlib.Path(path)
        raw = read_yaml(p)
        if "experiment" in raw:
            raise ConfigError(f"{p}: an experiment config (experiment: {raw['experiment']}), "
                              f"not a training run; run it with `python experiments/"
                              f"{raw['experiment']}.py all --config {p}`.")
    if isinstance(overrides, Mapping):
        changes = dict(overrides)
    else:
        changes = parse_overrides(list(overrides or []))
    return _build(raw, changes)


def _build(raw: dict, changes: dict) -> Config:
    """`Config` from a YAML mapping and dotted changes. A change of `model.attention` leaves
    the previous attention's section behind (the section belongs to its attention: a spin
    config run with `--set model.attention=softmax` is a softmax run)."""
    model = raw.get("model")
    new = changes.get("model.attention")
    if new is not None and isinstance(model, dict):
        old = model.get("attention", _schema.default_attention())
        if old != new and old in model:
            raw = {**raw, "model": {k: v for k, v in model.items() if k != old}}
    return _build_from(raw, changes, Config)


def save_config(cfg: Config, path: Union[str, pathlib.Path]) -> None:
    """Write the resolved config as YAML (loadable again with `load_config`)."""
    pathlib.Path(path).write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))


