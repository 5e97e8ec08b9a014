"""The `spinformer` command. Thin: parse arguments, load the config, call library functions.

```
spinformer run CONFIG [--out DIR] [--set key=value ...] [--resume]
               [--coordinator HOST:PORT --num-processes N --process-id I]
spinformer list [--dir DIR]
spinformer show CONFIG [--set key=value ...]
spinformer report DIR [DIR ...] [--out DIR]
spinformer generate RUN_DIR --prompt TEXT [--length N] [--temperature T] [--seed S]
                    [--no-cache] [--decode-steps K]
spinformer diagnose RUN_DIR [--batches N] [--starts K] [--seed S] [--out DIR]
spinformer data fetch NAME
```
"""

from __future__ import annotations

import argparse
import json
import pathlib
import signal
import sys
from typing import Optional, Sequence

import yaml


def configs_dir() -> pathlib.Path:
    """`./configs` if it exists, else the configs shipped inside the installed package
    (`spinformer/configs`, package data of the wheel), else the `configs/` folder of the
    checkout the package is imported from (an editable install)."""
    import importlib.resources

    local = pathlib.Path("configs")
    if local.is_dir():
        return local
    shipped = pathlib.Path(str(importlib.resources.files(__package__) / "configs"))
    checkout = pathlib.Path(__file__).resolve().parents[1] / "configs"
    return shipped if shipped.is_dir() or not checkout.is_dir() else checkout


def _no_configs_note(d: pathlib.Path) -> str:
    return (f"no configs found in {d}: this installation ships none. Give a config file "
            "(`spinformer run path/to/config.yaml`), run from a checkout of the repository "
            "(its configs/ folder), or reinstall from a checkout with `pip install .`, which "
            "puts them inside the package.")


def find_config(name: str) -> pathlib.Path:
    """A config file path, or the name of a shipped config (`quickstart`)."""
    p = pathlib.Path(name)
    if p.exists():
        return p
    for cand in (configs_dir() / name, configs_dir() / f"{name}.yaml"):
        if cand.exists():
            return cand
    from ._schema import did_you_mean
    from .config import ConfigError

    names = [n for n, _ in list_configs()] if configs_dir().is_dir() else []
    if not names:
        raise ConfigError(f"config {name!r} not found; {_no_configs_note(configs_dir())}")
    hint = did_you_mean(pathlib.Path(name).stem, names, n=3)
    raise ConfigError(f"config {name!r} not found.{hint} `spinformer list` shows the shipped "
                      "configs.")


# the width of a `spinformer list` line's description (its first sentence)
_SUMMARY_WIDTH = 76


def summary_line(description: str) -> str:
    """The first sentence of a config's description (up to the first ". "), cut to
    `_SUMMARY_WIDTH` characters at a word: what `spinformer list` shows of it."""
    text = " ".join(str(description).split())
    head, dot, _ = text.partition(". ")
    head = head + ("." if dot else "")
    if len(head) > _SUMMARY_WIDTH:
        head = head[:_SUMMARY_WIDTH - 1].rsplit(" ", 1)[0] + "…"
    return head


def list_configs(directory: Optional[pathlib.Path] = None) -> list[tuple[str, str]]:
    """`(name, description)` of every YAML config in `directory` (the whole description;
    `summary_line` gives its first sentence)."""
    d = directory or configs_dir()
    out = []
    for p in sorted(d.glob("*.yaml")):
        try:
            desc = (yaml.safe_load(p.read_text()) or {}).get("description", "")
        except yaml.YAMLError:
            desc = "(unreadable YAML)"
        out.append((p.stem, " ".join(str(desc).split()) if desc else ""))
    return out


def default_out_dir(config_path: pathlib.Path, resume: bool) -> pathlib.Path:
    """`runs/<config name>`; a fresh run never reuses a directory holding an earlier run
    (`runs/<name>-1`, `-2`, ... instead); `--resume` picks the newest one."""
    base = pathlib.Path("runs") / config_path.stem
    cands = [base] + [base.with_name(f"{base.name}-{i}") for i in range(1, 1000)]
    existing = [c for c in cands if c.exists() and any(c.iterdir())]
    if resume:
        return existing[-1] if existing else base
    for c in cands:
        if not (c.exists() and any(c.iterdir())):
            return c
    raise RuntimeError(f"too many runs under {base.parent}; pass --out.")  # pragma: no cover


