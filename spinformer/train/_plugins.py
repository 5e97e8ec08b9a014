"""`--import`: the modules that register a run's own attention (or anything else a config
names), imported before its config is read, and recorded in the run directory so that
whatever reads the config again (diagnose, generate, --resume) imports them first."""

from __future__ import annotations

import json
import pathlib
import sys
from typing import Sequence

from .. import config as _config


# The modules a run was trained with `--import` (they register its attention), beside its
# config.yaml: whatever reads the config again (diagnose, generate, --resume) imports them first.
IMPORTS_FILE = "imports.json"


def import_modules(names: Sequence[str], *, search: Sequence[str] = (),
                   where: str = "--import") -> None:
    """Import each module: a path to a `.py` file, or a dotted name found on `sys.path`
    with the current directory first, then the directories `search`. A `.py` file already
    imported from the same path is not run again (what it registered stands). A module
    that cannot be imported is a `ConfigError` naming `where`, the module and the error."""
    import importlib
    import importlib.util

    for name in names:
        try:
            path = pathlib.Path(name)
            if name.endswith(".py"):
                if not path.is_file():
                    raise FileNotFoundError(f"no file {name}")
                loaded = sys.modules.get(path.stem)
                if (loaded is not None and getattr(loaded, "__file__", None)
                        and pathlib.Path(loaded.__file__).resolve() == path.resolve()):
                    continue
                spec = importlib.util.spec_from_file_location(path.stem, path)
                module = importlib.util.module_from_spec(spec)
                sys.modules[path.stem] = module
                spec.loader.exec_module(module)
            else:
                if "" not in sys.path and str(pathlib.Path.cwd()) not in sys.path:
                    sys.path.insert(0, str(pathlib.Path.cwd()))
                sys.path.extend(d for d in search if d not in sys.path)
                importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 - any failure of the user's module is reported
            raise _config.ConfigError(f"{where} {name}: {type(e).__name__}: {e}") from None


def record_imports(out: pathlib.Path, names: Sequence[str]) -> None:
    """Add the `--import` modules of a run to `out/imports.json` (kept on --resume): `.py`
    paths made absolute, dotted names with the directory they were imported from."""
    if not names:
        return
    path = out / IMPORTS_FILE
    rec = json.loads(path.read_text()) if path.exists() else {"modules": [], "search": []}
    for name in names:
        entry = str(pathlib.Path(name).resolve()) if name.endswith(".py") else name
        if entry not in rec["modules"]:
            rec["modules"].append(entry)
    cwd = str(pathlib.Path.cwd())
    if cwd not in rec["search"] and any(not n.endswith(".py") for n in names):
        rec["search"].append(cwd)
    path.write_text(json.dumps(rec, indent=2) + "\n")


def import_run_modules(run_dir) -> list[str]:
    """Import the modules a run was trained with (`record_imports`), so that its config
    reads again; returns their names (none for a run without `--import`)."""
    path = pathlib.Path(run_dir) / IMPORTS_FILE
    if not path.exists():
        return []
    try:
        rec = json.loads(path.read_text())
        modules, search = list(rec["modules"]), list(rec.get("search", []))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise _config.ConfigError(f"{path}: unreadable ({e}); it lists the modules the run "
                                  "was trained with (--import).") from None
    import_modules(modules, search=search, where=f"{path} (the run's --import):")
    return modules
