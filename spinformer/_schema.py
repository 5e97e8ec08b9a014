"""The config engine: the building blocks of config schemas, the one table where config words
become classes, and the reading, checking and writing of configs (YAML values coerced and
checked, tagged objects built, dotted changes applied, sections written back and walked).
`spinformer.config` declares the keys and their checks; everything generic lives here.

- `option(default, help, ...)`: a field of a config section (a frozen dataclass), with its
  one-line meaning and its allowed values.
- The name table: `register_choice(kind, name)` offers a class under a config word (the
  attentions, the solvers and adjoints, and each family's algorithm choices: kinds such as
  `"attention"`, `"solver"`, `"spin.update"`), and `choice(kind, value)` turns the word into
  an object (one lookup, one "did you mean"). A plugin adds its entry with the same
  decorator. Below the config, modules take objects.
- A field declared with `option(obj, help, kind=...)` holds an object of that kind (a
  solver, an adjoint, an update rule): a config writes its name, or its name and the
  fields of its class (`solver: {name: picard, damping: 0.3}`), and reading the config
  builds the object (`spinformer.config`).
- `register_attention(name, config=...)`: an attention module and its settings, a frozen
  dataclass registered as the `"attention"` word `name` of the same table: a config holds the
  attention as an object like a solver (`model.attention: {name: hopfield, beta: 2.0}`):

```python
@dataclasses.dataclass(frozen=True)
class HopfieldConfig:
    beta: float = option(1.0, "inverse temperature")
    solver: solvers.AbstractSolver = option(solvers.Picard(), "retrieval", kind="solver")

_DEFAULTS = HopfieldConfig()

@register_attention("hopfield", config=HopfieldConfig, help="modern Hopfield retrieval")
class HopfieldAttention(eqx.Module):
    def __init__(self, dim, num_heads=1, causal=False, *, beta=_DEFAULTS.beta,
                 solver=_DEFAULTS.solver, key):
        ...
```

  After registration `Transformer(attention="hopfield")` builds it, every config accepts
  `model.attention: hopfield` or `{name: hopfield, beta: ...}`, and
  `spinformer.train.build_model` passes the settings' fields to the constructor by name. The
  constructor's defaults are the settings', so a module built in Python equals one built
  from a default config.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import math
import pathlib
import re
import types
import typing
from typing import Any, Callable, ClassVar, Mapping, Optional, Union

import yaml

from . import solvers

__all__ = ["Choice", "ConfigError", "Registration", "attention_names", "check_solvers",
           "check_values", "choice", "choice_names", "default_attention", "get_attention",
           "kinds_of", "name_of", "option", "register_attention", "register_choice",
           "registrations", "unregister_attention"]


class ConfigError(ValueError):
    """A configuration that cannot be used; the message names the key and the fix."""


def option(
    default: Any,
    help: str,
    choices: Union[tuple, Callable[[], tuple], None] = None,
    *,
    kind: Optional[str] = None,
    tasks: Optional[tuple[str, ...]] = None,
):
    """A config field: its default, its one-line meaning and, optionally, its allowed values.

    **Arguments:**

    - `default`: the default value, or a config dataclass (a nested section, built with its
      own defaults), or an instance of one (a nested section with these defaults).
    - `help`: one line saying what the field means (`spinformer.config.describe` prints it).
    - `choices`: the allowed values, if the field is an enumeration (a tuple, or a function
      returning one when the values are registered at run time).
    - `kind`: the field holds an object of a class registered under this kind
      (`register_choice`): a config gives its name, or a mapping of its name and fields, and
      reading the config builds the object.
    - `tasks`: the `data.task`s that read the field (None: every task). Another task's
      config may not change it, and its `config.yaml` leaves it out.

    **Returns:** a `dataclasses.field`.
    """
    meta: dict[str, Any] = {"help": help}
    if tasks is not None:
        meta["tasks"] = tuple(tasks)
    if kind is not None:
        meta["kind"] = kind
        choices = choices if choices is not None else (lambda: choice_names(kind))
    if choices is not None:
        meta["choices"] = choices if callable(choices) else tuple(choices)
    if isinstance(default, type) and dataclasses.is_dataclass(default):
        return dataclasses.field(default_factory=default, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


# ------------------------------------------------------------------------------ the table

# kind -> name -> class
_TABLE: dict[str, dict[str, type]] = {}


class Choice:
    """Base class of the families' option objects (frozen dataclasses, so they are hashable:
    modules keep them as static fields, and two equal options compare equal).

    `kind` and `name` are class attributes set by `register_choice`; `str(option)` is its
    name (what a config file holds)."""

    kind: ClassVar[str] = ""
    name: ClassVar[str] = ""

    def __str__(self) -> str:
        return self.name


def register_choice(kind: str, name: str) -> Callable[[type], type]:
    """Class decorator: offer class `cls` as the config word `name` of `kind` (e.g.
    `register_choice("spin.update", "tap")`, `register_choice("solver", "picard")`).
    A `Choice` must be a frozen dataclass and learns its `kind` and `name`. Registering a
    second class under a taken name is an error; re-registering the same class is not."""

    def decorate(cls: type) -> type:
        if not isinstance(cls, type):
            raise TypeError(f"register_choice({kind!r}, {name!r}): {cls!r} is not a class.")
        if issubclass(cls, Choice):
            if not (dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen):
                raise TypeError(f"register_choice({kind!r}, {name!r}): {cls.__name__} must "
                                "be a frozen dataclass (options are hashable and compare by "
                                "value).")
            cls.kind, cls.name = kind, name
        table = _TABLE.setdefault(kind, {})
        if name in table and table[name] is not cls:
            raise ValueError(f"register_choice: {kind} {name!r} is already "
                             f"{table[name].__name__}.")
        table[name] = cls
        return cls

    return decorate


def did_you_mean(value: Any, options, *, n: int = 1, cutoff: float = 0.6,
                 prefix: str = "") -> str:
    """`" Did you mean 'x'?"` for the options nearest `value` (up to `n`, `prefix` put before
    each), or `""`: the one hint every refusal of a name gives."""
    close = difflib.get_close_matches(str(value), [str(o) for o in options], n=n,
                                      cutoff=cutoff)
    return f" Did you mean {' or '.join(repr(prefix + c) for c in close)}?" if close else ""


def choice_names(kind: str) -> tuple[str, ...]:
    """The registered names of a kind, in registration order."""
    return tuple(_TABLE.get(kind, {}))


def choice_class(kind: str, name: str, *, where: Optional[str] = None) -> type:
    """The class registered as `name` of `kind`; an unknown name raises `ConfigError` with
    the nearest registered one (the one "did you mean"), naming `where` (default: the
    kind)."""
    table = _TABLE.get(kind)
    if not table:
        raise KeyError(f"nothing of kind {kind!r} is registered.")
    if name in table:
        return table[name]
    raise ConfigError(f"{where or kind}={name!r} is not one of {list(table)}."
                      f"{did_you_mean(name, table)}")


def choice(kind: str, value: Any, *, where: Optional[str] = None) -> Any:
    """The object of `kind` that `value` names: a registered name becomes its class built
    with default fields; an object of a class registered under `kind` is returned as is.
    Anything else raises `ConfigError` (an unknown name) or `TypeError` (an object of
    another kind), naming `where` (default: the kind)."""
    if isinstance(value, str):
        return choice_class(kind, value, where=where)()
    table = _TABLE.get(kind, {})
    if any(type(value) is cls for cls in table.values()):
        return value
    if isinstance(value, Choice):
        raise TypeError(f"{where or kind}: {type(value).__name__} is a {value.kind or 'Choice'} "
                        f"option, not a {kind} option; choose one of {list(table)}.")
    raise TypeError(f"{where or kind}: expected one of {list(table)} (or its object), got "
                    f"{value!r}.")


# -------------------------------------------------- the solvers' config words (kind: class)

for _kind, _names in (
        ("solver", dict(anderson=solvers.Anderson, picard=solvers.Picard,
                        broyden=solvers.Broyden, newton=solvers.Newton,
                        reversible=solvers.Reversible)),
        ("adjoint", dict(implicit=solvers.Implicit, unrolled=solvers.Unrolled,
                         phantom=solvers.Phantom, onestep=solvers.OneStep,
                         reversible=solvers.ReversibleAdjoint)),
        ("linear_solver", dict(anderson=solvers.Anderson, picard=solvers.Picard,
                               gmres=solvers.GMRES, bicgstab=solvers.BiCGStab,
                               dense=solvers.Dense, auto=solvers.Auto))):
    for _name, _cls in _names.items():
        register_choice(_kind, _name)(_cls)
del _kind, _names, _name, _cls


def kinds_of(cls: type) -> tuple[str, ...]:
    """The kinds under which class `cls` is registered."""
    return tuple(k for k, table in _TABLE.items() if cls in table.values())


def name_of(kind: str, obj: Any) -> str:
    """The config word of object `obj` of `kind` (its class's registered name); a
    `ConfigError` if its class is not registered (a config cannot name it)."""
    for name, cls in _TABLE.get(kind, {}).items():
        if type(obj) is cls:
            return name
    raise ConfigError(f"{type(obj).__name__} is not registered as a {kind}; a config names "
                      f"only registered classes (register_choice({kind!r}, name)).")


def check_solvers(section, *, root: bool = False) -> None:
    """A family section's check of its `solver` and `adjoint` (in its `__post_init__`): they
    must fit each other and the problem (`root=True`: a root; `solvers.check_solver`); a
    `ConfigError` names both keys."""
    try:
        solvers.check_solver(section.solver, section.adjoint, root=root)
    except ValueError as e:
        raise ConfigError(f"solver.name={name_of('solver', section.solver)!r} with adjoint.name="
                          f"{name_of('adjoint', section.adjoint)!r}: {e}") from None


def check_values(config: type, where: str, **values) -> None:
    """Run the checks of config section `config` (its `__post_init__`) on `values`, fields of
    it (the others at their defaults): a module's constructor checks its arguments with the
    checks its section makes when a config is read, so each value is checked in one place.
    A failure is a `ValueError` led by `where`."""
    try:
        config(**values)
    except ConfigError as e:
        raise ValueError(f"{where}: {e}") from None


# ------------------------------------------------------------------------------ attentions
#
# An attention is one module plus its frozen config dataclass, registered under its config
# word (kind "attention"); `model.<name>` is then its section, whose fields are the
# constructor's keyword arguments.

# The coupling fields assumed for an attention that does not declare its own: the maps that
# build attention weights from queries and keys.
COUPLING_FIELDS = ("to_q", "to_k", "to_qk")


@dataclasses.dataclass(frozen=True)
class Registration:
    """What a registered attention declares (the arguments of `register_attention`, and
    `cls`, the class, called as `cls(dim=, num_heads=, causal=, key=, **kwargs)`; `config`
    is the settings class, empty for an attention without settings)."""

    name: str
    cls: type
    config: Optional[type]
    help: str
    takes_max_len: bool = False
    min_head_dim: int = 1
    coupling_fields: tuple[str, ...] = COUPLING_FIELDS
    carries_state: Optional[dict] = None
    default: bool = False

    def build(self, *, dim: int, num_heads: int, causal: bool, max_len: int, key,
              **kwargs):
        """The attention module `cls(dim=, num_heads=, causal=, key=, **kwargs)`, given
        `max_len=` (the longest key sequence) when the class takes it and `kwargs` does not
        set it."""
        if self.takes_max_len:
            kwargs.setdefault("max_len", max_len)
        return self.cls(dim=dim, num_heads=num_heads, causal=causal, key=key, **kwargs)

    def kwargs_from(self, section) -> dict:
        """Constructor keyword arguments from the settings object (`model.attention`): its
        fields by name."""
        if self.config is None:
            return {}
        if not isinstance(section, self.config):
            raise TypeError(f"attention {self.name!r}: expected a {self.config.__name__} "
                            f"section, got {type(section).__name__}.")
        return {f.name: getattr(section, f.name) for f in dataclasses.fields(section)}


# name -> Registration (the name table's "attention" entries are the settings classes)
_REGISTRY: dict[str, Registration] = {}


def register_attention(name: str, *, config: Optional[type] = None, help: str = "",
                       takes_max_len: bool = False, min_head_dim: int = 1,
                       coupling_fields: tuple[str, ...] = COUPLING_FIELDS,
                       carries_state: Optional[dict] = None, default: bool = False):
    """Class decorator: register an attention module under `name`.

    **Arguments:**

    - `name`: a Python identifier (it becomes the config section `model.<name>`).
    - `config`: a frozen dataclass of the module's settings (fields made with `option`), or
      None (no settings: an empty one is made). Each field is passed to the constructor
      under its own name; a config holds an instance as `model.attention`. Take the
      constructor's defaults from the section (`_DEFAULTS = Config()`,
      `beta=_DEFAULTS.beta`) so that both agree: a test builds every registration both ways.
    - `help`: one line saying what the attention is.
    - `takes_max_len`: the constructor takes `max_len=` (given by `Transformer`).
    - `min_head_dim`: the smallest head width `dim / num_heads` the class accepts (checked
      when a config is read).
    - `coupling_fields`: the fields holding the parameters that define the couplings (the
      optimizer group "couplings" of `nn.param_labels`).
    - `carries_state`: the section values under which the module carries its state from
      one call to the next (`state=`, what streaming data needs), e.g. `{"mode": "steps",
      "init": "carried"}`; None: never.
    - `default`: make this the default of `model.attention` (one registration at most).

    **Returns:** the decorator, which returns the class unchanged.
    """
    if not name.isidentifier():
        raise ValueError(f"register_attention: name {name!r} must be a Python identifier.")
    if config is not None and not (dataclasses.is_dataclass(config)
                                   and config.__dataclass_params__.frozen):
        raise TypeError(f"register_attention({name!r}): config must be a frozen dataclass, "
                        f"got {config!r}.")

    def decorate(cls):
        if name in _REGISTRY and _REGISTRY[name].cls is not cls:
            raise ValueError(f"register_attention: {name!r} is already registered to "
                             f"{_REGISTRY[name].cls.__name__}.")
        params = inspect.signature(cls.__init__).parameters
        missing = [f.name for f in dataclasses.fields(config)
                   if f.name not in params] if config else []
        if missing and not any(p.kind is p.VAR_KEYWORD for p in params.values()):
            raise TypeError(f"register_attention({name!r}): {cls.__name__}'s constructor has "
                            f"no argument {missing[0]!r} of its config section; rename the "
                            "field or the argument.")
        if default and any(r.default and r.name != name for r in _REGISTRY.values()):
            raise ValueError(f"register_attention({name!r}, default=True): "
                             f"{default_attention()!r} is already the default.")
        settings = config or dataclasses.make_dataclass(
            f"{cls.__name__}Settings", [], frozen=True,
            namespace={"__doc__": f"{name} attention has no settings."})
        if "name" in {f.name for f in dataclasses.fields(settings)}:
            raise TypeError(f"register_attention({name!r}): {settings.__name__} may not have a "
                            "field `name` (a config's `name` key chooses the attention).")
        settings.name = name  # `cfg.model.attention.name`
        _TABLE.setdefault("attention", {})[name] = settings
        _REGISTRY[name] = Registration(name, cls, settings, help, takes_max_len, min_head_dim,
                                       tuple(coupling_fields), carries_state, default)
        return cls

    return decorate


def unregister_attention(name: str) -> None:
    """Remove a registered attention (e.g. one a test registered)."""
    _REGISTRY.pop(name)
    _TABLE["attention"].pop(name)


def default_attention() -> str:
    """The default of `model.attention`: the registration made with `default=True`, else the
    first registered."""
    if not _REGISTRY:
        raise ValueError("no attention is registered.")
    return next((r.name for r in _REGISTRY.values() if r.default), next(iter(_REGISTRY)))


def attention_names() -> tuple[str, ...]:
    """The registered attention names, in registration order."""
    return tuple(_REGISTRY)


def registrations() -> tuple[Registration, ...]:
    """Every registration, in registration order."""
    return tuple(_REGISTRY.values())


def get_attention(attention: Union[str, type, Callable, Any]) -> Registration:
    """The registration of an attention name, class, or settings object (what a config's
    `model.attention` holds). An unregistered callable gets a registration of its own (no
    settings, no `max_len`, the default coupling fields), so any
    `attention(dim=, num_heads=, causal=, key=, **kwargs)` works."""
    if isinstance(attention, str):
        choice_class("attention", attention, where="attention")  # the "did you mean"
        return _REGISTRY[attention]
    for reg in _REGISTRY.values():
        if reg.cls is attention or type(attention) is reg.config:
            return reg
    if not callable(attention):
        raise TypeError(f"attention must be a name or a callable, got {attention!r}.")
    return Registration(getattr(attention, "__name__", "custom"), attention, None, "")


# ------------------------------------------ the engine: reading, checking and writing configs

# integers are sizes, counts and seeds, used as int32 by JAX (a larger seed would be
# silently truncated to 32 bits)
_INT_LIMIT = 2**31


@dataclasses.dataclass(frozen=True)
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
        return self.default is not None and len(keys(self.default, self.kind)) > 1

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
    if choice_names(f.name):
        return f.name
    for v in (value, f.default):
        found = kinds_of(type(v)) if v is not None else ()
        if len(found) == 1:
            return found[0]
    return None


def default_of(f: dataclasses.Field):
    """The default of a dataclass field."""
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()


def keys(cls, kind: Optional[str] = None) -> dict[str, Key]:
    """The keys of a config section class, or (`kind` given) of object `cls` of that kind,
    in order. For a section: its fields; a field declared with `kind=` holds an object. For
    an object: `name` (its config word), then the fields of its class that a config can
    write (numbers, strings, flags and nested objects) with this object's values as
    defaults. A field's help is its `option`'s, else its class docstring's bullet."""
    obj = cls if kind is not None else None
    hints = typing.get_type_hints(type(obj) if kind is not None else cls)
    out = {}
    if kind is not None:
        out["name"] = Key("name", str, name_of(kind, obj),
                          f"which {kind} (a registered name)", choice_names(kind))
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        if kind is None:
            value = hints[f.name] if dataclasses.is_dataclass(hints[f.name]) else default_of(f)
        else:
            value = getattr(obj, f.name)
        sub = f.metadata.get("kind")
        if sub is None and kind is not None and not _scalar(hints[f.name]):
            sub = _object_kind(f, value)
            if sub is None:  # neither a value nor an object a config can write
                continue
        help_ = f.metadata.get("help") or (_doc_help(type(obj), f.name) if kind else "")
        out[f.name] = _key(f.name, hints[f.name], value,
                           help_() if callable(help_) else help_, f.metadata.get("choices"),
                           sub)
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
                          f"{did_you_mean(v, k.choices)}")
    return v