class _SignalEcho:
    """While active (the command line's `run`), acknowledge SIGINT/SIGTERM at once, even while
    the main thread is inside a long call that Python cannot interrupt (XLA compiling the
    first step): the C-level handler writes each signal to a pipe (`signal.set_wakeup_fd`),
    and a thread prints a line for the first; a second one ends the process at once (exit
    128 + signal; checkpoints are written atomically, so those on disk are intact). The
    Python-level handling of the first (a checkpoint after the step in flight) is unchanged;
    the second is this thread's alone (`StopSignals.second_signal_exits_elsewhere`), so the
    main thread does not also raise a `KeyboardInterrupt` wherever it happens to be.

    A repeat of the same signal within `StopSignals.SAME_REQUEST_S` of the first is the same
    request delivered twice (coreutils `timeout` signals the process, then its group)."""

    def __enter__(self):
        import os
        import threading

        from .train import StopSignals

        self.same_request_s = StopSignals.SAME_REQUEST_S
        self.old_fd = None
        if threading.current_thread() is not threading.main_thread():
            return self
        self.read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        try:
            self.old_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        except ValueError:
            return self
        self.write_fd = write_fd
        self.exits_before = StopSignals.second_signal_exits_elsewhere
        StopSignals.second_signal_exits_elsewhere = True  # this thread does it, not a raise
        threading.Thread(target=self._echo, daemon=True).start()
        return self

    def _echo(self):
        import os
        import time

        seen, first = 0, {}
        while True:
            try:
                data = os.read(self.read_fd, 64)
            except OSError:
                data = b""
            if not data:
                os.close(self.read_fd)
                return
            for signum in data:
                if signum not in (signal.SIGINT, signal.SIGTERM):
                    continue
                now = time.monotonic()
                if now - first.get(signum, -float("inf")) < self.same_request_s:
                    continue
                first.setdefault(signum, now)
                seen += 1
                name = signal.Signals(signum).name
                if seen == 1:
                    print(f"spinformer: {name} received: stopping after the step in flight "
                          "(the first step may still be compiling) and writing a checkpoint; "
                          "send it again to stop at once.", file=sys.stderr, flush=True)
                else:
                    print(f"spinformer: {name} again: stopping now (checkpoints already on "
                          "disk are intact).", file=sys.stderr, flush=True)
                    os._exit(128 + signum)

    def __exit__(self, *exc):
        import os

        if self.old_fd is not None:
            from .train import StopSignals

            StopSignals.second_signal_exits_elsewhere = self.exits_before
            signal.set_wakeup_fd(self.old_fd)
            os.close(self.write_fd)  # the thread's read returns empty and it ends
        return False


def _cmd_run(args) -> int:
    from .config import load_config
    from .train import TrainingInterrupted, initialize_distributed, is_writer, run
    from .train._loop import skipped_steps_note
    from .train._plugins import import_run_modules

    path = find_config(args.config)
    out = pathlib.Path(args.out) if args.out else default_out_dir(path, args.resume)
    if args.resume:  # the modules the run was trained with (--import), before its config
        import_run_modules(out)
    cfg = load_config(path, overrides=args.set)
    # before any JAX computation; a no-op unless several processes are asked for
    initialize_distributed(args.coordinator, args.num_processes, args.process_id)
    notes = []
    if args.resume:
        saved = out / "config.yaml"
        if not saved.exists():
            from .config import ConfigError

            raise ConfigError(f"--resume: {out} holds no run to resume (no config.yaml); "
                              f"drop --resume to start a new run there.")
        # the run goes on with the config it was started with; --set changes apply on top
        # (train.steps=N continues it to N steps); its faults are errors before any note
        cfg, notes = _resumed_config(path, saved, cfg, args.set, out)
    if is_writer():
        for note in notes:
            print(f"spinformer: note: {note}", file=sys.stderr)
        cache = getattr(args, "cache", None)
        print(f"spinformer: {path} -> {out}" + (
            f" (compiled programs kept in {cache}; SPINFORMER_COMPILATION_CACHE=off: not kept)"
            if cache else ""), file=sys.stderr)
    try:
        with _SignalEcho():
            summary = run(cfg, out, resume=args.resume,
                          progress=False if args.no_progress else None, imports=args.imports)
    except TrainingInterrupted as e:
        again = " ".join(["spinformer", "run", args.config, "--out", str(out), "--resume"])
        print(f"spinformer: stopped by {signal.Signals(e.signum).name} at step {e.step}: "
              f"checkpoint written to {e.checkpoint}. Continue with:\n  {again}",
              file=sys.stderr)
        return 128 + e.signum
    except FloatingPointError as e:
        print(f"spinformer: error: {e}", file=sys.stderr)
        return 1
    if summary.get("nothing_to_do"):
        print(f"spinformer: {out}: the run is finished ({summary['steps']} steps"
              f"{', stopped early' if summary.get('stopped_early') else ''}); nothing to do. "
              f"To continue it, resume with --set train.steps=<more than {summary['steps']}>.",
              file=sys.stderr)
    if is_writer():
        # the shape of summary.json: the final validation metrics under "metrics"
        print(json.dumps({"run_dir": str(out), "steps": summary["steps"],
                          "bad_steps": summary.get("bad_steps", 0),
                          "metrics": summary["metrics"]}, indent=2))
        if summary.get("bad_steps"):
            print(f"spinformer: warning: {skipped_steps_note(summary)}", file=sys.stderr)
    return 0


