"""The fault-injection suite of spinformer: every test here injects one fault and checks that
it gives a clear error (naming the directory, file, line or config key, and the fix) before
any training time is lost, and that nothing already written is lost.

Sections (each opens with its own helpers; the helpers shared by all come first):

1. Run directories: a file, unwritable, a full disk (before and during training), holding
   another run; what may change on --resume; the command line's one-line errors.
2. Configs, fuzzed with hypothesis from the schema: each either trains one step or is a
   `ConfigError` naming the key.
3. Corrupt data files: text (chars), JSON lines (snli), IDX (fashion_mnist).
4. Corrupt checkpoints: skipped with a warning for the previous one.
5. Training faults: non-finite losses and gradients (skipped, counted, a stop after
   `train.max_bad_steps` in a row); SIGTERM and SIGINT mid-run (a checkpoint, a clean exit,
   a bit-identical `--resume`).

New kinds of fault get a section of their own, with its helpers at its top.
"""

from __future__ import annotations

import collections
import dataclasses
import errno
import gc
import gzip
import json
import math
import os
import pathlib
import re
import signal
import subprocess
import sys
import tempfile
import time
import typing
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from spinformer import cli, data, nn, train
from spinformer import config as C
from spinformer.train import _checkpoint, _experiment, _rundir

TEXT = "Now is the winter of our discontent\nMade glorious summer by this sun of York;\n" * 30


# ============================================================================ shared helpers


def tiny_cfg(changes: typing.Optional[dict] = None) -> C.Config:
    """A config that trains in seconds (softmax attention on bracket matching, width 16),
    with `changes` (dotted keys to values) applied."""
    base = {"model.attention": "softmax", "model.dim": 16, "model.ffn_hidden": 16,
            "data.seq_len": 8, "data.batch_size": 4, "data.eval_batches": 1,
            "train.steps": 2, "train.log_every": 1, "train.eval_every": 2,
            "train.warmup_steps": 0, "train.progress": False}
    if (changes or {}).get("data.task") in ("digits", "fashion_mnist"):
        del base["data.seq_len"]  # images have no sequence length to set
    return C.load_config(None, {**base, **(changes or {})})


def refused(fn, *fragments: str, error=C.ConfigError) -> str:
    """Call `fn()`, expect `error`, and check that its message is one line holding every
    fragment; returns the message."""
    with pytest.raises(error) as info:
        fn()
    msg = str(info.value)
    assert "\n" not in msg, msg
    for fragment in fragments:
        assert fragment in msg, f"{fragment!r} not in {msg!r}"
    return msg


def cli_error(capsys, args: list) -> str:
    """Run the command line, expect exit status 2 and exactly one line on stderr,
    `spinformer: error: ...` (no traceback); returns that line."""
    code = cli.main([str(a) for a in args])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, err
    assert lines and lines[-1].startswith("spinformer: error: "), err
    assert "Traceback" not in err
    # at most the "config -> out" line before the error
    assert len(lines) <= 2 and all(not line.startswith(" ") for line in lines), err
    return lines[-1]


def forbid_building(monkeypatch):
    """Make building the dataset fail the test: a fault found before it costs no time."""
    def building(*args, **kwargs):
        raise AssertionError("the run went on to build its dataset")

    monkeypatch.setattr(_experiment, "build_dataset", building)


def stub_fit(monkeypatch) -> list:
    """Replace training by a stub that records its keyword arguments (a list of dicts)."""
    calls = []

    def fit(model, dataset, options, **kwargs):
        calls.append(kwargs)
        return model, {"steps": 0, "metrics": {}}

    monkeypatch.setattr(_experiment, "fit", fit)
    return calls


def tree(directory: pathlib.Path) -> dict:
    """`{relative path: bytes}` of every file under `directory` (to check nothing changed)."""
    return {str(p.relative_to(directory)): p.read_bytes()
            for p in sorted(directory.rglob("*")) if p.is_file()}


# ============================================================== 1. run directories


def write_config_file(tmp_path, cfg: C.Config) -> pathlib.Path:
    path = tmp_path / "tiny.yaml"
    C.save_config(cfg, path)
    return path


def fail_with(err: int, *, create: bool = False):
    """A stand-in for the write probe that raises `OSError(err)` (after creating the file if
    `create`, as a write that runs out of room half way does)."""
    def probe(path):
        if create:
            pathlib.Path(path).write_bytes(b"partial")
        raise OSError(err, os.strerror(err), str(path))

    return probe


def test_run_dir_that_is_a_file_is_refused_before_building(tmp_path, monkeypatch):
    forbid_building(monkeypatch)
    cfg = tiny_cfg()
    f = tmp_path / "out"
    f.write_text("notes")
    refused(lambda: train.run(cfg, f), f"run directory {f} is a file", "--out")
    refused(lambda: train.run(cfg, f / "run"), f"{f / 'run'} lies under {f}, which is a file")
    refused(lambda: train.run(cfg, f, resume=True), "is a file")
    assert f.read_text() == "notes"


def test_read_only_run_dir_is_refused_before_building(tmp_path, monkeypatch):
    """A directory without write permission (0o555). Root writes into it all the same, so
    where the tests run as root (CI does) the kernel's answer to anyone else is simulated:
    creating or writing a file under it raises EACCES."""
    forbid_building(monkeypatch)
    d = tmp_path / "ro"
    d.mkdir()
    d.chmod(0o555)
    if os.geteuid() == 0:
        real_mkdir = pathlib.Path.mkdir

        def mkdir(self, *args, **kwargs):
            if d in self.parents:
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(self))
            return real_mkdir(self, *args, **kwargs)

        monkeypatch.setattr(pathlib.Path, "mkdir", mkdir)
        monkeypatch.setattr(_rundir, "_write_probe", fail_with(errno.EACCES))
    try:
        refused(lambda: train.run(tiny_cfg(), d), str(d), "permission denied", "--out")
        refused(lambda: train.run(tiny_cfg(), d / "run"), str(d / "run"), "cannot be created",
                "permission denied")
    finally:
        d.chmod(0o755)
    assert list(d.iterdir()) == []


@pytest.mark.parametrize("err,fragments", [
    (errno.EACCES, ["cannot take files", "not writable (permission denied)",
                    "make the directory writable"]),
    (errno.EROFS, ["cannot take files", "read-only file system"]),
    (errno.ENOSPC, ["cannot take files", "is full (no space left on device)",
                    "free some space"]),
    (errno.EIO, ["cannot take files", os.strerror(errno.EIO)]),
])
def test_unwritable_or_full_run_dir_is_refused_before_building(tmp_path, monkeypatch, err,
                                                                fragments):
    """The probe (a small file written, synced and removed) meets a permission error, a
    read-only file system, a full disk or an I/O error: simulated, as none can be made for
    real here (the tests may run as root, and a disk cannot be filled)."""
    forbid_building(monkeypatch)
    monkeypatch.setattr(_rundir, "_write_probe", fail_with(err, create=True))
    d = tmp_path / "run"
    refused(lambda: train.run(tiny_cfg(), d), f"run directory {d}", *fragments)
    assert not d.exists()  # the directory made for the run is removed again
    d.mkdir()
    refused(lambda: train.run(tiny_cfg(), d), f"run directory {d}", *fragments)
    assert list(d.iterdir()) == []  # the half-written probe is removed


def test_run_dir_that_cannot_be_created_is_refused(tmp_path, monkeypatch):
    forbid_building(monkeypatch)
    real_mkdir = pathlib.Path.mkdir
    parent = tmp_path / "locked"

    def mkdir(self, *args, **kwargs):  # an unwritable parent, simulated
        if parent in (self, *self.parents):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(self))
        return real_mkdir(self, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "mkdir", mkdir)
    d = parent / "run"
    refused(lambda: train.run(tiny_cfg(), d), f"run directory {d} cannot be created",
            "permission denied")


