"""The command line every experiment script shares: `python experiments/NAME.py COMMAND
[options]`, where COMMAND is one of the script's steps (`run`, `report`, ...) or `all` (every
step, in order), with `--runs` (where the training runs go; a rerun resumes them) and
`--results` (where the tables and figures are written)."""

from __future__ import annotations

import argparse
import functools
import pathlib
from typing import Callable, Iterable, Optional, Union

from spinformer._toolchain import failure_message, release_compiled_code  # noqa: F401

ROOT = pathlib.Path(__file__).resolve().parent.parent


def make_parser(doc: str, *, runs: Union[str, None, bool], results: Optional[str],
                commands: tuple[str, ...] = ("run", "report")) -> argparse.ArgumentParser:
    """The parser with the shared arguments: `command` (one of `commands` or `all`), and
    `--runs`/`--results` defaulting to `runs/<runs>` and `experiments/results/<results>`
    (None: no default, the script derives one; `runs=False`: a script that trains nothing
    has no `--runs`). The script adds its own options."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("command", choices=(*commands, "all"),
                   help=f"{', '.join(commands)}, or all of them in this order")
    if runs is not False:
        p.add_argument("--runs", default=None if runs is None else str(ROOT / "runs" / runs),
                       help="the directory of the training runs (a rerun resumes them)")
    p.add_argument("--results", default=None if results is None
                   else str(ROOT / "experiments" / "results" / results),
                   help="where the tables and figures are written")
    return p


def dispatch(args: argparse.Namespace, **steps: Callable[[argparse.Namespace], object]):
    """Run the step `args.command` names, or every step in the order given for `all`."""
    for name, step in steps.items():
        if args.command in (name, "all"):
            step(args)


def chosen(names: Optional[str], known: Iterable[str], default: Iterable[str]) -> list[str]:
    """The comma-separated `names` of an option such as `--variants` (None: `default`), each
    checked against `known`; an unknown one ends the script with the valid names."""
    known = list(known)
    picked = [n.strip() for n in names.split(",") if n.strip()] if names else list(default)
    for name in picked:
        if name not in known:
            raise SystemExit(f"unknown variant {name!r}; choose from {known}")
    return picked


def releasing_compiled_code(run: Callable) -> Callable:
    """`run` (a training run, `spinformer.train.run`) followed by `release_compiled_code()`,
    however it ends, so that the memory mappings of a process do not grow with the number of
    runs it trains."""
    if getattr(run, "_releases_compiled_code", False):
        return run

    @functools.wraps(run)
    def wrapped(*args, **kwargs):
        try:
            return run(*args, **kwargs)
        finally:
            release_compiled_code()

    wrapped._releases_compiled_code = True
    return wrapped


def run_script(main: Callable[[], object]) -> None:
    """A script's entry point: restart once with huge pages for malloc's large buffers where
    the system allows (as the `spinformer` command does; `SPINFORMER_HUGEPAGES=0` turns it
    off), then `main()`, its return value the exit status. Every `spinformer.train.run` the
    script makes releases the compiled programs when it ends (`releasing_compiled_code`), so
    that a sweep of any length trains in one process; the persistent compilation
    cache (`spinformer._toolchain.use_compilation_cache`, as for the `spinformer` command)
    gives the next run of the same program, another seed of the cell, its compiled code
    back."""
    from spinformer._toolchain import restart_with_hugepages, use_compilation_cache

    restart_with_hugepages()
    use_compilation_cache()  # the next run of the same program reads it back
    import spinformer.train

    spinformer.train.run = releasing_compiled_code(spinformer.train.run)
    raise SystemExit(main())