def _resumed_config(path, saved, cfg, overrides, out):
    """`(config, notes)`: the config a resumed run goes on with (the one saved in the run
    directory `out` with the `--set` changes on top, checked against the run there first:
    a `ConfigError` says what does not fit), and the notes to print: the keys at which the
    config file given on the command line differs from it (they are not used), and a run
    that wrote no checkpoint yet (it starts again from step 0)."""
    from .config import load_config
    from .train import list_checkpoints
    from .train._orbax import OrbaxCheckpoints
    from .train._rundir import changed_keys, check_run_dir

    resumed = load_config(saved, overrides=overrides)
    check_run_dir(out, resumed, resume=True, write=False)
    notes = []
    ignored = changed_keys(resumed, cfg)
    if ignored:
        notes.append(f"resuming with the config saved in {saved}; {path} differs at "
                     f"{', '.join(ignored[:5])}{' ...' if len(ignored) > 5 else ''} (not "
                     "used)")
    if not list_checkpoints(out) and not OrbaxCheckpoints(out).exists():
        notes.append(f"--resume: {out} holds no checkpoint yet (the run stopped before "
                     "writing one): starting from step 0")
    return resumed, notes


def find_grid(name: str) -> pathlib.Path:
    """A grid file path, or a shipped grid's name (`zoo/scaling`, or `scaling` for short)."""
    from .config import ConfigError

    try:
        return find_config(name)
    except ConfigError as e:
        try:
            return find_config(f"zoo/{name}")
        except ConfigError:
            raise e from None


def _cmd_grid(args) -> int:
    from . import grid as G
    from .train import TrainingInterrupted

    path = find_grid(args.grid)
    split = [[x.strip() for x in v.split(",") if x.strip()] if v else None
             for v in (args.tasks, args.families)]
    g = G.load_grid(path, tasks=split[0], families=split[1])
    name = g.get("experiment") or path.stem
    results = pathlib.Path(args.results or pathlib.Path("experiments", "results", name))
    runs = G.Runs(pathlib.Path(args.runs or pathlib.Path("runs", name)), results / "ledger")
    G.use_imports(g, runs, args.imports)
    if args.action == "plan":
        print("\n".join(G.plan(g, runs)))
    elif args.action == "price":
        G.price_grid(g, runs)
    elif args.action == "report":
        G.report(g, runs, results)
    elif args.engine == "submitit":
        from .grid._engine import run_submitit

        run_submitit(g, runs, retry_failed=args.retry_failed, imports=args.imports,
                     options=_engine_options(args.engine_option))
    else:
        if not args.worker:
            cache = getattr(args, "cache", None)
            print(f"spinformer: grid {path}: runs in {runs.root}, outcomes in {runs.ledger}"
                  + (f" (compiled programs kept in {cache})" if cache else ""),
                  file=sys.stderr)
        try:
            G.run_grid(g, runs, workers=args.workers, retry_failed=args.retry_failed,
                       worker=args.worker, imports=args.imports)
        except TrainingInterrupted as e:  # the run saved a checkpoint; a rerun resumes it
            print(f"spinformer: grid stopped by {signal.Signals(e.signum).name}; the run in "
                  "flight is checkpointed, and the same command continues the grid.",
                  file=sys.stderr)
            return 128 + e.signum
    if args.action == "all":
        G.report(g, runs, results)
    return 0