def test_full_disk_during_training_names_the_checkpoint(tmp_path, monkeypatch):
    """The disk fills up while the step-2 checkpoint is written: the run stops with the
    directory, the reason and the intact step-1 checkpoint named, and the partial file is
    removed. (That --resume then continues from the checkpoint is test_train.py's
    test_kill_and_resume_equals_uninterrupted.)"""
    cfg = tiny_cfg({"train.steps": 3, "train.checkpoint_every": 1, "train.eval_every": 3})
    out = tmp_path / "run"
    real_save = _checkpoint.save_checkpoint

    def save(directory, state, *args, **kwargs):
        if int(state.step) == 2:
            partial = pathlib.Path(directory) / "ckpt-00000002.ckpt.tmp"
            partial.write_bytes(_checkpoint.MAGIC + b"{")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_save(directory, state, *args, **kwargs)

    monkeypatch.setattr(_checkpoint, "save_checkpoint", save)
    msg = refused(lambda: train.run(cfg, out), f"writing to run directory {out} failed",
                  "is full", "ckpt-00000001.ckpt (step 1", "--resume",
                  error=train.RunDirError)
    assert "free some space" in msg
    assert not list(out.glob("*.tmp"))
    like = train.build_model(cfg, train.build_dataset(cfg), key=jax.random.key(0))
    like = train.RunState.init(like, train.build_optimizer(cfg))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # intact: read without a warning
        got, _ = train.load_latest(out, like)
    assert int(got.step) == 1 and C.load_config(out / "config.yaml") == cfg


RUNS = {  # what a directory holds -> what the refusal names
    "other config": ({"config.yaml": "other"}, "config.yaml (of another config)"),
    "metrics": ({"config.yaml": "same", "metrics.jsonl": '{"step": 1}\n'}, "metrics.jsonl"),
    "checkpoint": ({"ckpt-00000002.ckpt": "x"}, "1 checkpoint(s), the newest of step 2"),
    "summary": ({"summary.json": "{}"}, "summary.json"),
    "unreadable config": ({"config.yaml": "model: [1, 2"}, "config.yaml (of another config)"),
}
FREE = {  # directories a fresh run may use: nothing of a run to overwrite
    "empty": {},
    "other files": {"train.log": "started\n", "sweep_config.yaml": "train: {steps: 3}\n"},
    "same config, no results": {"config.yaml": "same", "metrics.jsonl": ""},
}


def fill(d: pathlib.Path, files: dict, cfg: C.Config) -> pathlib.Path:
    d.mkdir(parents=True, exist_ok=True)
    for name, content in files.items():
        if name == "config.yaml" and content in ("same", "other"):
            C.save_config(cfg if content == "same" else cfg.replace({"train.lr": 0.5}), d / name)
        else:
            (d / name).write_text(content)
    return d


@pytest.mark.parametrize("name", RUNS)
def test_dir_holding_a_run_is_refused_unless_resume(tmp_path, monkeypatch, name):
    files, what = RUNS[name]
    cfg = tiny_cfg()
    d = fill(tmp_path / "run", files, cfg)
    before = tree(d)
    with monkeypatch.context() as m:
        forbid_building(m)
        refused(lambda: train.run(cfg, d), f"run directory {d} already holds a run", what,
                "overwrite", "--resume", "--out")
    assert tree(d) == before  # nothing overwritten
    if files.get("config.yaml") == "other":  # --resume: only with the same config
        refused(lambda: train.run(cfg, d, resume=True), "--resume", "train.lr")
    elif "config.yaml" not in files or files["config.yaml"] == "same":
        calls = stub_fit(monkeypatch)
        train.run(cfg, d, resume=True)
        assert calls and calls[0]["resume"] is True


@pytest.mark.parametrize("name", FREE)
def test_dir_without_a_run_is_used(tmp_path, monkeypatch, name):
    cfg = tiny_cfg()
    d = fill(tmp_path / "run", FREE[name], cfg)
    calls = stub_fit(monkeypatch)
    train.run(cfg, d)
    assert calls and calls[0]["resume"] is False and C.load_config(d / "config.yaml") == cfg
    assert not [p for p in d.iterdir() if p.name.startswith(".spinformer-write-test")]


def test_resume_may_change_the_mesh_and_nothing_else(tmp_path, monkeypatch):
    calls = stub_fit(monkeypatch)
    saved = tiny_cfg({"train.mesh": {"data": 1}, "train.checkpoint_every": 1})
    d = fill(tmp_path / "run", {"config.yaml": "same", "metrics.jsonl": "{}\n"}, saved)
    for mesh in (None, {"data": -1}, {"data": 1}):  # the whole section, or one of its keys
        train.run(saved.replace({"train.mesh": mesh}), d, resume=True)
    assert len(calls) == 3
    changed = saved.replace({"train.mesh": None, "train.lr": 0.5, "train.progress": True,
                             "description": "resumed elsewhere"})
    msg = refused(lambda: train.run(changed, d, resume=True), "differs", "at train.lr;")
    assert "mesh" not in msg and "progress" not in msg
    assert _rundir.resumable("train.mesh.data") and not _rundir.resumable("train.meshy")


def test_resume_refuses_a_change_in_the_attention_section(tmp_path, monkeypatch):
    """A run's config holds its own attention's section only; a change there is refused on
    resume, naming the key."""
    stub_fit(monkeypatch)
    own = tiny_cfg({"model.attention": "boltzmann", "model.attention.solver.name": "anderson"})
    d2 = fill(tmp_path / "run2", {"config.yaml": "same", "metrics.jsonl": "{}\n"}, own)
    refused(lambda: train.run(own.replace({"model.attention.solver.name": "picard"}), d2,
                              resume=True), "differs", "model.attention.solver.name")


def test_cli_reports_run_dir_faults_in_one_line(tmp_path, capsys, monkeypatch):
    forbid_building(monkeypatch)
    cfg = tiny_cfg()
    path = write_config_file(tmp_path, cfg)
    f = tmp_path / "file"
    f.write_text("x")
    line = cli_error(capsys, ["run", path, "--out", f, "--no-progress"])
    assert f"{f} is a file" in line
    d = fill(tmp_path / "old", {"config.yaml": "same", "summary.json": "{}"}, cfg)
    line = cli_error(capsys, ["run", path, "--out", d, "--no-progress"])
    assert "already holds a run" in line and "--resume" in line and "--out" in line
    monkeypatch.setattr(_rundir, "_write_probe", fail_with(errno.ENOSPC))
    line = cli_error(capsys, ["run", path, "--out", tmp_path / "new", "--no-progress"])
    assert f"the disk holding {tmp_path / 'new'} is full" in line


# ==================================================== 2. configs fuzzed from the schema

FUZZ_TASKS = ("brackets", "chars", "nli", "digits")  # nothing to download
ATTENTIONS = C.keys(C.ModelConfig)["attention"].choices


@dataclasses.dataclass(frozen=True)
class Leaf:
    """A config value in the schema: its dotted key, its type (Optional unwrapped), whether
    null is allowed, and its allowed values if it is an enumeration."""

    key: str
    type: type
    optional: bool
    choices: typing.Optional[tuple]
    kind: typing.Optional[str] = None  # an object named by a registered name


def schema(cls=None, prefix: str = "", kind=None) -> tuple[list, list]:
    """`(leaves, sections)` of the config schema, walked from its dataclasses and from the
    default objects (solvers, adjoints, ...) in it."""
    cls = C.Config if cls is None else cls
    leaves, sections = [], []
    for k in C.keys(cls, kind).values():
        tp = k.type
        if k.is_section and k.schema() is not None:
            sections.append(prefix + k.name)
            sub_leaves, sub_sections = schema(k.schema(), prefix + k.name + ".", k.kind)
            leaves += sub_leaves
            sections += sub_sections
            continue
        args = typing.get_args(tp)
        optional = type(None) in args
        inner = next(a for a in args if a is not type(None)) if optional else tp
        leaves.append(Leaf(prefix + k.name, inner, optional, k.choices, k.kind))
    return leaves, sections


