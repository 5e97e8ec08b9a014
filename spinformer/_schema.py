"""The config engine: the one table where config words become classes, and the reading,
checking and writing of configs. `spinformer.config` declares the keys and their checks.

- `option(default, help, ...)`: a field of a config section (a frozen dataclass).
- `register_choice(kind, name)` offers a class under a config word (kinds such as
  `"solver"`, `"adjoint"`, `"spin.update"`); `choice(kind, value)` turns the word into an
  object. A field declared `option(obj, help, kind=...)` holds such an object: a config writes
  its name, or its name and fields (`solver: {name: picard, damping: 0.3}`).
- `register_attention(name, config=...)`: an attention module and its settings class, which a
  config holds as `model.attention: {name: ..., <setting>: ...}`; `train.build_model` passes
  the settings' fields to the constructor by name (docs/guides/own_attention.md).
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
           "name_of", "option", "register_attention", "register_choice", "registrations",
           "unregister_attention"]


class ConfigError(ValueError):
    """A configuration that cannot be used; the message names the key and the fix."""


def option(default: Any, help: str, choices: Union[tuple, Callable[[], tuple], None] = None,
           *, kind: Optional[str] = None, tasks: Optional[tuple[str, ...]] = None):
    """A config field (a `dataclasses.field`): its `default` (a config dataclass or an
    instance of one for a nested section), its one-line meaning `help`, its allowed values
    `choices` (a tuple, or a function returning one), the `kind` of object it holds
    (`register_choice`), and the `data.task`s that read it (`tasks`, None: every task;
    another task's config may not change it, and its `config.yaml` leaves it out)."""
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

_TABLE: dict[str, dict[str, type]] = {}  # kind -> name -> class


class Choice:
    """Base class of the families' option objects: frozen dataclasses (hashable, equal by
    value) whose `kind` and `name` `register_choice` sets; `str(option)` is the name."""

    kind: ClassVar[str] = ""
    name: ClassVar[str] = ""

    def __str__(self) -> str:
        return self.name


def register_choice(kind: str, name: str) -> Callable[[type], type]:
    """Class decorator: offer the class as the config word `name` of `kind`. Registering a
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
    """`" Did you mean 'x'?"` for the options nearest `value`, or `""`: the one hint every
    refusal of a name gives."""
    close = difflib.get_close_matches(str(value), [str(o) for o in options], n=n,
                                      cutoff=cutoff)
    return f" Did you mean {' or '.join(repr(prefix + c) for c in close)}?" if close else ""


def choice_names(kind: str) -> tuple[str, ...]:
    """The registered names of a kind, in registration order."""
    return tuple(_TABLE.get(kind, {}))


def choice_class(kind: str, name: str, *, where: Optional[str] = None) -> type:
    """The class registered as `name` of `kind`; a `ConfigError` naming `where` (default: the
    kind) and the nearest name for an unknown one."""
    table = _TABLE.get(kind)
    if not table:
        raise KeyError(f"nothing of kind {kind!r} is registered.")
    if name in table:
        return table[name]
    raise ConfigError(f"{where or kind}={name!r} is not one of {list(table)}."
                      f"{did_you_mean(name, table)}")


def choice(kind: str, value: Any, *, where: Optional[str] = None) -> Any:
    """The object of `kind` that `value` names (a name: its class with default fields; an
    object of a registered class: itself); `ConfigError` or `TypeError` otherwise."""
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


for _kind, _names in (
        ("solver", dict(anderson=solvers.Anderson, picard=solvers.Picard,
                        broyden=solvers.Broyden, newton=solvers.Newton,
                        reversible=solvers.Reversible)),
        ("adjoint", dict(implicit=solvers.Implicit, unrolled=solvers.Unrolled,
                         phantom=solvers.Phantom, onestep=solvers.OneStep, shine=solvers.Shine,
                         reversible=solvers.ReversibleAdjoint)),
        ("linear_solver", dict(anderson=solvers.Anderson, picard=solvers.Picard,
                               gmres=solvers.GMRES, bicgstab=solvers.BiCGStab,
                               dense=solvers.Dense, auto=solvers.Auto))):
    for _name, _cls in _names.items():
        register_choice(_kind, _name)(_cls)
del _kind, _names, _name, _cls


def name_of(kind: str, obj: Any) -> str:
    """The config word of object `obj` of `kind`; a `ConfigError` if its class is not
    registered (a config cannot name it)."""
    for name, cls in _TABLE.get(kind, {}).items():
        if type(obj) is cls:
            return name
    raise ConfigError(f"{type(obj).__name__} is not registered as a {kind}; a config names "
                      f"only registered classes (register_choice({kind!r}, name)).")


def check_solvers(section, *, root: bool = False) -> None:
    """A family section's check that its `solver` and `adjoint` fit each other and the
    problem (`root=True`: a root; `solvers.check_solver`), naming both keys."""
    try:
        solvers.check_solver(section.solver, section.adjoint, root=root)
    except ValueError as e:
        raise ConfigError(f"solver.name={name_of('solver', section.solver)!r} with adjoint.name="
                          f"{name_of('adjoint', section.adjoint)!r}: {e}") from None


def check_values(config: type, where: str, **values) -> None:
    """A module constructor's check of its arguments by its settings class's own checks
    (`config(**values)`), so each value is checked in one place; a `ValueError` led by
    `where`."""
    try:
        config(**values)
    except ConfigError as e:
        raise ValueError(f"{where}: {e}") from None


# ------------------------------------------------------------------------------ attentions

COUPLING_FIELDS = ("to_q", "to_k", "to_qk")  # the maps that build weights from queries, keys


@dataclasses.dataclass(frozen=True)
class Registration:
    """What `register_attention` declared: the module class `cls`, called as
    `cls(dim=, num_heads=, causal=, key=, **settings)`, and its settings class `config`."""

    name: str
    cls: type
    config: Optional[type]
    help: str
    takes_max_len: bool = False
    min_head_dim: int = 1
    coupling_fields: tuple[str, ...] = COUPLING_FIELDS
    carries_state: Optional[dict] = None
    default: bool = False

    def build(self, *, dim: int, num_heads: int, causal: bool, max_len: int, key, **kwargs):
        """The module, given `max_len` (the longest key sequence) if the class takes it."""
        if self.takes_max_len:
            kwargs.setdefault("max_len", max_len)
        return self.cls(dim=dim, num_heads=num_heads, causal=causal, key=key, **kwargs)

    def kwargs_from(self, section) -> dict:
        """The constructor's keyword arguments from a settings object: its fields by name."""
        if self.config is None:
            return {}
        if not isinstance(section, self.config):
            raise TypeError(f"attention {self.name!r}: expected a {self.config.__name__} "
                            f"section, got {type(section).__name__}.")
        return {f.name: getattr(section, f.name) for f in dataclasses.fields(section)}


_REGISTRY: dict[str, Registration] = {}  # the table's "attention" entries are the settings


def register_attention(name: str, *, config: Optional[type] = None, help: str = "",
                       takes_max_len: bool = False, min_head_dim: int = 1,
                       coupling_fields: tuple[str, ...] = COUPLING_FIELDS,
                       carries_state: Optional[dict] = None, default: bool = False):
    """Class decorator: register an attention module under `name` (an identifier).

    - `config`: its settings, a frozen dataclass of `option` fields, each passed to the
      constructor under its own name (None: none). Take the constructor's defaults from it
      (`beta=_DEFAULTS.beta`) so both agree; a test builds every registration both ways.
    - `help`: one line saying what it is. `takes_max_len`: the constructor takes `max_len=`.
    - `min_head_dim`: the smallest head width `dim / num_heads` it accepts.
    - `coupling_fields`: the fields of the coupling parameters (`nn.param_labels`).
    - `carries_state`: the settings under which it carries a state from call to call
      (`{"mode": "steps", "init": "carried"}`), None: never.
    - `default`: the default of `model.attention` (one registration at most).
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
    """The registration made with `default=True`, else the first registered."""
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
    """The registration of an attention name, class, settings object or registration. Any
    other callable `attention(dim=, num_heads=, causal=, key=, **kwargs)` gets one of its own
    (no settings, no `max_len`, the default coupling fields)."""
    if isinstance(attention, Registration):
        return attention
    if isinstance(attention, str):
        choice_class("attention", attention, where="attention")  # the "did you mean"
        return _REGISTRY[attention]
    for reg in _REGISTRY.values():
        if reg.cls is attention or type(attention) is reg.config:
            return reg
    if not callable(attention):
        raise TypeError(f"attention must be a name or a callable, got {attention!r}.")
    return Registration(getattr(attention, "__name__", "custom"), attention, None, "")


# ------------------------------------------------------------------------------ the keys

_INT_LIMIT = 2**31  # JAX uses config integers (sizes, seeds) as int32


@dataclasses.dataclass(frozen=True)
class Key:
    """One key of a section or of an object in it: `name`, `type` (a Python type, a section's
    class, an object's annotation), `default` (a section's or object's instance), `help`,
    `choices` (or None), `kind` (for a key holding an object, e.g. `"solver"`)."""

    name: str
    type: Any
    default: Any
    help: str
    choices: Optional[tuple] = None
    kind: Optional[str] = None

    @property
    def is_section(self) -> bool:
        """Whether keys lie below this one: a section, or an object with fields."""
        if self.kind is None:
            return dataclasses.is_dataclass(self.type)
        return self.default is not None and len(keys(self.default, self.kind)) > 1

    def schema(self):
        """What the keys below this one are read from: the section's or object's instance."""
        return self.default


def _doc_help(cls: type, name: str) -> str:
    """The first sentence of the bullet "- `name`: ..." in the docstrings of `cls` and its
    bases (where an object's fields are described), or ""."""
    for klass in cls.__mro__:
        for bullet in re.split(r"\n\s*- ", klass.__doc__ or "")[1:]:
            head, _, text = bullet.partition(":")
            if f"`{name}`" in head and head.startswith("`"):
                return " ".join(text.split()).split(". ")[0].rstrip(".")
    return ""


def _unwrap_optional(tp):
    if typing.get_origin(tp) in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(tp)) == 2:
            return args[0], True
        return tp, type(None) in typing.get_args(tp)
    return tp, False


def default_of(f: dataclasses.Field):
    """The default of a dataclass field."""
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()


def used(f: dataclasses.Field, task: Optional[str]) -> bool:
    """Whether `data.task` `task` reads field `f` (None: any task)."""
    return task is None or task in f.metadata.get("tasks", (task,))


def keys(cls, kind: Optional[str] = None, task: Optional[str] = None) -> dict[str, Key]:
    """The keys of a config section (its class: defaults; an instance: its values) that
    `data.task` `task` reads, in order; with `kind`, of object `cls` of that kind: `name`,
    then the fields a config can write (values and objects). A field's help is its
    `option`'s, else its class docstring's bullet."""
    is_class = isinstance(cls, type)
    hints = typing.get_type_hints(cls if is_class else type(cls))
    out = {}
    if kind is not None:
        out["name"] = Key("name", str, name_of(kind, cls), f"which {kind} (a registered name)",
                          choice_names(kind))
    for f in dataclasses.fields(cls):
        if not f.init or (kind is None and not used(f, task)):
            continue
        tp, value = hints[f.name], default_of(f) if is_class else getattr(cls, f.name)
        sub, base = f.metadata.get("kind"), _unwrap_optional(tp)[0]
        scalar = base in (bool, int, float, str) or typing.get_origin(base) is typing.Literal
        if sub is None and kind is not None and not scalar:
            sub = _object_kind(f, value)
            if sub is None:  # neither a value nor an object a config can write
                continue
        help_ = f.metadata.get("help") or (_doc_help(type(cls), f.name) if kind else "")
        choices = f.metadata.get("choices")
        if choices is None and typing.get_origin(base) is typing.Literal:
            choices = typing.get_args(base)
        out[f.name] = Key(f.name, tp, value, help_() if callable(help_) else help_,
                          tuple(choices()) if callable(choices) else choices, sub)
    return out


def _object_kind(f, value) -> Optional[str]:
    """The kind of an object field `f` of a registered class: its name when that is a kind
    (`linear_solver`), else the one kind of its value's class or its default's."""
    if choice_names(f.name):
        return f.name
    for v in (value, default_of(f)):
        found = [k for k, t in _TABLE.items() if v is not None and type(v) in t.values()]
        if len(found) == 1:
            return found[0]
    return None


def walk(schema, prefix: str = "", kind: Optional[str] = None, task: Optional[str] = None):
    """`(dotted key, Key)` of every key below `schema` (a section class or instance, or an
    object of `kind`) that `task` reads, depth first: behind `describe` and the reference."""
    for k in keys(schema, kind, task).values():
        yield prefix + k.name, k
        if k.is_section:
            yield from walk(k.schema(), prefix + k.name + ".", k.kind, task)


# ------------------------------------------------------------------------------ reading

_EXPECTED = {bool: "true or false", int: "an integer", str: "a string"}


def _coerce(value, tp, where: str):
    tp, optional = _unwrap_optional(tp)
    if typing.get_origin(tp) is typing.Literal:  # the allowed values are checked next
        tp = type(typing.get_args(tp)[0])
    if value is None:
        if optional:
            return None
        raise ConfigError(f"{where}: null is not allowed; give a {tp.__name__}.")
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
    if tp is dict:
        if isinstance(value, Mapping) and all(isinstance(k, str) for k in value):
            return dict(value)
        raise ConfigError(f"{where}: expected a mapping such as {{data: 2}}, got {value!r}.")
    if tp not in _EXPECTED:  # pragma: no cover
        raise ConfigError(f"{where}: unsupported field type {tp!r}.")
    if tp is int and isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, tp) and (tp is bool or not isinstance(value, bool)):
        if tp is int and not -_INT_LIMIT <= value < _INT_LIMIT:
            raise ConfigError(f"{where}: {value} is out of range; config integers lie "
                              "between -2**31 and 2**31 - 1.")
        return value
    raise ConfigError(f"{where}: expected {_EXPECTED[tp]}, got {value!r}.")


def _unknown_key(key: str, valid: list[str], prefix: str) -> ConfigError:
    if prefix == "model." and key in attention_names():  # the layout before 0.3
        return ConfigError(f"model.{key}: an attention's settings live in model.attention "
                           f"itself: `attention: {{name: {key}, <setting>: ...}}` in a file, "
                           f"`--set model.attention.<setting>=...` on the command line "
                           "(`spinformer show` lists them).")
    hint = did_you_mean(key, valid, cutoff=0.5, prefix=prefix)
    return ConfigError(f"unknown config key {prefix + key!r}.{hint} Valid keys here: "
                       f"{', '.join(prefix + v for v in valid)}.")


_RENAMED = "<renamed>"  # marks a mapping whose `name` `set_dotted` changed


def read(raw: Optional[dict], cls, prefix: str = ""):
    """Build `cls` (a config dataclass) from a nested dict, checking every key and type."""
    return _read(raw, Key("", cls, None, ""), prefix.rstrip("."))


def _read(value, k: Key, where: str):
    """The value of key `k` (dotted `where`) that a YAML value describes, checked: a number,
    string or flag; a section; or an object of kind `k.kind`, given as a name or a mapping
    of its name (default: `k.default`'s) and fields. An object of the default's class starts
    from the default's values; another class from its own defaults and the default's
    settings that it shares (a family's `tol` survives a change of solver). A mapping whose
    name an override changed keeps the settings the new class shares and drops the others."""
    if k.kind is None and not k.is_section:  # a value
        if isinstance(value, Mapping) and _unwrap_optional(k.type)[0] is not dict:
            raise ConfigError(f"{where} is a value, not a section; got {value!r}.")
        v = _coerce(value, k.type, where)
        if k.choices is not None and v not in k.choices:
            raise ConfigError(f"{where}: {v!r} is not one of {list(k.choices)}."
                              f"{did_you_mean(v, k.choices)}")
        return v
    prefix, droppable = where + "." if where else "", ()
    if k.kind is None:  # a section
        value = {} if value is None else value
        if not isinstance(value, dict):
            raise ConfigError(f"{where or 'config'} is a section: expected a mapping of its "
                              f"keys to values, got {value!r}.")
        schema = keys(k.type)
    else:  # an object
        default = k.default
        if value is None:
            if _unwrap_optional(k.type)[1]:
                return None
            raise ConfigError(f"{where}: null is not allowed; give a {k.kind} name.")
        named = where if isinstance(value, str) else where + ".name"
        value = {"name": value} if isinstance(value, str) else value
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where}: expected a {k.kind} name or a mapping such as "
                              f"{{name: {choice_names(k.kind)[0]}}}, got {value!r}.")
        value = dict(value)
        droppable = set(value.pop(_RENAMED, ()))
        name = value.pop("name", None if default is None else name_of(k.kind, default))
        names = choice_names(k.kind)
        if name is None:
            raise ConfigError(f"{named}: missing; one of {list(names)}.")
        if name not in names:
            raise ConfigError(f"{named}: {name!r} is not one of {list(names)}."
                              f"{did_you_mean(name, names)}")
        base = choice_class(k.kind, name)()
        if type(default) is type(base):
            base = default
        elif default is not None:
            plain_ = type(default)()
            shared = keys(base, k.kind)
            base = _make(base, {n: getattr(default, n) for n in keys(default, k.kind)
                                if n != "name" and n in shared
                                and getattr(default, n) != getattr(plain_, n)}, where)
        schema = keys(base, k.kind)
    changes = {}
    for n, v in value.items():
        if n in schema:
            changes[n] = _read(v, schema[n], prefix + str(n))
        elif n not in droppable:
            raise _unknown_key(str(n), list(schema), prefix)
    if k.kind is not None:
        return _make(base, changes, where)
    try:
        return k.type(**changes)
    except ConfigError as e:  # a section's own checks (`__post_init__`), named by its place
        raise ConfigError(prefix + str(e)) from None
    except ValueError as e:  # a check of the objects it holds (`solvers.check_solver`)
        raise ConfigError(f"{where}: {e}") from None


