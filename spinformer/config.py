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
when it is made. A solver, an adjoint or an algorithm (`option(..., kind=...)`) is an object
in its section; a file writes its registered name, or a mapping of its name and the fields
of its class (`solver: {name: picard, damping: 0.3}`), and reading builds the object.
`keys(section)` lists a section's keys with their defaults, meanings and choices
(`keys(obj, kind)` an object's); this module is also the one walk of the schema that reading,
`--set`, `describe` and the tests use.
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
import re
import types
import typing
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Union

import yaml

from . import _schema
from ._schema import ConfigError, option
from .nn import _image, _pair

__all__ = [
    "Config",
    "ConfigError",
    "DataConfig",
    "Key",
    "ModelConfig",
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
                   "(`spinformer data fetch shakespeare`, or `english`); snli: the data directory; "
                   "fashion_mnist: a directory of MNIST-format IDX files (the default value "
                   "means the Debian package's /usr/share/datasets/fashion-mnist)")
    max_chars: Optional[int] = _f(None, "chars only: use only the first max_chars characters "
                                  "of the text (null: all)")
    val_fraction: float = _f(0.1, "chars only: the last fraction of the text held out for "
                             "validation (before the test split, if any)")
    test_fraction: float = _f(0.0, "chars only: the last fraction of the text held out as the "
                              "test split, never trained on (0: none; the fetched english "
                              "corpus is laid out for 0.05 with val_fraction 0.05)")
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
        # four special tokens and at least one word (`data._pairs.build_vocab`)
        _need(self.max_vocab >= 5, f"max_vocab={self.max_vocab} must be >= 5.")
        _need(0.0 < self.val_fraction < 1.0,
              f"val_fraction={self.val_fraction} must be in (0, 1).")
        _need(0.0 <= self.test_fraction < 1.0 - self.val_fraction,
              f"test_fraction={self.test_fraction} must be >= 0 and leave training text: "
              f"below 1 - val_fraction = {1.0 - self.val_fraction:g}.")
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
            default = _flat(to_dict(regs[name].config()))
            changed = ", ".join(f"model.{name}.{k}={v!r}" for k, v in
                                _flat(to_dict(given[name])).items() if default.get(k) != v)
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


def _flat(d: dict, prefix: str = "") -> dict:
    """A nested dict as `{dotted key: value}`."""
    out = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {prefix + k: v})
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
    count_flops: bool = _f(False, "count every step's training FLOPs into the metrics and the "
                           "summary as `flops` (XLA's count, each solver loop times the "
                           "iterations it took; a few traces of the step at the start)")
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
        if self.data.stream:  # a state carried from batch to batch
            when = lambda r: " and ".join(  # noqa: E731
                f"model.{r.name}.{k}={v}" for k, v in r.carries_state.items())
            reg, section = _schema.get_attention(self.model.attention), self.model.section()
            if not reg.carries_state or any(getattr(section, k) != v
                                            for k, v in reg.carries_state.items()):
                able = [f"model.attention={r.name} with {when(r)}"
                        for r in _schema.registrations() if r.carries_state]
                raise ConfigError(
                    "data.stream=true carries the attention's state from one batch to the "
                    f"next: it needs {' or '.join(able) or 'an attention that carries state'}"
                    f"; got model.attention={self.model.attention}"
                    + "".join(f", model.{reg.name}.{k}={getattr(section, k)}"
                              for k in reg.carries_state or {}) + ".")
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


@dataclass(frozen=True)
class Key:
    """One key of a config section or of an object in it, as `keys` lists it.

    **Fields:** `name`; `type` (a Python type, `Optional[...]`, a section's dataclass, or an
    object's annotation); `default` (a section's dataclass for a section, the object for an
    object); `help` (one line); `choices` (the allowed values, or None); `kind` (for a key
    that holds an object: its kind in the name table, e.g. `"solver"`).
    """

    name: str
    type: Any
    default: Any
    help: str
    choices: Optional[tuple] = None
    kind: Optional[str] = None

    @property
    def is_section(self) -> bool:
        """Whether keys lie below this one: a section, or an object whose class has fields
        (an object without fields is a value: its name)."""
        if self.kind is None:
            return dataclasses.is_dataclass(self.type)
        return self.default is not None and len(_keys(self.default, self.kind)) > 1

    def schema(self):
        """What the keys below this one are read from: the section class, or the object."""
        return self.type if self.kind is None else self.default