def reads(raw: dict, key: str) -> bool:
    """Whether a config of `raw`'s task reads `key` (a key that only other tasks read may
    not be changed: `option(..., tasks=...)`)."""
    section, _, name = key.partition(".")
    cls = {"data": C.DataConfig, "model": C.ModelConfig}.get(section)
    fields = {f.name: f for f in dataclasses.fields(cls)} if cls else {}
    field = fields.get(name.split(".")[0])
    data = raw.get("data")
    task = data.get("task", "brackets") if isinstance(data, dict) else "brackets"
    return field is None or task in field.metadata.get("tasks", (task,))


def set_key(raw: dict, key: str, value) -> None:
    """Set a dotted key in a nested dict, making (or replacing) sections on the way."""
    *path, last = key.split(".")
    node = raw
    for part in path:
        if not isinstance(node.get(part), dict):
            node[part] = {}
        node = node[part]
    node[last] = value


def keys_of(raw: dict, prefix: str = "") -> list:
    """The dotted keys of the values set in a nested config dict."""
    out = []
    for k, v in raw.items():
        if isinstance(v, dict) and k != "mesh":
            out += keys_of(v, prefix + k + ".")
        else:
            out.append(prefix + k)
    return out


@dataclasses.dataclass
class Fuzzed:
    """One fuzzed config: `raw` (a nested dict), the keys of its base config (`base`) and
    those changed from it (`changed`); for a config with one wrong value, the key that holds
    it (`wrong`), and whether it must be refused (`must_fail`; False for values that are
    merely odd, e.g. a learning rate of 1e308)."""

    raw: dict
    base: tuple
    changed: tuple
    wrong: typing.Optional[str] = None
    must_fail: bool = False


@st.composite
def base_configs(draw, attentions, text_path):
    """A tiny config that trains: depth 1, width 8 or 16, batch 2, one step, a task that
    needs no download (chars reads `text_path`)."""
    attention = draw(st.sampled_from(attentions))
    causal_ok = attention != "free_energy"  # symmetric couplings: classifiers only
    task = draw(st.sampled_from(FUZZ_TASKS if causal_ok else ("nli", "digits")))
    raw = {
        "data": {"task": task, "batch_size": 2, "eval_batches": 1},
        "model": {"attention": attention, "dim": draw(st.sampled_from([8, 16])),
                  "num_heads": draw(st.sampled_from([1, 2])), "depth": 1,
                  "ffn_hidden": draw(st.sampled_from([0, 8]))},
        "train": {"steps": 1, "log_every": 1, "eval_every": 1, "warmup_steps": 0,
                  "progress": False},
    }
    sections = {  # every solver and sampler small
        "spin": {"solver": {"max_steps": 4}},
        "boltzmann": {"solver": {"max_steps": 4},
                      "inference": draw(st.sampled_from(["exact", "mean_field"]))},
        "neurogame": {"train_samples": 2, "eval_samples": 2, "solver": {"max_steps": 4},
                      "estimator": draw(st.sampled_from(["mc", "exact"]))},
        "implicit": {"solver": {"max_steps": 4}},
        "free_energy": {"solver": {"max_steps": 4}},
    }
    if attention in sections:
        raw["model"]["attention"] = {"name": attention, **sections[attention]}
    if task == "chars":
        raw["data"]["path"] = str(text_path)
    if task == "digits":
        raw["model"].update(embed="patch", patch=4, conv_channels=4)
    if task in ("brackets", "chars"):
        raw["data"]["seq_len"] = draw(st.integers(4, 8))
    if task == "nli":  # pairs without word order fit in 13 tokens
        raw["data"].update(seq_len=13, phenomena="negation,lexical")
    return raw


def plausible_values(leaf: Leaf, text_path):
    """Values of the right type and a small size (a combination may still be refused)."""
    special = {
        "data.task": st.sampled_from(FUZZ_TASKS),
        "data.path": st.just(str(text_path)),
        "data.phenomena": st.lists(st.sampled_from(["negation", "quantifier", "order",
                                                    "lexical"]),
                                   min_size=1, max_size=4, unique=True).map(",".join),
        "train.mesh": st.sampled_from([None, {"data": 1}, {"data": -1}]),
    }
    if leaf.key in special:
        return special[leaf.key]
    if leaf.choices is not None:
        values = st.sampled_from(leaf.choices)
    elif leaf.type is bool:
        values = st.booleans()
    elif leaf.type is int:
        values = st.integers(0, 6)
    elif leaf.type is float:
        values = st.sampled_from([0.0, 1e-3, 0.1, 0.5, 1.0, 2.0]) | st.floats(0.0, 1.0)
    else:
        values = st.text(max_size=8)
    return (values | st.none()) if leaf.optional else values


def wrong_values(leaf: Leaf) -> list:
    """`(value, must_fail)` pairs for a leaf: wrong types, negative and huge numbers, strings
    for numbers, null where it is not allowed, lists and mappings (empty ones too), values
    outside the choices. `must_fail` is False for values that are odd but usable (huge or
    negative floats: a learning rate of 1e308 trains, badly)."""
    if leaf.kind:  # an object: a name or a mapping of its name and fields
        return [([1, 2], True), ({"a": 1}, True), (3, True), ("xx", True), (None, True)]
    out = [([1, 2], True), ({"a": 1}, True), ({}, True)]
    if not leaf.optional:
        out.append((None, True))
    if leaf.type is int:
        out += [("x", True), ("12", True), (1.5, True), (True, True), (-1, True),
                (-(10**6), True), (2**31, True), (10**40, True), (1e300, True),
                (math.nan, True), (math.inf, True)]
    elif leaf.type is float:
        out += [("x", True), ("", True), (True, True), (math.nan, True), (math.inf, True),
                (-math.inf, True), (10**400, True), (1e308, False), (-1e308, False),
                (-1.0, False)]
    elif leaf.type is bool:
        out += [("yes", True), ("true", True), (1, True), (0, True), (0.5, True)]
    elif leaf.type is str:
        out += [(1, True), (2.5, True), (False, True)]
        if leaf.choices:
            c = next(x for x in leaf.choices if x is not None)  # (None is a choice of some)
            out += [("xx", True), (c[:-1], c[:-1] not in leaf.choices),
                    (c.upper(), c.upper() not in leaf.choices), (c + " ", True)]
    elif leaf.type is dict:
        out += [("data", True), (4, True), ({"data": 0}, True), ({"data": "x"}, True),
                ({"bogus": 1}, True), ({"data": -2}, True), ({"data": True}, True),
                ({1: 2}, True), ({"data": 1.5}, True), ({"data": -1, "model": -1}, True)]
    return out


@st.composite
def misspellings(draw, name: str):
    """`name` with one letter dropped, doubled, swapped with the next, or upper-cased."""
    i = draw(st.integers(0, len(name) - 1))
    how = draw(st.sampled_from(["drop", "double", "swap", "upper"]))
    if how == "drop" and len(name) > 1:
        return name[:i] + name[i + 1:]
    if how == "swap" and i + 1 < len(name) and name[i] != name[i + 1]:
        return name[:i] + name[i + 1] + name[i] + name[i + 2:]
    if how == "upper" and name[i].isalpha():
        return name[:i] + name[i].upper() + name[i + 1:]
    return name[:i] + name[i] + name[i:]


