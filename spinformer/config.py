"""Experiment configuration: YAML files read into frozen dataclasses.

Every field has a default and a one-line meaning (`describe()` prints them). An unknown or
mistyped key is an error that names the key and the nearest valid one. Changes are a mapping
of dotted keys to values, checked like the file: `cfg.replace({...})` on a config, and the
command line's `--set a.b=v` (read as YAML scalars) on top of a file.

```python
cfg = load_config("configs/quickstart.yaml", overrides=["train.steps=200"])
cfg.train.steps  # 200
cfg.replace({"train.steps": 5, "model.attention.update": "mean_field"}).train.steps  # 5
```

Every choice with settings (the attention, the pooling head, a solver, an adjoint, an update
rule) is an object of a registered class, written as its name or a mapping of its name and
fields (`attention: {name: spin, beta: 2.0}`). A key only some tasks read
(`option(..., tasks=...)`) is left out of another task's `config.yaml`. The engine (reading,
checking, writing) is `spinformer._schema`.
"""

from __future__ import annotations

import dataclasses
import pathlib
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Union

import yaml

from . import _schema
from ._schema import ConfigError, Key, option, parse_overrides, read_yaml
from .nn import _image, _pair

__all__ = ["Config", "ConfigError", "DataConfig", "Key", "ModelConfig", "TrainConfig",
           "describe", "from_dict", "keys", "load_config", "option", "parse_overrides",
           "reference_markdown", "save_config", "to_dict"]


_f = option