def _make(obj, changes: dict, where: str):
    """`obj` with fields changed; its class's check of a value becomes a `ConfigError`
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
    """`["a.b=v", ...]` (the command line's `--set`) as `{"a.b": value}`, values read as YAML
    scalars; a later key wins."""
    out: dict[str, Any] = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE, e.g. --set train.steps=200.")
        k, v = item.split("=", 1)
        if not k.strip():
            raise ConfigError(f"--set {item!r}: the key is empty.")
        out[k.strip()] = yaml.safe_load(v) if v.strip() else ""
    return out


def read_yaml(path) -> dict:
    """The mapping in a YAML config file; a `ConfigError` naming the file for a missing,
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
    if "experiment" in raw and "families" in raw:
        raise ConfigError(f"{p}: a grid (experiment: {raw['experiment']}), not a training run; "
                          f"run it with `spinformer grid run {p}` (`spinformer grid plan {p}` "
                          "lists its cells).")
    if "experiment" in raw:
        raise ConfigError(f"{p}: an experiment config (experiment: {raw['experiment']}), "
                          f"not a training run; run it with `python experiments/"
                          f"{raw['experiment']}.py all --config {p}`.")
    return raw


# ------------------------------------------------------------------------------ writing

def plain(value, kind: Optional[str] = None):
    """A value as YAML holds it: an object as its name, or a mapping of its name and
    fields; a mapping as a dict."""
    if kind is not None and value is not None:
        keys_ = keys(value, kind)
        fields = {n: plain(getattr(value, n), k.kind) for n, k in keys_.items() if n != "name"}
        return {"name": keys_["name"].default, **fields} if fields else keys_["name"].default
    return dict(value) if isinstance(value, dict) else value


def word(value, f: dataclasses.Field):
    """A field's value as an error names it: an object by its name."""
    kind = f.metadata.get("kind")
    return name_of(kind, value) if kind and value is not None else value


def to_dict(cfg, task: Optional[str] = None) -> dict:
    """A config section as the plain nested dict a `config.yaml` holds: the keys `task`
    reads."""
    return {k.name: to_dict(k.default, task) if k.kind is None and k.is_section
            else plain(k.default, k.kind) for k in keys(cfg, task=task).values()}