@st.composite
def fuzzed_configs(draw, attentions, text_path, *, wrong_share=0.6, cheap=False):
    """A base config with up to three plausible changes, or (with probability about
    `wrong_share`, in tenths) one with one wrong value: at a key
    (`wrong_values`), in place of a whole section (a list, a number, a string), under an
    unknown key, or under a misspelled key. `cheap`: never change the attention nor empty
    the model section (the base's attention stays, so every run compiles quickly)."""
    leaves, sections = schema()
    raw = draw(base_configs(attentions, text_path))
    base = tuple(keys_of(raw))
    tenths = round(10 * wrong_share)
    # plausible first: hypothesis shrinks towards the first choice, so the derandomized
    # examples of every hypothesis version include plausible configs
    if not draw(st.sampled_from([False] * (10 - tenths) + [True] * tenths)):
        changed = []
        for _ in range(draw(st.integers(0, 3))):
            if draw(st.integers(0, 9)) == 0:  # a section empty or null: its defaults
                sec = draw(st.sampled_from(["data"] + [s for s in sections
                                                       if s.startswith("model.")]))
                if not (cheap and sec == "model.attention"):  # (its defaults: spin's)
                    keep_attention(raw, sec, cheap)
                    set_key(raw, sec, draw(st.sampled_from([{}, None])))
                    changed.append(sec)
                continue
            leaf = draw(st.sampled_from([lf for lf in leaves if reads(raw, lf.key)
                                         and not (cheap and lf.key == "model.attention")]))
            keep_attention(raw, leaf.key, cheap)
            set_key(raw, leaf.key, draw(plausible_values(leaf, text_path)))
            changed.append(leaf.key)
        return Fuzzed(raw, base, tuple(changed))
    kind = draw(st.sampled_from(["value", "value", "value", "section", "unknown",
                                 "misspelled"]))
    if kind == "value":
        leaf = draw(st.sampled_from(leaves))
        value, must_fail = draw(st.sampled_from(wrong_values(leaf)))
        set_key(raw, leaf.key, value)
        return Fuzzed(raw, base, (leaf.key,), leaf.key, must_fail)
    if kind == "section":
        sec = draw(st.sampled_from(sections))
        set_key(raw, sec, draw(st.sampled_from([[1, 2], 3, "x", True, 0.5])))
        return Fuzzed(raw, base, (sec,), sec, True)
    where = draw(st.sampled_from([""] + [s + "." for s in sections]))
    names = sorted({k[len(where):].split(".")[0] for k in [lf.key for lf in leaves] + sections
                    if k.startswith(where)})
    if kind == "unknown":
        bad = draw(st.sampled_from(["bogus", "learning_rate", "n_layers", "x"]))
    else:
        bad = draw(misspellings(draw(st.sampled_from(names))))
    if bad in names:
        bad += "_"
    set_key(raw, where + bad, draw(st.sampled_from([1, "a", None, 0.5])))
    return Fuzzed(raw, base, (where + bad,), where + bad, True)


def keep_attention(raw: dict, key: str, cheap: bool) -> None:
    """With `cheap`, before `key` (under `model.attention`) is set in `raw`: an attention
    given by its name becomes the section `{name: ...}`, so that it stays (`set_key` would
    put a section of `key` alone in its place: the default attention, spin, with its solves
    to compile)."""
    model = raw.get("model")
    name = model.get("attention") if isinstance(model, dict) else None
    if cheap and key.startswith("model.attention.") and isinstance(name, str):
        model["attention"] = {"name": name}


def names_key(message: str, key: str) -> bool:
    """Whether an error message names a dotted key: in full, or its last part as a word."""
    last = key.rsplit(".", 1)[-1]
    return key in message or re.search(rf"(?<![\w.]){re.escape(last)}(?!\w)", message) is not None


def try_config(example: Fuzzed) -> str:
    """Build the fuzzed config and train it one step: "ran", or "refused" for a
    `ConfigError` naming the wrong key (for plausible values: one of the config's keys).
    Anything else fails the test: another exception, a refusal that names no key, or a
    wrong value that trained."""
    try:
        cfg = C.from_dict(example.raw)
        with tempfile.TemporaryDirectory() as out:
            train.run(cfg, pathlib.Path(out) / "run")
    except C.ConfigError as e:
        msg = str(e)
        if example.wrong is not None:
            assert names_key(msg, example.wrong), f"{msg!r} does not name {example.wrong!r}"
        else:
            keys = example.changed + example.base
            assert any(names_key(msg, k) for k in keys), f"{msg!r} names none of {keys}"
        return "refused"
    assert not example.must_fail, f"the wrong value at {example.wrong} was accepted"
    return "ran"


def fuzz(name: str, text_path, *, max_examples: int, attentions, cheap: bool,
         wrong_share: float) -> collections.Counter:
    """Try `max_examples` fuzzed configs (deterministically), count and print the
    outcomes."""
    counts = collections.Counter()

    @settings(max_examples=max_examples, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                     HealthCheck.filter_too_much])
    @given(fuzzed_configs(tuple(attentions), text_path, wrong_share=wrong_share,
                          cheap=cheap))
    def check(example):
        outcome = try_config(example)
        counts["tried"] += 1
        counts[outcome] += 1
        counts[("wrong " if example.wrong else "plausible ") + outcome] += 1
        if outcome == "ran" and counts["ran"] % 10 == 0:
            # each compiled step keeps memory mappings: after a few hundred, LLVM fails
            # to allocate (see conftest.py)
            jax.clear_caches()
            gc.collect()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # e.g. solvers that did not converge in 4 steps
        check()
    print(f"\n{name}: {counts['tried']} fuzzed configs: {counts['ran']} trained a step, "
          f"{counts['refused']} refused with a ConfigError naming the key (with a wrong "
          f"value: {counts['wrong refused']} refused, {counts['wrong ran']} odd but usable "
          f"trained; plausible: {counts['plausible ran']} trained, "
          f"{counts['plausible refused']} refused)")
    return counts


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("text") / "text.txt"
    p.write_text(TEXT)
    return p


def test_fuzzed_configs_train_or_name_the_key(text_file):
    counts = fuzz("default", text_file, max_examples=18, attentions=("softmax",), cheap=True,
                  wrong_share=0.7)
    assert counts["tried"] == 18 and counts["ran"] >= 3 and counts["wrong refused"] >= 5


@pytest.mark.slow
def test_fuzzed_configs_every_attention(text_file):
    counts = fuzz("slow", text_file, max_examples=200, attentions=ATTENTIONS, cheap=False,
                  wrong_share=0.5)
    assert counts["tried"] == 200 and counts["ran"] >= 50


def test_schema_walk_sees_every_key():
    """The fuzzer's view of the schema matches `describe()` line for line."""
    leaves, sections = schema()
    described = [line.split(" ")[0].rstrip(":") for line in C.describe().splitlines()]
    assert sorted(described) == sorted([lf.key for lf in leaves] + sections)
    assert {"train.mesh", "model.attention.beta", "data.task"} <= {lf.key for lf in leaves}


@pytest.mark.parametrize("changes,fragments", [
    ({"train.seed": 2**32}, ["train.seed", "out of range"]),
    ({"data.seed": -1}, ["data.seed=-1 must be >= 0"]),
    ({"train.lr": math.nan}, ["train.lr", "finite"]),
    ({"train.lr": "inf"}, ["train.lr", "finite"]),
    ({"model.attention": "boltzmann", "model.attention.solver.tol": -math.inf},
     ["model.attention.solver.tol", "finite"]),
    ({"data.max_chars": 0}, ["data.max_chars=0 must be >= 1"]),
    ({"data.max_vocab": 4}, ["data.max_vocab=4 must be >= 5"]),
    ({"train.warmup_steps": -1}, ["train.warmup_steps=-1"]),
    ({"train.min_lr_ratio": 2.0}, ["train.min_lr_ratio=2.0 must be in [0, 1]"]),
    ({"train.coupling_lr": -0.1}, ["train.coupling_lr=-0.1"]),
    ({"model.ffn_hidden": -8}, ["model.ffn_hidden=-8"]),
    ({"model.attention.solver.max_steps": 0}, ["model.attention.solver.max_steps=0"]),
    ({"model.attention": "implicit", "model.attention.adjoint.rtol": 0.0},
     ["model.attention.adjoint.rtol", "0.0"]),
    ({"model.attention": "free_energy", "model.attention.beta": 0.0},
     ["model.attention.beta=0.0"]),
    ({"model.attention": "neurogame", "model.attention.eval_seed": -3},
     ["model.attention.eval_seed=-3"]),
])
def test_values_the_fuzzer_found_are_refused_by_name(changes, fragments):
    """Each of these once reached training (and crashed there, or ran with a silently
    truncated seed); now the config refuses them."""
    refused(lambda: C.load_config(None, changes), *fragments)