def _unknown_key(key: str, valid: list[str], prefix: str) -> ConfigError:
    if prefix == "model." and key in attention_names():  # the layout before 0.3
        return ConfigError(f"model.{key}: an attention's settings live in model.attention "
                           f"itself: `attention: {{name: {key}, <setting>: ...}}` in a file, "
                           f"`--set model.attention.<setting>=...` on the command line "
                           "(`spinformer show` lists them).")
    hint = did_you_mean(key, valid, cutoff=0.5, prefix=prefix)
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
                          f"{{name: {choice_names(k.kind)[0]}}}, got {value!r}.")
    value = dict(value)
    droppable = set(value.pop(_RENAMED, ()))
    name = value.pop("name", None if default is None else name_of(k.kind, default))
    if name is None:
        raise ConfigError(f"{named}: missing; one of {list(choice_names(k.kind))}.")
    names = choice_names(k.kind)
    if name not in names:  # as a value outside its choices
        raise ConfigError(f"{named}: {name!r} is not one of {list(names)}."
                          f"{did_you_mean(name, names)}")
    base = cls = choice_class(k.kind, name)()
    if type(default) is type(cls):
        base = default
    elif default is not None:
        plain = type(default)()
        base = _make(cls, {n: getattr(default, n) for n in keys(default, k.kind)
                           if n != "name" and n in keys(cls, k.kind)
                           and getattr(default, n) != getattr(plain, n)}, where)
    schema = keys(base, k.kind)
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
    except ConfigError as e:  # settings' own checks ("key=... must be ..."), named by place
        raise ConfigError(f"{where}.{e}") from None
    except (ValueError, TypeError) as e:  # "Cls(key=...) must be ...": the key leads
        key = re.match(r"\w+(?:\(|: )(\w+)=", str(e))
        key = key.group(1) if key and key.group(1) in changes else None
        lead = f"{where}.{key}={changes[key]!r}" if key else where
        raise ConfigError(f"{lead}: {e}") from None