def _engine_options(pairs) -> dict:
    """`--engine-option KEY=VALUE` pairs as a dict, values read as YAML (numbers, booleans)."""
    from .config import ConfigError

    out = {}
    for pair in pairs:
        key, eq, value = pair.partition("=")
        if not eq or not key:
            raise ConfigError(f"--engine-option {pair!r}: expected KEY=VALUE, e.g. "
                              "slurm_partition=gpu or timeout_min=600.")
        out[key.strip()] = yaml.safe_load(value)
    return out


def _how_to_run(configs: pathlib.Path, group: str) -> str:
    """How the experiment script of a config folder takes its configs: `--config PATH` when
    the script has that option, else a pointer to its `--help` (it picks its configs by
    other options); the grids of `zoo/` by `spinformer grid`."""
    if group == "zoo":
        return f"grids: `spinformer grid plan|price|run|report {group}/NAME`"
    script = configs.resolve().parent / "experiments" / f"{group}.py"
    try:
        takes_config = '"--config"' in script.read_text()
    except OSError:
        return f"used by experiments/{group}.py"
    if takes_config:
        return (f"run with `python experiments/{group}.py all --config "
                f"{configs / group}/NAME.yaml`")
    return f"used by experiments/{group}.py; see `python experiments/{group}.py --help`"


def _cmd_list(args) -> int:
    rows = list_configs(pathlib.Path(args.dir) if args.dir else None)
    if not rows:
        d = pathlib.Path(args.dir) if args.dir else configs_dir()
        note = f"no configs found in {d}." if args.dir else _no_configs_note(d)
        print(f"spinformer: error: {note}", file=sys.stderr)
        return 2
    width = max(len(n) for n, _ in rows)
    for name, desc in rows:
        print(f"{name:<{width}}  {summary_line(desc)}")
    d = pathlib.Path(args.dir) if args.dir else configs_dir()
    exp = [(sub.name, list_configs(sub)) for sub in sorted(d.iterdir()) if sub.is_dir()]
    for group, cfgs in exp:
        if cfgs:
            print(f"\nexperiment configs in {d / group} ({_how_to_run(d, group)}):")
            for name, desc in cfgs:
                print(f"  {name:<{width}}  {summary_line(desc)}")
    print("\n`spinformer show NAME`: a config's whole description and every key it sets.")
    return 0


def _cmd_show(args) -> int:
    import textwrap

    from .config import describe, load_config

    path = find_config(args.config)
    cfg = load_config(path, overrides=args.set)
    print(f"# {path}")
    print(textwrap.fill(cfg.description, 92, initial_indent="# ", subsequent_indent="# "))
    print("\n".join(line for line in describe(cfg).splitlines()
                    if not line.startswith("description =")))
    return 0


def _cmd_report(args) -> int:
    from .train import report

    print(report(args.dirs, out_dir=args.out))
    target = args.out or (args.dirs[0] if len(args.dirs) == 1 else "report")
    print(f"spinformer: wrote {pathlib.Path(target) / 'report.md'} and the report_*.png "
          "figures there", file=sys.stderr)
    return 0


def _cmd_generate(args) -> int:
    import time

    from ._generate import generate_texts, load_language_model
    from .train._plugins import import_run_modules

    import_run_modules(args.run_dir)  # a run trained with --import: its attention's module
    loaded = load_language_model(args.run_dir)
    t0 = time.perf_counter()
    texts, info = generate_texts(args.run_dir, args.prompt, length=args.length,
                                 temperature=args.temperature, seed=args.seed,
                                 incremental=not args.no_cache,
                                 progress=sys.stderr.isatty(), loaded=loaded,
                                 decode_steps=args.decode_steps, samples=args.samples)
    elapsed = time.perf_counter() - t0
    for b, text in enumerate(texts):
        if args.samples is not None:
            print(f"--- sample {b + 1} of {len(texts)} ---")
        print(args.prompt + text)
    count = (f"{args.length} characters" if args.samples is None else
             f"{len(texts)} samples of {args.length} characters, generated together,")
    note = (f"spinformer: {count} in {elapsed:.1f} s "
            f"({'incremental' if not args.no_cache else 're-solving the context'})")
    if info["solver_failures"]:
        note += (f"; warning: {info['solver_failures']} fixed-point solves did not converge "
                 "(their outputs are the solver's best iterate, which missed the tolerance)")
    print(note, file=sys.stderr)
    return 0