def test_models_the_config_cannot_build_are_named(tmp_path, monkeypatch):
    """Refusals that need the dataset (free-energy attention in a causal model, a patch that
    does not divide the image, an embedding too big for it) are `ConfigError`s naming the
    attention and task, before training starts."""
    calls = stub_fit(monkeypatch)
    base = {"model.dim": 8, "data.batch_size": 2}
    for changes, fragments in (
            ({"model.attention": "free_energy", "model.attention.solver.max_steps": 2},
             ["model.attention=free_energy with data.task=brackets", "causal=True"]),
            ({"data.task": "digits", "model.embed": "patch", "model.patch": 3},
             ["data.task=digits", "patch=3 must divide"]),
            ({"data.task": "digits", "model.embed": "conv"}, ["embed='conv'", "16×16"]),
            ({"data.task": "nli", "data.seq_len": 8}, ["data (task nli)", "seq_len"])):
        out = tmp_path / "run"
        refused(lambda: train.run(tiny_cfg({**base, **changes}), out), *fragments)
        assert not out.exists()  # the directory made for the run is gone again
    assert not calls


# ==================================================================== 3. corrupt data


def char_cfg(path, seq_len=8) -> C.Config:
    return tiny_cfg({"data.task": "chars", "data.path": str(path), "data.seq_len": seq_len})


TEXT_FAULTS = {  # file content -> what the error says
    "empty": (b"", ["the file is empty"]),
    "binary": (bytes(range(256)) * 8, ["not UTF-8 text", "byte 0x80 at offset 128 (line 2)",
                                       "binary data or another encoding"]),
    "latin-1": ("Ça coûte café\n".encode("latin-1") * 40, ["not UTF-8 text", "byte 0xc7 at "
                                                          "offset 0 (line 1)"]),
    "cut in a character": (("ça coûte\n" * 40 + "où").encode()[:-1],
                           ["ends inside a multi-byte character: truncated?"]),
    "NUL bytes": (b"abc\n" * 20 + b"\0\0\0" + b"def\n" * 20, ["NUL bytes", "character 80, "
                                                              "line 21"]),
    "too short": (b"To be, or not", ["13 characters are too few", "seq_len + 1 = 9"]),
}


@pytest.mark.parametrize("name", TEXT_FAULTS)
def test_corrupt_text_is_named(tmp_path, name):
    content, fragments = TEXT_FAULTS[name]
    p = tmp_path / "input.txt"
    p.write_bytes(content)
    refused(lambda: data.CharText.from_path(p, seq_len=8), str(p), *fragments,
            error=data.DataFileError)
    out = tmp_path / "run"
    refused(lambda: train.run(char_cfg(p), out), f"data.path: {p}", *fragments)
    assert not out.exists()


def test_text_path_that_is_a_directory(tmp_path, capsys):
    refused(lambda: data.CharText.from_path(tmp_path), str(tmp_path), "a directory",
            error=data.DataFileError)
    p = tmp_path / "text.txt"
    p.write_text("short")
    line = cli_error(capsys, ["run", write_config_file(tmp_path, char_cfg(p)), "--out",
                              tmp_path / "run", "--no-progress"])
    assert f"data.path: {p}: 5 characters are too few" in line


GOOD = [json.dumps({"sentence1": f"a man plays {w}", "sentence2": "a man plays",
                    "gold_label": label})
        for w, label in zip("abcdefgh", ["entailment", "neutral", "contradiction"] * 3)]
JSONL_FAULTS = {  # file content -> what the error says
    "truncated last line": ("\n".join(GOOD) + "\n" + GOOD[0][:25],
                            ["line 9: not valid JSON", "looks truncated"]),
    "not JSON": ("\n".join(GOOD[:3] + ["sentence1=a man", *GOOD[3:]]) + "\n",
                 ["line 4: not valid JSON", "sentence1=a man"]),
    "missing keys": ("\n".join(GOOD[:2] + [json.dumps({"sentence1": "x", "label": "neutral"})]
                               + GOOD[2:]) + "\n",
                     ["line 3: missing field(s) ['sentence2', 'gold_label']"]),
    "wrong label": ("\n".join(GOOD + [json.dumps({"sentence1": "a", "sentence2": "b",
                                                  "gold_label": "Entailment"})]) + "\n",
                    ["line 9: unknown gold_label 'Entailment'"]),
    "label not a string": ("\n".join([json.dumps({"sentence1": "a", "sentence2": "b",
                                                  "gold_label": 0})] + GOOD) + "\n",
                           ["line 1: field(s) ['gold_label'] must be strings"]),
    "not UTF-8": ("\n".join(GOOD[:5]) + "\n" + '{"sentence1": "caf\xe9"}\n',
                  ["line 6: not UTF-8 text (byte 0xe9"]),
    "empty": ("", ["the file is empty"]),
    "only '-' labels": ("\n".join(json.dumps({"sentence1": "a", "sentence2": "b",
                                              "gold_label": "-"}) for _ in range(4)),
                        ["holds 0 labelled pairs"]),
}


def snli_cfg(path) -> C.Config:
    return tiny_cfg({"data.task": "snli", "data.path": str(path), "data.seq_len": 12})


@pytest.mark.parametrize("name", JSONL_FAULTS)
def test_corrupt_json_lines_are_named_with_the_line(tmp_path, name):
    content, fragments = JSONL_FAULTS[name]
    p = tmp_path / "train.jsonl"
    p.write_bytes(content.encode("latin-1" if name == "not UTF-8" else "utf-8"))
    refused(lambda: data.NLIFile.from_path(p), str(p), *fragments, error=data.DataFileError)
    refused(lambda: train.run(snli_cfg(p), tmp_path / "run"), f"data.path: {p}", *fragments)


def test_corrupt_json_lines_in_a_directory(tmp_path, capsys):
    d = tmp_path / "nli"
    d.mkdir()
    (d / "my_train.jsonl").write_text("\n".join(GOOD) + "\n")
    (d / "my_dev.jsonl").write_text("")
    refused(lambda: data.NLIFile.from_path(d), str(d / "my_dev.jsonl"),
            "the val split has no labelled pairs (the file is empty)", error=data.DataFileError)
    (d / "my_dev.jsonl").write_text(GOOD[0] + "\n" + "[1, 2]\n")
    line = cli_error(capsys, ["run", write_config_file(tmp_path, snli_cfg(d)), "--out",
                              tmp_path / "run", "--no-progress"])
    assert f"{d / 'my_dev.jsonl'}, line 2: expected a JSON object" in line


IDX_NAMES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte",
             "t10k-labels-idx1-ubyte")


def mnist_dir(d: pathlib.Path) -> pathlib.Path:
    """Four small MNIST-format files (12 training and 4 test images of 8×8)."""
    rng = np.random.default_rng(0)
    d.mkdir(parents=True, exist_ok=True)
    for name, n in zip(IDX_NAMES, (12, 12, 4, 4)):
        shape = (n,) if "labels" in name else (n, 8, 8)
        data.write_idx(d / name, rng.integers(0, 10 if "labels" in name else 256, shape,
                                              dtype=np.uint8))
    return d


IDX_FAULTS = {  # (file, how it is damaged) -> what the error says
    "truncated": (IDX_NAMES[0], lambda b: b[:-100], ["header says 12×8×8 uint8 = 768 bytes",
                                                     "the file has 668 (truncated?"]),
    "wrong magic": (IDX_NAMES[1], lambda b: b"\x08\x01" + b[2:],
                    ["magic number 0x0801", "is not an IDX header"]),
    "garbage": (IDX_NAMES[2], lambda b: bytes(np.random.default_rng(1).integers(
        0, 256, len(b), dtype=np.uint8)), ["is not an IDX header"]),
    "corrupt gzip": (IDX_NAMES[3] + ".gz", lambda b: gzip.compress(b)[:-6],
                     ["not a valid gzip file"]),
    "empty": (IDX_NAMES[0], lambda b: b"", ["0 bytes, too short for an IDX header"]),
}