def _need(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


def _at_least(section, minimum, *names: str) -> None:
    """Each named field of `section` (skipped when null) must be >= `minimum`."""
    for name in names:
        value = getattr(section, name)
        _need(value is None or value >= minimum, f"{name}={value} must be >= {minimum}.")


# the data.task values that read a key (`option(..., tasks=...)`)
_IMAGES = ("fashion_mnist", "digits")
_PAIRS = ("nli", "snli")
_SEQUENCES = ("brackets", "chars", "nli", "snli")


@dataclass(frozen=True)
class DataConfig:
    task: str = _f("brackets", "which dataset: brackets (Dyck-1 matching), chars "
                   "(character-level language modelling), nli (generated natural language "
                   "inference), snli (SNLI/MNLI JSON-lines files at data.path), fashion_mnist "
                   "(IDX files; the Debian package dataset-fashion-mnist or data.path) or "
                   "digits (scikit-learn's 8x8 digits)",
                   ("brackets", "chars", "nli", "snli", "fashion_mnist", "digits"))
    seq_len: int = _f(12, "sequence length T (tokens per example)", tasks=_SEQUENCES)
    batch_size: int = _f(32, "examples per training batch")
    path: str = _f("shakespeare", "chars: a text file, or a fetched dataset name "
                   "(`spinformer data fetch shakespeare`, or `english`); snli: the data "
                   "directory; fashion_mnist: a directory of MNIST-format IDX files (the default value "
                   "means the Debian package's /usr/share/datasets/fashion-mnist)",
                   tasks=("chars", "snli", "fashion_mnist"))
    max_chars: Optional[int] = _f(None, "chars only: use only the first max_chars characters "
                                  "of the text (null: all)", tasks=("chars",))
    val_fraction: float = _f(0.1, "chars only: the last fraction of the text held out for "
                             "validation (before the test split, if any)", tasks=("chars",))
    test_fraction: float = _f(0.0, "chars only: the last fraction of the text held out as the "
                              "test split, never trained on (0: none; the fetched english "
                              "corpus is laid out for 0.05 with val_fraction 0.05)",
                              tasks=("chars",))
    distractors: int = _f(0, "nli only: irrelevant modifiers inserted into each sentence "
                          "(difficulty; labels unchanged)", tasks=("nli",))
    held_out: bool = _f(True, "nli only: val/test use words and templates never seen in "
                        "training", tasks=("nli",))
    phenomena: str = _f("negation,quantifier,order,lexical", "nli only: comma-separated "
                        "phenomena the pairs test (negation, quantifier, order, lexical); "
                        "without order every pair fits in 13 tokens", tasks=("nli",))
    max_vocab: int = _f(20000, "snli only: the most frequent training words kept (others "
                        "become [UNK])", tasks=("snli",))
    max_examples: Optional[int] = _f(None, "snli only: use only the first max_examples "
                                     "training pairs (null: all)", tasks=("snli",))
    val_size: int = _f(5000, "fashion_mnist only: the last val_size training images are "
                       "held out for validation (the test split is the t10k file)",
                       tasks=("fashion_mnist",))
    max_train: Optional[int] = _f(None, "images only: use only the first max_train training "
                                  "images (null: all)", tasks=("fashion_mnist",))
    corrupt: Optional[str] = _f(None, "images only: reconstruct images corrupted this way "
                                "instead of classifying them: mask (a fraction "
                                "data.mask_fraction of the pixels set to 0) or noise (Gaussian "
                                "noise of variance data.noise_variance); the loss is the mean "
                                "squared error per pixel (null: classification)",
                                choices=(None, "mask", "noise"), tasks=_IMAGES)
    mask_fraction: float = _f(0.3, "corrupt=mask only: the fraction of pixels masked",
                              tasks=_IMAGES)
    noise_variance: float = _f(0.7, "corrupt=noise only: the variance of the added noise",
                               tasks=_IMAGES)
    eval_batches: int = _f(8, "validation batches per evaluation")
    seed: int = _f(0, "seed of the data stream (batch i depends only on seed, split and i)")
    stream: bool = _f(False, "chars only: read the text in order as batch_size contiguous "
                      "streams, batch i holding chunk i of every stream, and carry the "
                      "attention's state from one batch to the next (truncated "
                      "backpropagation through time; needs model.attention=spin with "
                      "model.attention.mode=steps and model.attention.init=carried)",
                      tasks=("chars",))

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
    return (f"the attention and its settings (a name, or {{name: ..., <setting>: ...}}): "
            f"{described}")


@dataclass(frozen=True)
class ModelConfig:
    """The model: the attention with its settings, the sizes, and the task's head.

    `attention` holds the settings object of a registered attention
    (`spinformer.nn.register_attention`: `SpinConfig`, `BoltzmannConfig`, ...); in Python,
    `ModelConfig(attention=SpinConfig(beta=3.0))`, in a file `attention: {name: spin,
    beta: 3.0}`. `spinformer.nn.get_attention(cfg.model.attention)` is its registration.
    """

    attention: Any = dataclasses.field(
        default_factory=lambda: _schema.get_attention(_schema.default_attention()).config(),
        metadata={"help": _attention_help, "kind": "attention",
                  "choices": _schema.attention_names})
    dim: int = _f(32, "model width D")
    depth: int = _f(1, "number of blocks")
    num_heads: int = _f(1, "attention heads per block (D must be divisible by it)")
    ffn_hidden: int = _f(64, "hidden width of each block's feed-forward network (0: none)")
    dropout: float = _f(0.0, "dropout rate on the residual branches")
    pool: Any = _f(_pair.MeanPool(), "pair classification only: how the encoded pair becomes "
                   "one vector: mean (of the tokens), cls (first token) or neurogame (the "
                   "NeuroGame paper's pooled game head, with NeuroGame attention's settings: "
                   "{name: neurogame, estimator: exact, ...})", kind="pool", tasks=_PAIRS)
    embed: _image.ImageEmbed = _f("conv", "images only: conv (two conv+pool stages to a grid "
                                  "of sites, as in the Deep Implicit Attention post; images >= "
                                  "16x16) or patch (linear embedding of patch x patch patches)",
                                  tasks=_IMAGES)
    patch: int = _f(4, "images, embed=patch only: patch side in pixels", tasks=_IMAGES)
    conv_channels: int = _f(32, "images, embed=conv only: channels of the convolutions",
                            tasks=_IMAGES)
    residual: bool = _f(True, "images only: wrap each attention in a pre-norm residual block "
                        "with FFN (false: the attentions alone, one after the other, as a DEQ "
                        "layer)", tasks=_IMAGES)
    positions: bool = _f(True, "images only: learned position embedding of the sites",
                         tasks=_IMAGES)

    def __post_init__(self):
        for field in ("attention", "pool"):  # a name: its default settings
            if isinstance(getattr(self, field), str):
                object.__setattr__(self, field, _schema.choice(field, getattr(self, field),
                                                               where=field))
        _schema.name_of("pool", self.pool)  # a registered pooling head
        _check_model(self)


def _check_model(self):
    if not (self.dim >= 1 and self.depth >= 1 and self.num_heads >= 1):
        raise ConfigError("dim, depth and num_heads must be >= 1.")
    if self.dim % self.num_heads:
        raise ConfigError(f"dim={self.dim} is not divisible by num_heads={self.num_heads}.")
    try:
        reg = _schema.get_attention(self.attention)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"attention: {e}") from None
    if reg.config is None or type(self.attention) is not reg.config:
        raise ConfigError(f"attention: expected the settings object of a registered attention "
                          f"(e.g. {reg.name}: {getattr(reg.config, '__name__', '?')}(...)), got "
                          f"{self.attention!r}.")
    least = reg.min_head_dim
    if self.dim // self.num_heads < least:
        raise ConfigError(f"{reg.name} attention needs a head width dim/num_heads >= "
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
        for name in ("data", "model"):  # a key another task reads keeps its default
            section, task = getattr(self, name), self.data.task
            for f in dataclasses.fields(section):
                tasks = f.metadata.get("tasks", (task,))
                if task not in tasks and getattr(section, f.name) != _schema.default_of(f):
                    raise ConfigError(
                        f"{name}.{f.name}={_schema.word(getattr(section, f.name), f)!r} is read "
                        f"only by data.task {' or '.join(tasks)}; this config's "
                        f"data.task is {task}: remove the key, or change data.task.")
        if self.data.stream:  # a state carried from batch to batch
            reg, settings = _schema.get_attention(self.model.attention), self.model.attention
            when = lambda r: " and ".join(  # noqa: E731
                f"model.attention.{k}={v}" for k, v in r.carries_state.items())
            if not reg.carries_state or any(getattr(settings, k) != v
                                            for k, v in reg.carries_state.items()):
                able = [f"model.attention={r.name} with {when(r)}"
                        for r in _schema.registrations() if r.carries_state]
                raise ConfigError(
                    "data.stream=true carries the attention's state from one batch to the "
                    f"next: it needs {' or '.join(able) or 'an attention that carries state'}"
                    f"; got model.attention={reg.name}"
                    + "".join(f", model.attention.{k}={getattr(settings, k)}"
                              for k in reg.carries_state or {}) + ".")
        _need(not self.train.local_losses or self.data.task in ("brackets", "chars"),
              "train.local_losses=true trains each layer on its own per-position readout: it "
              f"needs a per-position task (data.task brackets or chars); got data.task="
              f"{self.data.task}.")

    def replace(self, changes: Mapping[str, Any]) -> "Config":
        """A copy with changes, checked like a config file.

        **Arguments:**

        - `changes`: a mapping of dotted keys to Python values, e.g.
          `cfg.replace({"train.steps": 5, "model.attention.mode": "h"})`.

        **Returns:** a new frozen `Config`. Raises `ConfigError` naming any bad key or value.
        """
        return _build(to_dict(self), dict(changes))


# ------------------------------------------------------------- reading and writing a Config


def to_dict(cfg) -> dict:
    """The config (or one of its sections) as a plain nested dict: what `save_config`
    writes, the keys its task reads."""
    return _schema.to_dict(cfg, cfg.data.task if isinstance(cfg, Config) else None)


def keys(cls=None, kind: Optional[str] = None) -> dict[str, _schema.Key]:
    """The keys of a config section (default: the whole `Config`), or with `kind` of object
    `cls` of that kind (`_schema.keys`)."""
    return _schema.keys(Config if cls is None else cls, kind)


def from_dict(raw: Optional[dict], cls=None, prefix: str = ""):
    """Build `cls` (a config dataclass; default `Config`) from a nested dict, checking every
    key and type."""
    return _schema.read(raw, Config if cls is None else cls, prefix)


def reference_markdown(cls=None) -> str:
    """Every key of the config schema as a Markdown table (key, default, allowed values,
    meaning), sections in order, every registered attention's section and the keys of its
    default objects included: the documentation's config reference is generated from this,
    never written by hand."""
    rows = ["| key | default | allowed values | meaning |", "|---|---|---|---|"]

    def cell(text) -> str:
        return str(text).replace("|", "\\|").replace("\n", " ")

    kinds = []
    for dotted, k in _schema.walk(Config if cls is None else cls):
        kinds += [k.kind] if k.kind and k.kind not in kinds else []
        if k.is_section:
            rows.append(f"| **`{dotted}`** | | | {cell(k.help)} |")
        else:
            choices = ", ".join(f"`{c}`" for c in k.choices) if k.choices else ""
            default = _schema.plain(k.default, k.kind)
            rows.append(f"| `{dotted}` | `{default!r}` | {cell(choices)} | "
                        f"{cell(k.help)} |")
    for kind in kinds:  # what another name than the default brings: its class's keys
        objs = {name: _schema.choice_class(kind, name)() for name in _schema.choice_names(kind)}
        keys_ = {name: ", ".join(f"`{n}: {_schema.plain(getattr(obj, n), k.kind)!r}`"
                                 for n, k in _schema.keys(obj, kind).items() if n != "name")
                 for name, obj in objs.items()}
        if any(keys_.values()):
            rows += ["", f"`{kind}`: the names such a key takes, each with the keys of its "
                         "class (class defaults):", "", "| name | keys |", "|---|---|"]
            rows += [f"| `{name}` | {cell(text)} |" for name, text in keys_.items()]
    return "\n".join(rows) + "\n"


def describe(cls=None, prefix: str = "") -> str:
    """Every key with its default and its one-line meaning, one per line (default: the
    whole `Config`); given a config instance (`spinformer show CONFIG`), the keys its
    `config.yaml` holds, with its values."""
    cls = Config if cls is None else cls
    task = cls.data.task if isinstance(cls, Config) else None
    return "\n".join(f"{dotted}:  # {k.help}" if k.is_section else
                     f"{dotted} = {_schema.plain(k.default, k.kind)!r}  # {k.help}"
                     for dotted, k in _schema.walk(cls, prefix, task=task))


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
    applied: `Config.replace` and `load_config`'s overrides both come here). The settings of
    an attention or a pooling head belong to it: a change of its name starts from the new
    one's defaults (a spin config run with `--set model.attention=boltzmann` is a default
    Boltzmann run), and naming the one it has keeps its settings. Likewise a change of
    `data.task` leaves behind the keys that only the old task reads."""
    changes = dict(changes)
    task = changes.get("data.task")
    if isinstance(task, str) and isinstance(raw.get("data"), dict) and task != raw["data"].get(
            "task", _schema.default_of(DataConfig.__dataclass_fields__["task"])):
        for section, cls in (("data", DataConfig), ("model", ModelConfig)):
            fields = cls.__dataclass_fields__
            if isinstance(raw.get(section), dict):
                raw = {**raw, section: {k: v for k, v in raw[section].items()
                                        if k not in fields or _schema.used(fields[k], task)}}
    for section, field in (("model", "attention"), ("model", "pool")):
        node = raw.get(section, {}).get(field) if isinstance(raw.get(section), dict) else None
        for key in (f"{section}.{field}", f"{section}.{field}.name"):
            new = changes.get(key)
            old = node.get("name") if isinstance(node, Mapping) else node
            if node is None or not isinstance(new, str):
                continue
            if new == old:
                del changes[key]
            else:
                raw = {**raw, section: {k: v for k, v in raw[section].items() if k != field}}
    for k, v in changes.items():
        raw = _schema.set_dotted(raw, k, v)
    return _schema.read(raw, Config)


def save_config(cfg: Config, path: Union[str, pathlib.Path]) -> None:
    """Write the resolved config as YAML (loadable again with `load_config`)."""
    pathlib.Path(path).write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