def _cmd_diagnose(args) -> int:
    from .train import diagnose, diagnostics_table
    from .train._plugins import import_run_modules

    import_run_modules(args.run_dir)  # a run trained with --import: its attention's module
    try:
        summary = diagnose(args.run_dir, batches=args.batches, starts=args.starts,
                           seed=args.seed, out_dir=args.out, progress=True)
    except ValueError as e:
        print(f"spinformer: error: {e}", file=sys.stderr)
        return 2
    out = pathlib.Path(args.out) if args.out else pathlib.Path(args.run_dir)
    print(diagnostics_table(summary))
    print(f"spinformer: {summary['examples']} validation examples -> "
          f"{out / 'diagnostics.json'}, {out / 'diagnostics.png'}", file=sys.stderr)
    return 0


def _fashion_mnist_status() -> tuple[bool, str]:
    from .data import FASHION_MNIST_DIR, ImageDataError, find_mnist_files

    try:
        find_mnist_files(None)
        return True, f"installed in {FASHION_MNIST_DIR}"
    except ImageDataError:
        return False, (f"not installed: `apt-get install dataset-fashion-mnist` (Debian/Ubuntu) "
                       f"puts it in {FASHION_MNIST_DIR}, or set data.path to any directory of "
                       "MNIST-format IDX files")


def _cmd_data(args) -> int:
    from .data import fetch
    from .data._text import FETCHABLE

    if args.action == "fetch":
        if args.name.replace("_", "-") == "fashion-mnist":  # a system package, not a download
            found, where = _fashion_mnist_status()
            print(f"fashion-mnist: {where}", file=sys.stdout if found else sys.stderr)
            return 0 if found else 2
        if args.name not in FETCHABLE:
            print(f"spinformer: error: unknown dataset {args.name!r}; fetchable: "
                  f"{', '.join(sorted(FETCHABLE))} (fashion-mnist comes from a system "
                  "package: `spinformer data list`).", file=sys.stderr)
            return 2
        path = fetch(args.name, force=args.force)
        print(f"{args.name}: {path} ({path.stat().st_size / 1e6:.1f} MB)")
        return 0
    for name, desc in FETCHABLE.items():
        print(f"{name}  {desc}")
    print(f"fashion-mnist  Fashion-MNIST images (data.task: fashion_mnist), "
          f"{_fashion_mnist_status()[1]}")
    import importlib.util

    have = importlib.util.find_spec("sklearn") is not None
    print("digits  scikit-learn's 8x8 digits (data.task: digits), inside the scikit-learn "
          "package: " + ("installed" if have else "not installed: `pip install scikit-learn` "
                         "(or an extra that has it: `pip install -e \".[notebooks]\"` or "
                         "`\".[dev]\"`)"))
    return 0


def _import_option(parser) -> None:
    parser.add_argument("--import", dest="imports", action="append", default=[],
                        metavar="MODULE", help="import a module (a dotted name, or a .py file) "
                        "first, e.g. one that registers your own attention with "
                        "nn.register_attention; may be repeated")