@pytest.mark.parametrize("name", IDX_FAULTS)
def test_corrupt_idx_files_are_named(tmp_path, name):
    """Through the run (the reader's own cases are in test_image_data.py,
    test_read_idx_errors: truncated, oversized, wrong magic, gzip damage, huge headers)."""
    target, damage, fragments = IDX_FAULTS[name]
    d = mnist_dir(tmp_path / "mnist")
    plain = d / target.removesuffix(".gz")
    (d / target).write_bytes(damage(plain.read_bytes()))
    if target.endswith(".gz"):
        plain.unlink()
    cfg = tiny_cfg({"data.task": "fashion_mnist", "data.path": str(d), "data.val_size": 2,
                    "model.embed": "patch", "model.patch": 4})
    refused(lambda: train.run(cfg, tmp_path / "run"), f"data.path: {d / target}", *fragments)


def test_idx_path_that_cannot_be_read(tmp_path):
    d = mnist_dir(tmp_path / "mnist")
    refused(lambda: data.read_idx(d), str(d), "not a file", error=data.ImageDataError)
    assert issubclass(data.ImageDataError, data.DataFileError)


# ============================================================== 4. corrupt checkpoints


def saved_checkpoints(directory, steps=(2, 4, 6)):
    """Checkpoints of a small attention module at `steps` (weights shifted by the step);
    returns `like`, the `RunState` to read them into."""
    model = nn.SoftmaxAttention(8, 2, key=jax.random.key(0))
    like = train.RunState.init(model, train.make_optimizer(steps=10, lr=1e-3))
    for step in steps:
        bumped = jax.tree.map(lambda x: x + step if eqx.is_inexact_array(x) else x, model)
        train.save_checkpoint(directory, train.RunState(bumped, like.opt_state, step=step),
                              {"data_position": step}, keep=5)
    return like


def _flip_last_byte(p):
    raw = bytearray(p.read_bytes())
    raw[-5] ^= 0xFF
    p.write_bytes(bytes(raw))


def _other_structure(p):
    model = nn.SoftmaxAttention(16, 2, key=jax.random.key(1))  # another width
    state = train.RunState.init(model, train.make_optimizer(steps=10, lr=1e-3))
    p.unlink()
    train.save_checkpoint(p.parent, train.RunState(model, state.opt_state, step=6),
                          {"data_position": 6}, keep=5)


def _directory(p):
    p.unlink()
    p.mkdir()


CHECKPOINT_FAULTS = {  # how the newest checkpoint is damaged -> what the warning says
    "truncated": (lambda p: p.write_bytes(p.read_bytes()[:-10]), "truncated"),
    "flipped byte": (_flip_last_byte, "checksum mismatch"),
    "wrong magic": (lambda p: p.write_bytes(b"NOT-A-CKPT" + p.read_bytes()[10:]), "bad magic"),
    "wrong structure": (_other_structure, "does not fit this model"),
    "header cut": (lambda p: p.write_bytes(_checkpoint.MAGIC + b'{"step": 6'),
                   "truncated header"),
    "a directory": (_directory, "skipping checkpoint"),
}


@pytest.mark.parametrize("name", CHECKPOINT_FAULTS)
def test_corrupt_checkpoint_is_skipped_for_the_previous(tmp_path, name):
    """Also in test_train.py: truncated and flipped-byte checkpoints during a real run
    (test_checkpoints_atomic_keep_and_corrupt) and resume after a kill
    (test_kill_and_resume_equals_uninterrupted)."""
    like = saved_checkpoints(tmp_path)
    damage, fragment = CHECKPOINT_FAULTS[name]
    newest = _checkpoint.checkpoint_path(tmp_path, 6)
    damage(newest)
    with pytest.warns(UserWarning, match=re.escape(fragment)) as caught:
        got, meta = train.load_latest(tmp_path, like)
    assert int(got.step) == 4 and meta["data_position"] == 4
    np.testing.assert_allclose(got.model.to_q.weight, like.model.to_q.weight + 4)
    assert any(str(newest) in str(w.message) for w in caught)


def test_every_checkpoint_corrupt_is_an_error_not_a_fresh_start(tmp_path):
    """Checkpoints that are all damaged are not "no checkpoint": a resume would start again
    from step 0 and rewrite the run's metrics. `load_latest` raises, naming the newest one's
    fault and how many it tried; an empty directory is still None."""
    like = saved_checkpoints(tmp_path, steps=(2, 4))
    for _, p in train.list_checkpoints(tmp_path):
        p.write_bytes(p.read_bytes()[:-1])
    newest = _checkpoint.checkpoint_path(tmp_path, 4)
    with pytest.raises(train.CorruptCheckpoint, match=r"\(2 tried\)") as e:
        train.load_latest(tmp_path, like)
    assert f"{newest}: truncated" in str(e.value)
    (tmp_path / "empty").mkdir()
    assert train.load_latest(tmp_path / "empty", like) is None


def test_load_run_skips_a_corrupt_checkpoint(tmp_path):
    """The run-level reader (`load_run`, as used to resume and report) on a run directory
    whose newest checkpoint is damaged: the previous one is loaded, with a warning."""
    cfg = tiny_cfg()
    ds = train.build_dataset(cfg)
    model = train.build_model(cfg, ds, key=jax.random.key(0))
    state = train.RunState.init(model, train.build_optimizer(cfg))
    C.save_config(cfg, tmp_path / "config.yaml")
    for step in (1, 2):
        bumped = jax.tree.map(lambda x: x + step if eqx.is_inexact_array(x) else x, model)
        train.save_checkpoint(tmp_path, train.RunState(bumped, state.opt_state, step=step),
                              {"data_position": step})
    _flip_last_byte(_checkpoint.checkpoint_path(tmp_path, 2))
    with pytest.warns(UserWarning, match="checksum mismatch"):
        _, _, loaded = train.load_run(tmp_path)
    want = jax.tree.leaves(eqx.filter(model, eqx.is_inexact_array))
    got = jax.tree.leaves(eqx.filter(loaded, eqx.is_inexact_array))
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b + 1)


# ============================================================================ 5. training faults

class _Poisoned:
    """A dataset whose training batches `bad` have NaN pixels (a corrupt record)."""

    def __init__(self, inner, bad):
        self.inner, self.bad = inner, set(bad)

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def batch(self, index, split="train"):
        b = self.inner.batch(index, split)
        if split == "train" and index in self.bad:
            b = dict(b, inputs=np.full_like(b["inputs"], np.nan))
        return b


def _digits_cfg(**over):
    from spinformer import config as C

    base = {"data.task": "digits", "data.batch_size": 8, "data.eval_batches": 1,
            "model.attention": "softmax", "model.dim": 16, "model.ffn_hidden": 16,
            "model.embed": "patch", "model.patch": 4, "train.steps": 8, "train.log_every": 1,
            "train.eval_every": 8, "train.warmup_steps": 0, "train.progress": False}
    base.update(over)
    return C.load_config(None, base)


def _state_leaves(model, opt_state):
    return [np.asarray(x) for x in jax.tree.leaves(eqx.filter((model, opt_state), eqx.is_array))]


