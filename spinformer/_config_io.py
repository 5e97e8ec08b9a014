"""Reading and writing config sections (frozen dataclasses made with `_schema.option`): the
one walk of the schema (`keys`), typed conversion from YAML values with errors that name
the key and the nearest valid one, dotted changes (`--set a.b=v`), and `describe`.
`spinformer.config` applies them to its `Config`."""

from __future__ import annotations

import dataclasses
import difflib
import math
import pathlib
import types
import typing
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Union

import yaml

from ._schema import ConfigError

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


def keys(cls) -> dict[str, Key]:
    """The keys of a config section (default: the whole `Config`), in order: its fields and,
    for `ModelConfig`, the section of every registered attention that declares one (read
    from the registry now). The one walk of the schema: reading, `--set`, `describe` and the
    tests all use it. Given a section instance instead of its class, the defaults are that
    instance's values (a family's own solver defaults, for example)."""
    if not isinstance(cls, type):
        return {name: dataclasses.replace(k, default=getattr(cls, name))
                for name, k in keys(type(cls)).items()}
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
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    hint = f" Did you mean {prefix + close[0]!r}?" if close else ""
    return ConfigError(
        f"unknown config key {full!r}.{hint} Valid keys here: {', '.join(prefix + v for v in valid)}."
    )


def from_dict(raw: Optional[dict], cls, prefix: str = "", *, base=None):
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
    schema = keys(cls)
    fields = {f.name for f in dataclasses.fields(cls)}
    kwargs, sections = {}, {}
    for key, value in raw.items():
        if key not in schema:
            raise _unknown_key(str(key), list(schema), prefix)
        k = schema[key]
        where = prefix + key
        if k.is_section:
            default = None if isinstance(k.default, type) else k.default
            (kwargs if key in fields else sections)[key] = from_dict(value, k.type, where + ".",
                                                                     base=default)
            continue
        v = _coerce(value, k.type, where)
        choices = k.choices
        if choices is not None and v not in choices:
            close = difflib.get_close_matches(str(v), [str(c) for c in choices], n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise ConfigError(f"{where}: {v!r} is not one of {list(choices)}.{hint}")
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
        schema = keys(cls)
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
            from_dict(node, tp, prefix + part + ".")  # raises: names the key and the fix
        cls = tp


def build(raw: dict, changes: Mapping[str, Any], root):
    """`from_dict(raw, root)` after setting each dotted key of `changes` (the one place where
    changes are applied: `Config.replace` and `load_config`'s overrides both come here)."""
    for k, v in changes.items():
        _set_dotted(raw, k, v, root)
    return from_dict(raw, root)


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


def describe(cls, prefix: str = "") -> str:
    """Every field of section `cls` (a class or an instance) with its default and its
    one-line meaning, one per line."""
    lines = []
    for k in keys(cls).values():
        if k.is_section:
            lines.append(f"{prefix}{k.name}:  # {k.help}")
            lines.append(describe(k.type if isinstance(k.default, type) else k.default,
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