def _doc_help(cls: type, name: str) -> str:
    """The first sentence of the bullet "- `name`: ..." in the docstrings of `cls` and its
    bases (the one place an object's fields are described), or ""."""
    for klass in cls.__mro__:
        for bullet in re.split(r"\n\s*- ", klass.__doc__ or "")[1:]:
            head, _, text = bullet.partition(":")
            if f"`{name}`" in head and head.startswith("`"):
                text = " ".join(text.split())
                return text.split(". ")[0].rstrip(".")
    return ""


def _scalar(tp) -> bool:
    tp = _unwrap_optional(tp)[0]
    return tp in (bool, int, float, str) or typing.get_origin(tp) is typing.Literal


def _key(name, tp, default, help_, choices=None, kind=None) -> Key:
    if choices is None and typing.get_origin(_unwrap_optional(tp)[0]) is typing.Literal:
        choices = typing.get_args(_unwrap_optional(tp)[0])
    return Key(name, tp, default, help_, tuple(choices()) if callable(choices) else choices,
               kind)


def _object_kind(f, value) -> Optional[str]:
    """The kind of the object field `f` of a registered class holding `value`: its field
    name when that is a kind (`linear_solver`), else the one kind of its value's class or of
    its default's (`fallback: auto`); None for a field that is not an object."""
    if _schema.choice_names(f.name):
        return f.name
    for v in (value, f.default):
        found = _schema.kinds_of(type(v)) if v is not None else ()
        if len(found) == 1:
            return found[0]
    return None


def _keys(cls, kind: Optional[str] = None) -> dict[str, Key]:
    """The keys of a config section class, or (`kind` given) of object `cls` of that kind,
    in order. For a section: its fields and, for `ModelConfig`, the section of every
    registered attention that declares one (read from the registry now); a field declared
    with `kind=` holds an object. For an object: `name` (its config word), then the fields
    of its class that a config can write: numbers, strings, flags and nested objects, with
    this object's values as defaults and the help from its class's docstring."""
    if kind is not None:
        obj, hints = cls, typing.get_type_hints(type(cls))
        out = {"name": Key("name", str, _schema.name_of(kind, obj),
                           f"which {kind} (a registered name)", _schema.choice_names(kind))}
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            sub = None if _scalar(hints[f.name]) else _object_kind(f, value)
            if f.init and (sub or _scalar(hints[f.name])):
                out[f.name] = _key(f.name, hints[f.name], value, _doc_help(type(obj), f.name),
                                   kind=sub)
        return out
    hints = typing.get_type_hints(cls)
    out = {}
    for f in dataclasses.fields(cls):
        if f.metadata.get("sections"):
            continue
        default = (f.default if f.default is not dataclasses.MISSING
                   else hints[f.name] if dataclasses.is_dataclass(hints[f.name])
                   else f.default_factory())
        help_ = f.metadata.get("help", "")
        out[f.name] = _key(f.name, hints[f.name], default, help_() if callable(help_) else help_,
                           f.metadata.get("choices"), f.metadata.get("kind"))
    for name, tp, help_ in getattr(cls, "_open_sections", lambda: ())():
        out[name] = Key(name, tp, tp, help_)
    return out


def _unwrap_optional(tp):
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(tp)) == 2:
            return args[0], True
        return tp, type(None) in typing.get_args(tp)
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


def _value(value, k: Key, where: str):
    """A YAML value of key `k`, checked: a number, string or flag, or an object."""
    if k.kind is not None:
        return _object(value, k, where)
    if isinstance(value, Mapping) and _unwrap_optional(k.type)[0] is not dict:
        raise ConfigError(f"{where} is a value, not a section; got {value!r}.")
    v = _coerce(value, k.type, where)
    if k.choices is not None and v not in k.choices:
        raise ConfigError(f"{where}: {v!r} is not one of {list(k.choices)}."
                          f"{_schema.did_you_mean(v, k.choices)}")
    return v