def test_non_finite_steps_are_skipped_and_counted(tmp_path):
    from spinformer import train

    cfg = _digits_cfg(**{"train.max_bad_steps": 3})
    ds = train.build_dataset(cfg)
    model = train.build_model(cfg, ds, key=jax.random.key(0))
    opt = train.build_optimizer(cfg)
    # steps 2 and 5 (batches 2 and 5) are poisoned; each is skipped and the run goes on
    m_bad, s_bad = train.fit(model, _Poisoned(ds, {2, 5}), cfg.train, out_dir=tmp_path / "bad",
                             eval_batches=cfg.data.eval_batches)
    recs = [r for r in train.read_metrics(tmp_path / "bad") if r["split"] == "train"]
    assert [r["step"] for r in recs if r["bad_step"]] == [3, 6]
    assert recs[-1]["bad_steps"] == 2 and s_bad["bad_steps"] == 2
    assert np.isnan(recs[2]["loss"]) and np.isfinite(recs[3]["loss"])
    # said where the user looks: the report's table and note, and the loss figure's marks
    from spinformer.train._figures import skipped_steps

    assert skipped_steps(train.read_metrics(tmp_path / "bad")) == [(3, 1), (6, 1)]
    table = train.report([tmp_path / "bad"])
    assert "| skipped steps |" in table.splitlines()[0] and "| 8 | 2 |" in table
    assert "2 of 8 optimizer steps were skipped" in table
    # a skipped step changes nothing: stepping by hand, the state after the poisoned batch
    # equals the state before it
    step = train.jit_step(opt)
    state = train.RunState.init(model, opt)
    for i in range(2):
        state, _ = step(state, {k: jnp.asarray(v) for k, v in ds.batch(i).items()},
                        jax.random.fold_in(jax.random.key(0), i))
    poisoned = _Poisoned(ds, {2}).batch(2)
    after, met = step(state, {k: jnp.asarray(v) for k, v in poisoned.items()},
                      jax.random.fold_in(jax.random.key(0), 2))
    assert float(met["bad_step"]) == 1.0
    assert int(after.step) == int(state.step) + 1 == 3  # the data position advances
    for a, b in zip(_state_leaves(state.model, state.opt_state),
                    _state_leaves(after.model, after.opt_state)):
        np.testing.assert_array_equal(a, b)
    # too many in a row: the run stops with a message and keeps a checkpoint
    with pytest.raises(FloatingPointError, match="diverged at step 5: 3 steps in a row"):
        train.fit(model, _Poisoned(ds, {2, 3, 4}), cfg.train, out_dir=tmp_path / "stop",
                  eval_batches=cfg.data.eval_batches)
    assert [s for s, _ in train.list_checkpoints(tmp_path / "stop")] == [5]


def test_a_backward_solve_that_needs_its_fallback_gets_it_at_once(tmp_path, capsys):
    """The loop compiles its step without the backward solves' fallbacks; the first step whose
    backward solve misses its tolerance (here every one: one Picard product cannot reach it)
    compiles them in and is taken again, so no step is skipped, the run says so, and the run
    ends where stepping with the fallbacks compiled in from the start ends, to the last bit."""
    cfg = tiny_cfg({"model.attention": "spin", "train.steps": 3, "train.progress": True,
                    "model.attention.adjoint": {"name": "implicit", "linear_solver": "picard",
                                                "max_steps": 1}})
    ds = train.build_dataset(cfg)
    model = train.build_model(cfg, ds, key=jax.random.key(0))
    opt = train.build_optimizer(cfg)
    fitted, summary = train.fit(model, ds, cfg.train, out_dir=tmp_path / "run",
                                eval_batches=cfg.data.eval_batches)
    assert summary["bad_steps"] == 0
    recs = [r for r in train.read_metrics(tmp_path / "run") if r["split"] == "train"]
    assert all(r["backward_fallbacks"] > 0 for r in recs) and len(recs) == 3
    err = capsys.readouterr().err
    assert "with the backward solves' fallbacks (step 1 was not finite without them)" in err
    step, state = train.jit_step(opt), train.RunState.init(model, opt)
    for i in range(3):
        state, _ = step(state, {k: jnp.asarray(v) for k, v in ds.batch(i).items()},
                        jax.random.fold_in(jax.random.key(cfg.train.seed), i))
    for a, b in zip(_state_leaves(fitted, []), _state_leaves(state.model, [])):
        np.testing.assert_array_equal(a, b)


def _run_cli(args, **kw):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.Popen([sys.executable, "-m", "spinformer", *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def _signal_mid_run(tmp_path, name, sig, steps):
    """Start `spinformer run` of the digits config, send `sig` once it has logged 4 records,
    and return `(config path, process, stderr)` after it exits."""
    cfg = _digits_cfg(**{"train.steps": steps, "train.log_every": 5, "train.eval_every": 500,
                         "train.checkpoint_every": 0})
    path = tmp_path / "cfg.yaml"
    C.save_config(cfg, path)
    proc = _run_cli(["run", str(path), "--out", str(tmp_path / name), "--no-progress"])
    metrics = tmp_path / name / "metrics.jsonl"
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 4:
            break
        time.sleep(0.05)
    assert proc.poll() is None, proc.communicate()[1][-2000:]
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    return path, proc, err


@pytest.mark.slow  # 25 s; SIGINT (below) and test_train's kill-and-resume cover the default run
def test_sigterm_checkpoints_and_resume_is_bit_identical(tmp_path):
    steps = 800
    path, cut, err = _signal_mid_run(tmp_path, "cut", signal.SIGTERM, steps)
    assert cut.returncode == 128 + signal.SIGTERM, err[-2000:]
    assert "stopped by SIGTERM at step" in err and "--resume" in err
    assert "Traceback" not in err
    ((stopped, _),) = _ckpt_list(tmp_path / "cut")
    assert 20 <= stopped < steps
    resumed = _run_cli(["run", str(path), "--out", str(tmp_path / "cut"), "--no-progress",
                        "--resume"])
    full = _run_cli(["run", str(path), "--out", str(tmp_path / "full"), "--no-progress"])
    for p in (resumed, full):
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-2000:]
    name = f"ckpt-{steps:08d}.ckpt"
    a = (tmp_path / "full" / name).read_bytes()
    b = (tmp_path / "cut" / name).read_bytes()
    assert a.split(b"\n", 2)[2] == b.split(b"\n", 2)[2]  # the same parameters and optimiser
    strip = lambda d: [{k: v for k, v in r.items() if k != "time_s"}  # noqa: E731
                       for r in train.read_metrics(d)]
    assert strip(tmp_path / "full") == strip(tmp_path / "cut")


def test_sigint_checkpoints_and_exits_cleanly(tmp_path):
    """Ctrl-C in the training loop writes a checkpoint and exits with 128 + SIGINT. Nothing
    here depends on timing (a loaded machine runs it too): the run is far longer than any
    test (it can never finish first), SIGINT is sent once the loop has logged its 4th
    record (an observable event, waited for as long as a slow machine needs), and the output
    goes to files (no pipe can fill up and stall the run)."""
    cfg = _digits_cfg(**{"train.steps": 10**7, "train.log_every": 5, "train.eval_every": 500,
                         "train.checkpoint_every": 0})
    path = tmp_path / "cfg.yaml"
    C.save_config(cfg, path)
    metrics = tmp_path / "run" / "metrics.jsonl"
    with open(tmp_path / "stdout", "w") as out, open(tmp_path / "stderr", "w") as errf:
        proc = subprocess.Popen([sys.executable, "-m", "spinformer", "run", str(path), "--out",
                                 str(tmp_path / "run"), "--no-progress"],
                                env=dict(os.environ, JAX_PLATFORMS="cpu"), stdout=out,
                                stderr=errf)
        try:
            deadline = time.time() + 600
            while proc.poll() is None and time.time() < deadline and not (
                    metrics.exists() and len(metrics.read_text().splitlines()) >= 4):
                time.sleep(0.1)
            assert proc.poll() is None, (tmp_path / "stderr").read_text()[-2000:]
            assert len(metrics.read_text().splitlines()) >= 4, "no 4th record in 600 s"
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=600)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    err = (tmp_path / "stderr").read_text()
    assert proc.returncode == 128 + signal.SIGINT, err[-2000:]
    assert "stopped by SIGINT at step" in err and "Traceback" not in err
    ((stopped, path),) = _ckpt_list(tmp_path / "run")
    assert f"ckpt-{stopped:08d}.ckpt" in err
    # the whole command that continues the run, not just "--resume"
    assert f"--out {tmp_path / 'run'} --resume" in err and "spinformer run " in err
    assert max(r["step"] for r in train.read_metrics(tmp_path / "run")) <= stopped


def _ckpt_list(d):
    from spinformer import train

    return train.list_checkpoints(d)