def import_user_modules(names: Sequence[str]) -> None:
    """Import each `--import` module before configs are read, so that what it registers
    (an attention, an option) is a valid config value: a path to a `.py` file, or a dotted
    module name (found on `sys.path`, with the current directory first). A module that
    cannot be imported is a `ConfigError` naming it and the error. `spinformer run` records
    them in the run directory (`imports.json`), and the commands that read a run's config
    again (`diagnose`, `generate`, `run --resume`) import them by themselves."""
    if names:
        from .train._plugins import import_modules

        import_modules(names)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="spinformer", description="Train and inspect spin-transformer experiments."
    )
    from . import __version__

    p.add_argument("--version", action="version", version=f"spinformer {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    r = sub.add_parser("run", help="train the experiment described by a YAML config")
    r.add_argument("config", help="a YAML file, or the name of a shipped config (see `list`)")
    r.add_argument("--out", help="run directory (default: runs/<config name>[-N])")
    _import_option(r)
    r.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value, e.g. --set train.steps=200 (repeatable)")
    r.add_argument("--resume", action="store_true",
                   help="continue from the newest intact checkpoint in the run directory")
    r.add_argument("--no-progress", action="store_true",
                   help="no progress output on stderr (a bar on a terminal, otherwise a line "
                   "every 30 s)")
    r.add_argument("--coordinator", metavar="HOST:PORT",
                   help="several processes: the address of process 0 (jax.distributed; or "
                   "SPINFORMER_COORDINATOR)")
    r.add_argument("--num-processes", type=int, metavar="N",
                   help="several processes: how many (or SPINFORMER_NUM_PROCESSES)")
    r.add_argument("--process-id", type=int, metavar="I",
                   help="several processes: this one's index, 0 writes the run directory (or "
                   "SPINFORMER_PROCESS_ID)")
    r.set_defaults(fn=_cmd_run)

    ls = sub.add_parser("list", help="the shipped configs, one line each")
    ls.add_argument("--dir", help="a folder of configs (default: ./configs)")
    ls.set_defaults(fn=_cmd_list)

    sh = sub.add_parser("show", help="a config's whole description and every key it sets, "
                        "with its value and meaning")
    sh.add_argument("config", help="a YAML file, or the name of a shipped config (see `list`)")
    _import_option(sh)
    sh.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a config value first, as for `run` (repeatable)")
    sh.set_defaults(fn=_cmd_show)

    rep = sub.add_parser("report", help="table and figures of one or several runs")
    rep.add_argument("dirs", nargs="+", help="run directories")
    rep.add_argument("--out", help="where to write the figures (default: the run directory, "
                     "or ./report for several)")
    rep.set_defaults(fn=_cmd_report)

    g = sub.add_parser("generate", help="sample text from a trained character-level run")
    _import_option(g)
    g.add_argument("run_dir", help="the run directory (runs/<config name>[-N])")
    g.add_argument("--prompt", required=True, help="the text to continue (characters of the "
                   "training text)")
    g.add_argument("--length", type=int, default=200, help="characters to generate (200)")
    g.add_argument("--temperature", type=float, default=0.8,
                   help="sampling temperature; 0 is greedy (0.8)")
    g.add_argument("--seed", type=int, default=0, help="sampling seed: the same seed gives "
                   "the same text (0)")
    g.add_argument("--samples", type=int, default=None, metavar="N",
                   help="generate N continuations together as one batch (sample b uses "
                   "split(key(seed), N)[b]; on a GPU about as fast per character as one)")
    g.add_argument("--no-cache", action="store_true",
                   help="re-solve the whole context for every character instead of decoding "
                   "incrementally (slower; the reference)")
    g.add_argument("--decode-steps", type=int, default=None, metavar="K",
                   help="solve each position with K unrolled Picard steps instead of the "
                   "layers' own solver (no while loop: faster on a GPU; solves that miss the "
                   "tolerance are counted and reported)")
    g.set_defaults(fn=_cmd_generate)

    gr = sub.add_parser("grid", help="a grid of runs against softmax at equal steps or equal "
                        "compute: plan, price, run, report")
    gr.add_argument("action", choices=("plan", "price", "run", "report", "all"),
                    help="plan: the cells and what is done; price: each cell's steps and time "
                    "per step; run: train what is unfinished; report: tables and figures from "
                    "the ledger; all: run, then report")
    gr.add_argument("grid", help="a grid file, or a shipped grid's name (zoo/full, zoo/quick, "
                    "zoo/scaling, zoo/headline, zoo/adjoints, zoo/adjoints_tasks; `spinformer "
                    "list` shows them)")
    _import_option(gr)
    gr.add_argument("--runs", help="the run directories (default: runs/<experiment>; local to "
                    "the machine that trains them)")
    gr.add_argument("--results", help="the report and the ledger (<results>/ledger, the one "
                    "record of the grid; default: experiments/results/<experiment>)")
    gr.add_argument("--tasks", help="comma-separated tasks (default: all)")
    gr.add_argument("--families", help="comma-separated families (default: all; softmax, "
                    "the reference, is always added)")
    gr.add_argument("--workers", type=int, default=1,
                    help="run: worker processes sharing the runs directory, one core each (1)")
    gr.add_argument("--retry-failed", action="store_true",
                    help="run: train the runs recorded as failed again")
    gr.add_argument("--engine", choices=("local", "submitit"), default="local",
                    help="run: local worker processes, or one job per run through submitit "
                    "(SLURM, or its local executor; `pip install submitit`)")
    gr.add_argument("--engine-option", action="append", default=[], metavar="KEY=VALUE",
                    help="run with --engine submitit: a parameter of its executor, e.g. "
                    "cluster=local, slurm_partition=gpu, timeout_min=600 (repeatable)")
    gr.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # --workers' own
    gr.set_defaults(fn=_cmd_grid)

    dg = sub.add_parser("diagnose", help="fixed-point diagnostics of a trained run, per layer")
    _import_option(dg)
    dg.add_argument("run_dir", help="the run directory (runs/<config name>[-N])")
    dg.add_argument("--batches", type=int, default=1,
                    help="validation batches to analyse, every example of each (1)")
    dg.add_argument("--starts", type=int, default=8,
                    help="random starts per fixed point, besides the default one (8; 0 "
                    "analyses the default start alone, several times quicker)")
    dg.add_argument("--seed", type=int, default=0, help="seed of the random starts (0)")
    dg.add_argument("--out", help="where to write diagnostics.json and diagnostics.png "
                    "(default: the run directory)")
    dg.set_defaults(fn=_cmd_diagnose)

    d = sub.add_parser("data", help="datasets: `data fetch NAME`, `data list`")
    dsub = d.add_subparsers(dest="action", required=True)
    f = dsub.add_parser("fetch", help="download a dataset into the cache")
    f.add_argument("name", help="dataset name, e.g. shakespeare")
    f.add_argument("--force", action="store_true", help="download again even if cached")
    dsub.add_parser("list", help="datasets that can be fetched")
    d.set_defaults(fn=_cmd_data)
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the `spinformer` console script.

    Called from the command line (`argv` None), it first restarts the process once with
    glibc's malloc set to back large buffers with transparent huge pages where the system
    supports it (`spinformer._toolchain.hugepage_environment`: fewer page faults for large
    activations); `SPINFORMER_HUGEPAGES=0` turns that off."""
    try:  # everything that imports JAX is inside: a Ctrl-C then is one line
        if argv is None:  # `python -m spinformer` runs the package, not this file's path
            from ._toolchain import restart_with_hugepages

            restart_with_hugepages([sys.executable, "-m", "spinformer", *sys.argv[1:]])
        args = build_parser().parse_args(argv)
        if args.fn in (_cmd_run, _cmd_generate, _cmd_diagnose, _cmd_grid):  # worth keeping
            from ._toolchain import use_compilation_cache

            args.cache = use_compilation_cache()
        try:
            import_user_modules(getattr(args, "imports", []))
            return args.fn(args)
        except Exception as e:  # the faults a user can fix are one line
            if not _user_fault(e):
                raise
            print(f"spinformer: error: {e}{_import_hint(e)}", file=sys.stderr)
            return 2
    except KeyboardInterrupt:  # while starting (imports), setting up, or a second Ctrl-C
        print("spinformer: interrupted (checkpoints already on disk are intact)",
              file=sys.stderr)
        return 130
    except BrokenPipeError:  # `spinformer list | head`: the reader is gone, no traceback
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


def _user_fault(e: Exception) -> bool:
    """A config fault, a missing file, or a checkpoint that cannot be read: said in one line
    (the classes are imported only once something failed: `spinformer list` stays free of
    JAX)."""
    if isinstance(e, FileNotFoundError):
        return True
    from .config import ConfigError
    from .train import CorruptCheckpoint

    return isinstance(e, (ConfigError, CorruptCheckpoint))


def _import_hint(e: Exception) -> str:
    """For an attention name the registry does not know: how to register one's own."""
    msg = str(e)
    if msg.startswith(("model.attention:", "model.attention.name:")) and "is not one of" in msg:
        return (" If it is your own attention, import the module that registers it: "
                "`spinformer run CONFIG --import my_attention.py` (or a dotted module name).")
    return ""


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