def read(raw: Optional[dict], cls, prefix: str = ""):
    """Build `cls` (a config dataclass) from a nested dict, checking every key and type."""
    raw = {} if raw is None else raw
    if not isinstance(raw, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'} is a section: expected a mapping "
                          f"of its keys to values, got {raw!r}.")
    schema = keys(cls)
    kwargs = {}
    for key, value in raw.items():
        if key not in schema:
            raise _unknown_key(str(key), list(schema), prefix)
        k = schema[key]
        if k.kind is None and k.is_section:  # a section (an object: `_value`)
            kwargs[key] = read(value, k.type, prefix + key + ".")
        else:
            kwargs[key] = _value(value, k, prefix + key)
    try:
        return cls(**kwargs)
    except ConfigError as e:  # a section's own checks (`__post_init__`), named by its place
        raise ConfigError(prefix + str(e)) from None
    except ValueError as e:  # a check of the objects it holds (`solvers.check_solver`)
        raise ConfigError(f"{prefix.rstrip('.')}: {e}") from None


def plain(value, kind: Optional[str] = None):
    """A value as YAML holds it: an object as its name, or a mapping of its name and
    fields when its class has fields; a section as a mapping."""
    if kind is not None and value is not None:
        keys_ = keys(value, kind)
        fields = {n: plain(getattr(value, n), k.kind) for n, k in keys_.items() if n != "name"}
        return {"name": keys_["name"].default, **fields} if fields else keys_["name"].default
    return dict(value) if isinstance(value, dict) else value