def _signal_while_compiling(tmp_path, name, signals, group=False):
    """Start `spinformer run` of the quickstart (its first step compiles for seconds), send
    each of `signals` once the training loop has started (the first step compiling), 0.6 s
    apart (repeats closer than `train.StopSignals.SAME_REQUEST_S` count once); with `group`,
    each to the process and then to its process group, as coreutils `timeout` does. Return
    `(process, stderr lines with the time each arrived, time sent)`."""
    import threading

    cfgp = pathlib.Path(__file__).resolve().parents[2] / "configs" / "quickstart.yaml"
    out = tmp_path / name
    proc = _run_cli(["run", str(cfgp), "--out", str(out), "--no-progress", "--set",
                     "train.steps=50"], start_new_session=group)
    lines = []

    def read():
        for line in proc.stderr:
            lines.append((time.time(), line))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    deadline = time.time() + 240
    while time.time() < deadline and not (out / "metrics.jsonl").exists():
        time.sleep(0.02)
    time.sleep(1.5)  # the loop has started: its first step compiles for several seconds
    assert proc.poll() is None, "".join(x for _, x in lines)[-2000:]
    assert not (out / "metrics.jsonl").read_text()  # (no step logged yet)
    sent = time.time()
    for sig in signals:
        proc.send_signal(sig)
        if group:
            os.killpg(proc.pid, sig)
        time.sleep(0.6)
    proc.wait(timeout=240)
    reader.join(timeout=10)
    return proc, lines, sent


@pytest.mark.slow  # ~20 s; the default run's test below covers the acknowledgment too
def test_ctrl_c_while_compiling_is_acknowledged_at_once(tmp_path):
    """A Ctrl-C while the first step compiles (Python cannot run its handler until XLA
    returns) is acknowledged within a second; the run then stops cleanly with a checkpoint."""
    proc, lines, sent = _signal_while_compiling(tmp_path, "run", [signal.SIGINT])
    ack = [t for t, x in lines if "SIGINT received" in x]
    assert ack and ack[0] - sent < 1.0, "".join(x for _, x in lines)[-2000:]
    err = "".join(x for _, x in lines)
    assert proc.returncode == 128 + signal.SIGINT and "stopped by SIGINT" in err
    assert "Traceback" not in err


def test_second_ctrl_c_stops_at_once(tmp_path):
    proc, lines, sent = _signal_while_compiling(tmp_path, "run", [signal.SIGINT] * 2)
    err = "".join(x for _, x in lines)
    assert proc.returncode == 128 + signal.SIGINT, err[-2000:]
    ack = [t for t, x in lines if "SIGINT received" in x]
    assert ack and ack[0] - sent < 1.0  # acknowledged at once, while compiling
    assert "SIGINT again: stopping now" in err and "Traceback" not in err


def test_a_second_signal_is_the_signal_echos_alone_under_the_command_line():
    """A second Ctrl-C raises `KeyboardInterrupt` in the main thread, except while the
    command line's signal echo is active: that thread ends the process itself, and a raise
    in the main thread (perhaps inside a finalizer, printed as a traceback) raced its exit."""
    from spinformer.cli import _SignalEcho
    from spinformer.train import StopSignals

    stop = StopSignals()
    stop._handle(signal.SIGINT, None)
    stop.received_at -= 1.0  # (not the same request delivered twice)
    with pytest.raises(KeyboardInterrupt):
        stop._handle(signal.SIGINT, None)
    with _SignalEcho():
        assert StopSignals.second_signal_exits_elsewhere
        stop._handle(signal.SIGINT, None)  # left to the echo thread: no raise
    assert not StopSignals.second_signal_exits_elsewhere


def test_one_sigterm_to_process_and_group_is_one_request(tmp_path):
    """coreutils `timeout` sends its SIGTERM to the command and then to the command's
    process group: delivered twice at once, it is one request (a checkpoint after the step
    in flight), not "again: stopping now"."""
    proc, lines, sent = _signal_while_compiling(tmp_path, "run", [signal.SIGTERM], group=True)
    err = "".join(x for _, x in lines)
    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
    assert "SIGTERM received" in err and "SIGTERM again" not in err
    assert "stopped by SIGTERM" in err and "Traceback" not in err


def test_a_signal_repeated_at_once_is_acknowledged_once():
    """The acknowledging thread counts a repeat of the same signal within
    `SAME_REQUEST_S` once, however the two deliveries fall (here 50 ms apart, so that the
    kernel cannot merge them): one line, and the process is not stopped at once."""
    code = ("import os, signal, time\n"
            "from spinformer import cli\n"
            "signal.signal(signal.SIGTERM, lambda *a: None)\n"
            "with cli._SignalEcho():\n"
            "    os.kill(os.getpid(), signal.SIGTERM)\n"
            "    time.sleep(0.05)\n"
            "    os.kill(os.getpid(), signal.SIGTERM)\n"
            "    time.sleep(0.5)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stderr.count("SIGTERM received") == 1 and "again" not in proc.stderr.replace(
        "send it again", "")


def test_ctrl_c_while_importing_is_one_line(tmp_path):
    """Ctrl-C while the command is still importing JAX: one line, exit status 130."""
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:  # e.g. `pytest &` in a script
        pytest.skip("SIGINT is ignored in this process (a shell's background job), and so in "
                    "the command it starts: Python installs no Ctrl-C handler there")
    env = dict(os.environ, JAX_PLATFORMS="cpu", SPINFORMER_HUGEPAGES="0")
    proc = subprocess.Popen([sys.executable, "-X", "importtime", "-m", "spinformer", "run",
                             "quickstart", "--out", str(tmp_path / "run")], env=env,
                            stderr=subprocess.PIPE, text=True,
                            cwd=pathlib.Path(__file__).resolve().parents[2])
    lines = []
    for line in proc.stderr:  # `-X importtime`: a line as each module is imported
        lines.append(line)
        if "jax._src" in line:  # inside `import jax`, which has not finished yet
            proc.send_signal(signal.SIGINT)
            break
    lines += proc.stderr.readlines()
    proc.wait(timeout=60)
    ours = [x for x in lines if not x.startswith("import time:")]
    assert proc.returncode == 130, "".join(ours)[-2000:]
    assert len(ours) == 1 and ours[0].startswith("spinformer: interrupted"), "".join(ours)


def test_stop_requests_reach_the_active_loop_or_wait_for_the_next(monkeypatch):
    """`StopSignals.request` (the zoo's time budget uses it; a signal's handler can run inside
    a finalizer, where its KeyboardInterrupt is dropped) sets the innermost active loop's
    `received` from another thread; made with no loop active it waits for the next loop to
    enter, and `withdraw` forgets it. A real signal still sets `received` once, and a second
    one interrupts at once."""
    import threading

    from spinformer.train import StopSignals

    with StopSignals() as outer:
        with StopSignals() as inner:
            t = threading.Thread(target=StopSignals.request, args=(signal.SIGTERM,))
            t.start()
            t.join()
            assert inner.received == signal.SIGTERM and outer.received is None
        StopSignals.request()
        assert outer.received == signal.SIGINT
    StopSignals.request(signal.SIGTERM)  # no loop active: kept for the next one
    with StopSignals() as nxt:
        assert nxt.received == signal.SIGTERM
    with StopSignals() as later:  # taken up once
        assert later.received is None
    StopSignals.request()
    StopSignals.withdraw()
    monkeypatch.setattr(StopSignals, "SAME_REQUEST_S", 0.0)  # a repeat is a second request
    with StopSignals() as after:
        assert after.received is None
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)  # (the handler runs at the next bytecode)
        assert after.received == signal.SIGINT
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)


def test_stop_signals_take_a_repeat_at_once_as_the_same_request(monkeypatch):
    """The loop's handler, like the acknowledging thread: the same signal twice within
    `SAME_REQUEST_S` (coreutils `timeout` signals the process, then its group) asks once to
    stop after the step in flight; one after the window stops at once. (The window is set
    wide, then closed, so that the test does not depend on timing.)"""
    monkeypatch.setattr(train.StopSignals, "SAME_REQUEST_S", 60.0)
    with train.StopSignals() as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.received == signal.SIGTERM
        monkeypatch.setattr(train.StopSignals, "SAME_REQUEST_S", 0.0)
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5.0)  # the handler runs at the next bytecode boundary