def _unknown_key(key: str, valid: list[str], prefix: str) -> ConfigError:
    if prefix == "model." and key in _schema.attention_names():  # a family without settings
        return ConfigError(f"model.{key}: {key} attention has no settings, so there is no "
                           f"section model.{key}; `model.attention: {key}` alone chooses it "
                           "(the model's sizes are model.dim, model.depth, model.num_heads, "
                           "...).")
    hint = _schema.did_you_mean(key, valid, cutoff=0.5, prefix=prefix)
    return ConfigError(f"unknown config key {prefix + key!r}.{hint} Valid keys here: "
                       f"{', '.join(prefix + v for v in valid)}.")


# the mark `_set_dotted` leaves on a mapping whose `name` it changed (`--set x.name=...`)
_RENAMED = "<renamed>"


def _object(value, k: Key, where: str):
    """The object of kind `k.kind` that a YAML value describes: a name, or a mapping of its
    name (default: the name of `k.default`) and fields. The same class as the default starts
    from the default's values; another class from its own defaults and the settings of the
    default that it shares (a family's `tol` survives a change of solver). When an override
    changes the name of a mapping, the settings the mapping held keep those the new class
    shares and drop the others."""
    default = k.default
    if value is None:
        if _unwrap_optional(k.type)[1]:
            return None
        raise ConfigError(f"{where}: null is not allowed; give a {k.kind} name.")
    named = where if isinstance(value, str) else where + ".name"
    if isinstance(value, str):
        value = {"name": value}
    if not isinstance(value, Mapping):
        raise ConfigError(f"{where}: expected a {k.kind} name or a mapping such as "
                          f"{{name: {_schema.choice_names(k.kind)[0]}}}, got {value!r}.")
    value = dict(value)
    droppable = set(value.pop(_RENAMED, ()))
    name = value.pop("name", None if default is None else _schema.name_of(k.kind, default))
    if name is None:
        raise ConfigError(f"{named}: missing; one of {list(_schema.choice_names(k.kind))}.")
    names = _schema.choice_names(k.kind)
    if name not in names:  # as a value outside its choices
        raise ConfigError(f"{named}: {name!r} is not one of {list(names)}."
                          f"{_schema.did_you_mean(name, names)}")
    base = cls = _schema.choice_class(k.kind, name)()
    if type(default) is type(cls):
        base = default
    elif default is not None:
        plain = type(default)()
        base = _make(cls, {n: getattr(default, n) for n in _keys(default, k.kind)
                           if n != "name" and n in _keys(cls, k.kind)
                           and getattr(default, n) != getattr(plain, n)}, where)
    schema = _keys(base, k.kind)
    changes = {}
    for n, v in value.items():
        if n in schema:
            changes[n] = _value(v, schema[n], f"{where}.{n}")
        elif n not in droppable:
            raise _unknown_key(str(n), list(schema), where + ".")
    return _make(base, changes, where)


def _make(obj, changes: dict, where: str):
    """`obj` with fields changed; the class's own check of a value becomes a `ConfigError`
    naming the key."""
    try:
        return dataclasses.replace(obj, **changes) if changes else obj
    except (ValueError, TypeError) as e:  # "Cls(key=...) must be ...": the key leads
        key = re.match(r"\w+(?:\(|: )(\w+)=", str(e))
        key = key.group(1) if key and key.group(1) in changes else None
        lead = f"{where}.{key}={changes[key]!r}" if key else where
        raise ConfigError(f"{lead}: {e}") from None


def _from_dict(raw: Optional[dict], cls, prefix: str = ""):
    """Build `cls` (a config dataclass) from a nested dict, checking every key and type."""
    raw = {} if raw is None else raw
    if not isinstance(raw, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'} is a section: expected a mapping "
                          f"of its keys to values, got {raw!r}.")
    schema = _keys(cls)
    fields = {f.name for f in dataclasses.fields(cls)}
    kwargs, sections = {}, {}
    for key, value in raw.items():
        if key not in schema:
            raise _unknown_key(str(key), list(schema), prefix)
        k = schema[key]
        if k.kind is None and k.is_section:  # a section (an object: `_value`)
            (kwargs if key in fields else sections)[key] = _from_dict(value, k.type,
                                                                      prefix + key + ".")
        else:
            kwargs[key] = _value(value, k, prefix + key)
    if sections:
        kwargs["sections"] = sections
    try:
        return cls(**kwargs)
    except ConfigError as e:  # a section's own checks (`__post_init__`), named by its place
        raise ConfigError(prefix + str(e)) from None
    except ValueError as e:  # a check of the objects it holds (`solvers.check_solver`)
        raise ConfigError(f"{prefix.rstrip('.')}: {e}") from None