def word(value, f: dataclasses.Field):
    """A field's value as an error names it: an object by its name."""
    kind = f.metadata.get("kind")
    return name_of(kind, value) if kind and value is not None else value


def used(f: dataclasses.Field, task: Optional[str]) -> bool:
    """Whether `data.task` `task` reads field `f` (None: any task)."""
    return task is None or task in f.metadata.get("tasks", (task,))


def to_dict(cfg, task: Optional[str] = None) -> dict:
    """A config section as a plain nested dict (what a `config.yaml` holds): the keys that
    `data.task` `task` reads (None: every key)."""
    out = {}
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if not used(f, task):
            continue
        if dataclasses.is_dataclass(value) and "kind" not in f.metadata:
            out[f.name] = to_dict(value, task)
        else:
            out[f.name] = plain(value, f.metadata.get("kind"))
    return out


def set_dotted(raw: dict, dotted: str, value) -> dict:
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
    return {**raw, head: set_dotted(node, rest, value)}


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


def walk(schema, prefix: str = "", kind: Optional[str] = None):
    """`(dotted key, Key)` of every key below `schema` (a section class, or an object of
    `kind`), depth first: the one walk behind `describe` and `reference_markdown`."""
    for k in keys(schema, kind).values():
        yield prefix + k.name, k
        if k.is_section:
            yield from walk(k.schema(), prefix + k.name + ".", k.kind)


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
