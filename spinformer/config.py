"""Experiment configuration: YAML files read into frozen dataclasses.

Every field has a default and a one-line meaning (`describe()` prints them). An unknown or
mistyped key is an error that names the key and the nearest valid one; `--set a.b=v`
overrides are applied on top of the file with the same checks.

```python
cfg = load_config("configs/quickstart.yaml", overrides=["train.steps=200"])
cfg.train.steps  # 200
```
"""

from __future__ import annotations

import dataclasses
import difflib
import pathlib
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import yaml

__all__ = [
    "Config",
    "ConfigError",
    "DataConfig",
    "BoltzmannConfig",
    "ModelConfig",
    "SpinConfig",
    "TrainConfig",
    "describe",
    "from_dict",
    "load_config",
    "parse_overrides",
    "save_config",
    "to_dict",
]


class ConfigError(ValueError):
    """A configuration that cannot be used; the message names the key and the fix."""


def _f(default, help: str, choices: Optional[tuple] = None):
    meta = {"help": help}
    if choices is not None:
        meta["choices"] = choices
    if isinstance(default, type) and dataclasses.is_dataclass(default):
        return field(default_factory=default, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class DataConfig:
    task: str = _f("brackets", "which dataset: brackets (Dyck-1 matching) or chars "
                   "(character-level language modelling)", ("brackets", "chars"))
    seq_len: int = _f(12, "sequence length T (tokens per example)")
    batch_size: int = _f(32, "examples per training batch")
    path: str = _f("shakespeare", "chars only: a text file, or a fetched dataset name "
                   "(`spinformer data fetch shakespeare`)")
    max_chars: Optional[int] = _f(None, "chars only: use only the first max_chars characters "
                                  "of the text (null: all)")
    val_fraction: float = _f(0.1, "chars only: the last fraction of the text held out for "
                             "validation")
    eval_batches: int = _f(8, "validation batches per evaluation")
    seed: int = _f(0, "seed of the data stream (batch i depends only on seed, split and i)")


@dataclass(frozen=True)
class SpinConfig:
    beta: float = _f(1.0, "inverse temperature β of the vector-spin model")
    update: str = _f("tap", "mean-field equations: naive (first order) or tap (second order, "
                     "with Onsager/feed-forward corrections)", ("naive", "tap"))
    mode: str = _f("fixed_point", "fixed_point: solve for the steady state; steps: take "
                   "num_steps time steps", ("fixed_point", "steps"))
    num_steps: int = _f(2, "steps mode: number of time steps K")
    init: str = _f("reset", "steps mode: initial magnetizations: reset (fresh each call), "
                   "learned (a trained per-head vector) or carried (passed in by the caller)",
                   ("reset", "learned", "carried"))
    solver: str = _f("anderson", "fixed-point solver", ("anderson", "picard", "broyden",
                                                        "jaxopt_anderson"))
    adjoint: str = _f("implicit", "how gradients flow through the fixed point",
                      ("implicit", "unrolled", "phantom", "onestep"))
    adjoint_solver: str = _f("gmres", "implicit adjoint only: linear solver of the backward "
                             "system", ("gmres", "bicgstab", "anderson", "picard"))
    adjoint_tol: float = _f(1e-3, "implicit adjoint only: relative tolerance of the backward "
                            "linear solve")
    adjoint_restart: int = _f(5, "implicit adjoint only: Krylov size (gmres) or history "
                              "(anderson) of the backward solve")
    tol: float = _f(1e-3, "fixed-point tolerance on the max-norm residual")
    max_steps: int = _f(30, "most solver iterations per fixed point")
    output_proj: bool = _f(True, "mix the heads' magnetizations with a learned linear map")
    field_ffn: int = _f(0, "hidden width of an FFN added to the external fields "
                        "(x -> x + FFN(x)); 0 for none")


@dataclass(frozen=True)
class BoltzmannConfig:
    mode: str = _f("hJ", "energy terms: hJ (fields + learnable couplings J), h (J=0: sigmoid "
                   "attention), J (h=0), softmax (plain softmax, for ablations), or the "
                   "three-body variants hK, hJK, JK, K",
                   ("softmax", "hJ", "h", "J", "hK", "hJK", "JK", "K"))
    inference: str = _f("exact", "how magnetizations are computed: exact (enumeration, T<=24), "
                        "mean_field, tap, gibbs, parallel_tempering, dqa (T<=12)",
                        ("exact", "mean_field", "tap", "gibbs", "parallel_tempering", "dqa"))
    init_scale: float = _f(0.0, "standard deviation of the initial couplings J (and K); "
                           "0 starts at sigmoid attention")
    num_samples: int = _f(256, "samplers: samples per query and head")
    burn_in: int = _f(32, "gibbs/parallel_tempering: sweeps discarded before sampling")
    dqa_steps: int = _f(200, "dqa: Trotter steps of the simulated anneal")
    dqa_time: float = _f(5.0, "dqa: total anneal time")
    tol: float = _f(1e-4, "mean_field/tap: fixed-point tolerance")
    max_steps: int = _f(100, "mean_field/tap: most solver iterations")


@dataclass(frozen=True)
class ModelConfig:
    attention: str = _f("spin", "attention mechanism: softmax, spin (vector-spin mean field) or "
                        "boltzmann (Ising model over key positions)",
                        ("softmax", "spin", "boltzmann"))
    dim: int = _f(32, "model width D")
    depth: int = _f(1, "number of blocks")
    num_heads: int = _f(1, "attention heads per block (D must be divisible by it)")
    ffn_hidden: int = _f(64, "hidden width of each block's feed-forward network (0: none)")
    dropout: float = _f(0.0, "dropout rate on the residual branches")
    spin: SpinConfig = _f(SpinConfig, "options of spin attention (used only by attention=spin)")
    boltzmann: BoltzmannConfig = _f(BoltzmannConfig, "options of Boltzmann attention (used "
                                    "only by attention=boltzmann)")

    def attention_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for the attention constructor."""
        if self.attention == "boltzmann":
            b = self.boltzmann
            return dict(mode=b.mode, inference=b.inference, init_scale=b.init_scale,
                        num_samples=b.num_samples, burn_in=b.burn_in, dqa_steps=b.dqa_steps,
                        dqa_time=b.dqa_time, tol=b.tol, max_steps=b.max_steps)
        if self.attention != "spin":
            return {}
        from . import solvers

        s = self.spin
        solver = {
            "anderson": solvers.Anderson(),
            "picard": solvers.Picard(),
            "broyden": solvers.Broyden(),
            "jaxopt_anderson": solvers.JaxoptAnderson(),
        }[s.solver]
        adjoint = {
            "implicit": solvers.Implicit(
                linear_solver=s.adjoint_solver, tol=s.adjoint_tol, restart=s.adjoint_restart
            ),
            "unrolled": solvers.Unrolled(),
            "phantom": solvers.Phantom(),
            "onestep": solvers.OneStep(),
        }[s.adjoint]
        return dict(
            beta=s.beta, update=s.update, mode=s.mode, num_steps=s.num_steps, init=s.init,
            solver=solver, adjoint=adjoint, tol=s.tol, max_steps=s.max_steps,
            output_proj=s.output_proj, field_ffn=s.field_ffn,
        )


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


@dataclass(frozen=True)
class Config:
    description: str = _f("", "one line saying what this experiment is")
    data: DataConfig = _f(DataConfig, "the dataset")
    model: ModelConfig = _f(ModelConfig, "the model")
    train: TrainConfig = _f(TrainConfig, "the optimisation loop")

    def replace(self, **overrides: str) -> "Config":
        """A copy with dotted overrides applied, e.g. `cfg.replace(**{"train.steps": "5"})`."""
        raw = to_dict(self)
        for k, v in overrides.items():
            _set_dotted(raw, k, v if not isinstance(v, str) else yaml.safe_load(v))
        return from_dict(raw)


# --------------------------------------------------------------------------- conversion


def _hints(cls) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _unwrap_optional(tp):
    origin = typing.get_origin(tp)
    if origin in (Union, getattr(types, "UnionType", Union)):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(tp)) == 2:
            return args[0], True
    return tp, False


def _coerce(value, tp, where: str):
    tp, optional = _unwrap_optional(tp)
    if value is None:
        if optional:
            return None
        raise ConfigError(f"{where}: null is not allowed; give a {tp.__name__}.")
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{where}: expected true or false, got {value!r}.")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"{where}: expected an integer, got {value!r}.")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)  # YAML 1.1 reads "1e-3" as a string
            except ValueError:
                pass
        raise ConfigError(f"{where}: expected a number, got {value!r}.")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{where}: expected a string, got {value!r}.")
    raise ConfigError(f"{where}: unsupported field type {tp!r}.")  # pragma: no cover


def _unknown_key(key: str, valid: list[str], prefix: str) -> ConfigError:
    full = prefix + key
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    hint = f" Did you mean {prefix + close[0]!r}?" if close else ""
    return ConfigError(
        f"unknown config key {full!r}.{hint} Valid keys here: {', '.join(prefix + v for v in valid)}."
    )


def from_dict(raw: Optional[dict], cls=Config, prefix: str = ""):
    """Build `cls` (a config dataclass) from a nested dict, checking every key and type."""
    raw = {} if raw is None else raw
    if not isinstance(raw, dict):
        raise ConfigError(
            f"{prefix.rstrip('.') or 'config'}: expected a mapping of keys to values, got "
            f"{raw!r}."
        )
    hints = _hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in raw.items():
        if key not in fields:
            raise _unknown_key(str(key), list(fields), prefix)
        tp = hints[key]
        where = prefix + key
        if dataclasses.is_dataclass(tp):
            kwargs[key] = from_dict(value, tp, where + ".")
            continue
        v = _coerce(value, tp, where)
        choices = fields[key].metadata.get("choices")
        if choices is not None and v not in choices:
            close = difflib.get_close_matches(str(v), [str(c) for c in choices], n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise ConfigError(f"{where}: {v!r} is not one of {list(choices)}.{hint}")
        kwargs[key] = v
    cfg = cls(**kwargs)
    _validate(cfg, prefix)
    return cfg


def _validate(cfg, prefix: str):
    def need(cond, msg):
        if not cond:
            raise ConfigError(prefix + msg)

    if isinstance(cfg, DataConfig):
        need(cfg.seq_len >= 2, f"seq_len={cfg.seq_len} must be >= 2.")
        need(cfg.batch_size >= 1, f"batch_size={cfg.batch_size} must be >= 1.")
        need(cfg.eval_batches >= 1, f"eval_batches={cfg.eval_batches} must be >= 1.")
        need(0.0 < cfg.val_fraction < 1.0, f"val_fraction={cfg.val_fraction} must be in (0, 1).")
    elif isinstance(cfg, ModelConfig):
        need(cfg.dim >= 1 and cfg.depth >= 1 and cfg.num_heads >= 1,
             "dim, depth and num_heads must be >= 1.")
        need(cfg.dim % cfg.num_heads == 0,
             f"dim={cfg.dim} is not divisible by num_heads={cfg.num_heads}.")
        if cfg.attention == "spin":
            need(cfg.dim // cfg.num_heads > 2,
                 f"spin attention needs a head width dim/num_heads > 2 (the spin radius is "
                 f"sqrt(D_h/2 - 1)); got {cfg.dim // cfg.num_heads}.")
        need(0.0 <= cfg.dropout < 1.0, f"dropout={cfg.dropout} must be in [0, 1).")
    elif isinstance(cfg, BoltzmannConfig):
        need(cfg.num_samples >= 1 and cfg.dqa_steps >= 1 and cfg.max_steps >= 1,
             "num_samples, dqa_steps and max_steps must be >= 1.")
        need(cfg.burn_in >= 0 and cfg.init_scale >= 0, "burn_in and init_scale must be >= 0.")
    elif isinstance(cfg, TrainConfig):
        need(cfg.steps >= 1, f"steps={cfg.steps} must be >= 1.")
        need(cfg.lr > 0, f"lr={cfg.lr} must be > 0.")
        need(cfg.log_every >= 1 and cfg.eval_every >= 1, "log_every and eval_every must be >= 1.")
        need(cfg.keep_checkpoints >= 1, "keep_checkpoints must be >= 1.")
        need(cfg.patience >= 0 and cfg.checkpoint_every >= 0,
             "patience and checkpoint_every must be >= 0.")


def to_dict(cfg) -> dict:
    """The config as a plain nested dict (what `save_config` writes)."""
    return dataclasses.asdict(cfg)


def _set_dotted(raw: dict, dotted: str, value):
    parts = dotted.split(".")
    cls = Config
    node = raw
    for i, part in enumerate(parts):
        prefix = ".".join(parts[:i]) + ("." if i else "")
        names = [f.name for f in dataclasses.fields(cls)]
        if part not in names:
            raise _unknown_key(part, names, prefix)
        tp = _hints(cls)[part]
        if i == len(parts) - 1:
            if dataclasses.is_dataclass(tp):
                raise ConfigError(
                    f"{dotted!r} is a section, not a value; set one of its keys, e.g. "
                    f"{dotted}.{dataclasses.fields(tp)[0].name}=..."
                )
            node[part] = value
            return
        if not dataclasses.is_dataclass(tp):
            raise ConfigError(f"{prefix + part!r} is a value, not a section; cannot set {dotted!r}.")
        node = node.setdefault(part, {})
        if node is None:
            node = raw[part] = {}
        cls = tp


def parse_overrides(overrides: list[str]) -> list[tuple[str, Any]]:
    """Parse `["a.b=v", ...]` into `[("a.b", value), ...]`, values read as YAML scalars."""
    out = []
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE, e.g. --set train.steps=200.")
        k, v = item.split("=", 1)
        k = k.strip()
        if not k:
            raise ConfigError(f"--set {item!r}: the key is empty.")
        out.append((k, yaml.safe_load(v) if v.strip() else ""))
    return out


def load_config(path: Union[str, pathlib.Path, None] = None, overrides: Optional[list] = None
                ) -> Config:
    """Read a YAML config (or the defaults if `path` is None) and apply `--set` overrides.

    **Arguments:**

    - `path`: a YAML file.
    - `overrides`: `["a.b=v", ...]` strings.

    **Returns:** a frozen `Config`. Raises `ConfigError` naming any bad key or value.
    """
    raw: dict = {}
    if path is not None:
        p = pathlib.Path(path)
        if not p.exists():
            raise ConfigError(f"config file {str(p)!r} not found; `spinformer list` shows the "
                              "shipped configs.")
        try:
            raw = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{p}: not valid YAML: {e}") from e
        if not isinstance(raw, dict):
            raise ConfigError(f"{p}: the top level must be a mapping of sections.")
    for k, v in parse_overrides(list(overrides or [])):
        _set_dotted(raw, k, v)
    return from_dict(raw)


def save_config(cfg: Config, path: Union[str, pathlib.Path]) -> None:
    """Write the resolved config as YAML (loadable again with `load_config`)."""
    pathlib.Path(path).write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))


def describe(cls=Config, prefix: str = "") -> str:
    """Every field with its default and its one-line meaning, one per line."""
    lines = []
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            lines.append(f"{prefix}{f.name}:  # {f.metadata['help']}")
            lines.append(describe(tp, prefix + f.name + "."))
        else:
            lines.append(f"{prefix}{f.name} = {f.default!r}  # {f.metadata['help']}")
    return "\n".join(lines)