def _plain(value, kind: Optional[str] = None):
    """A value as YAML holds it: an object as its name, or a mapping of its name and
    fields when its class has fields; a section as a mapping."""
    if kind is not None and value is not None:
        keys_ = _keys(value, kind)
        fields = {n: _plain(getattr(value, n), k.kind) for n, k in keys_.items() if n != "name"}
        return {"name": keys_["name"].default, **fields} if fields else keys_["name"].default
    return dict(value) if isinstance(value, dict) else value


def to_dict(cfg) -> dict:
    """The config as a plain nested dict (what `save_config` writes)."""
    out = {}
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if f.metadata.get("sections"):
            out.update((name, to_dict(section)) for name, section in value)
        elif dataclasses.is_dataclass(value) and "kind" not in f.metadata:
            out[f.name] = to_dict(value)
        else:
            out[f.name] = _plain(value, f.metadata.get("kind"))
    return out


def _set_dotted(raw: dict, dotted: str, value) -> dict:
    """`raw` (not changed) with the dotted key set; the keys are checked when it is read."""
    head, _, rest = dotted.partition(".")
    if not rest:
        return {**raw, head: value}
    node = raw.get(head)
    node = {"name": node} if isinstance(node, str) else {} if node is None else node
    if not isinstance(node, dict):
        raise ConfigError(f"{head!r} is a value, not a section; cannot set {dotted!r}.")
    if rest == "name" and isinstance(node.get("name"), str) and node["name"] != value:
        # the settings given for the old object may not fit the new one
        node = {**node, _RENAMED: tuple(n for n in node if n not in ("name", _RENAMED))}
    return {**raw, head: _set_dotted(node, rest, value)}


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


def _walk(schema, prefix: str = "", kind: Optional[str] = None):
    """`(dotted key, Key)` of every key below `schema` (a section class, or an object of
    `kind`), depth first: the one walk behind `describe` and `reference_markdown`."""
    for k in _keys(schema, kind).values():
        yield prefix + k.name, k
        if k.is_section:
            yield from _walk(k.schema(), prefix + k.name + ".", k.kind)


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


def keys(cls=None, kind: Optional[str] = None) -> dict[str, Key]:
    """The keys of a config section class (default: the whole `Config`), in order: its
    fields and, for `ModelConfig`, the section of every registered attention that declares
    one (read from the registry now). With `kind`: the keys of object `cls` of that kind
    (its `name`, then the fields of its class that a config can write); a key holding an
    object gives it as `Key.schema()` and its kind as `Key.kind`."""
    return _keys(Config if cls is None else cls, kind)


def from_dict(raw: Optional[dict], cls=None, prefix: str = ""):
    """Build `cls` (a config dataclass; default `Config`) from a nested dict, checking every
    key and type."""
    return _from_dict(raw, Config if cls is None else cls, prefix)


def reference_markdown(cls=None) -> str:
    """Every key of the config schema as a Markdown table (key, default, allowed values,
    meaning), sections in order, every registered attention's section and the keys of its
    default objects included: the documentation's config reference is generated from this,
    never written by hand."""
    rows = ["| key | default | allowed values | meaning |", "|---|---|---|---|"]

    def cell(text) -> str:
        return str(text).replace("|", "\\|").replace("\n", " ")

    kinds = []
    for dotted, k in _walk(Config if cls is None else cls):
        kinds += [k.kind] if k.kind and k.kind not in kinds else []
        if k.is_section:
            rows.append(f"| **`{dotted}`** | | | {cell(k.help)} |")
        else:
            choices = ", ".join(f"`{c}`" for c in k.choices) if k.choices else ""
            rows.append(f"| `{dotted}` | `{_plain(k.default, k.kind)!r}` | {cell(choices)} | "
                        f"{cell(k.help)} |")
    for kind in kinds:  # what another name than the default brings: its class's keys
        objs = {name: _schema.choice_class(kind, name)() for name in _schema.choice_names(kind)}
        keys_ = {name: ", ".join(f"`{n}: {_plain(getattr(obj, n), k.kind)!r}`"
                                 for n, k in _keys(obj, kind).items() if n != "name")
                 for name, obj in objs.items()}
        if any(keys_.values()):
            rows += ["", f"`{kind}`: the names such a key takes, each with the keys of its "
                         "class (class defaults):", "", "| name | keys |", "|---|---|"]
            rows += [f"| `{name}` | {cell(text)} |" for name, text in keys_.items()]
    return "\n".join(rows) + "\n"


def _walk_values(obj, prefix: str = "", kind: Optional[str] = None):
    """`(dotted key, Key)` of every key a config instance (a section, or an object of
    `kind`) holds, with the instance's values as the keys' defaults: what its `config.yaml`
    writes, in that order."""
    for k in _keys(obj if kind is not None else type(obj), kind).values():
        if kind is None:
            if isinstance(obj, ModelConfig) and k.name not in obj.__dataclass_fields__:
                value = obj.section(k.name)  # an attention's section: only those it uses
                if value is None:
                    continue
            else:
                value = getattr(obj, k.name)
            k = dataclasses.replace(k, default=value)
        yield prefix + k.name, k
        if k.kind is not None and k.is_section:
            yield from _walk_values(k.default, prefix + k.name + ".", k.kind)
        elif k.kind is None and dataclasses.is_dataclass(k.default):
            yield from _walk_values(k.default, prefix + k.name + ".")


def describe(cls=None, prefix: str = "") -> str:
    """Every key with its default and its one-line meaning, one per line (default: the
    whole `Config`). Given a config instance (`load_config(...)`) instead of a class: the
    keys it holds, with its values (`spinformer show CONFIG`)."""
    if cls is None or isinstance(cls, type):
        walk = _walk(Config if cls is None else cls, prefix)
    else:
        walk = _walk_values(cls, prefix)
    return "\n".join(f"{dotted}:  # {k.help}" if k.is_section else
                     f"{dotted} = {_plain(k.default, k.kind)!r}  # {k.help}"
                     for dotted, k in walk)


def load_config(path: Union[str, pathlib.Path, None] = None, overrides: Optional[list] = None
                ) -> Config:
    """Read a YAML config (or the defaults if `path` is None) and apply `--set` overrides.

    **Arguments:**

    - `path`: a YAML file.
    - `overrides`: `["a.b=v", ...]` strings (`--set`), or a mapping `{"a.b": value}` of
      typed values as for `Config.replace`.

    **Returns:** a frozen `Config`. Raises `ConfigError` naming any bad key or value.
    """
    raw = {} if path is None else read_yaml(path)
    changes = (dict(overrides) if isinstance(overrides, Mapping)
               else parse_overrides(list(overrides or [])))
    return _build(raw, changes)


def _build(raw: dict, changes: dict) -> Config:
    """`Config` from a YAML mapping and dotted changes (the one place where changes are
    applied: `Config.replace` and `load_config`'s overrides both come here). A change of
    `model.attention` leaves the previous attention's section behind (the section belongs to
    its attention: a spin config run with `--set model.attention=softmax` is a softmax
    run)."""
    model = raw.get("model")
    new = changes.get("model.attention")
    if new is not None and isinstance(model, dict):
        old = model.get("attention", _schema.default_attention())
        if old != new and old in model:
            raw = {**raw, "model": {k: v for k, v in model.items() if k != old}}
    for k, v in changes.items():
        raw = _set_dotted(raw, k, v)
    return _from_dict(raw, Config)


def save_config(cfg: Config, path: Union[str, pathlib.Path]) -> None:
    """Write the resolved config as YAML (loadable again with `load_config`)."""
    pathlib.Path(path).write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
