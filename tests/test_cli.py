import json
import os
import pathlib
import re
import subprocess
import sys

import pytest
import yaml

import spinformer._schema
from spinformer import cli
from spinformer import config as C
from spinformer import nn

ROOT = pathlib.Path(__file__).parents[1]
CONFIGS = (sorted((ROOT / "configs").glob("*.yaml"))
           + sorted((ROOT / "configs" / "spin_lm").glob("*.yaml")))
TEXT = "Now is the winter of our discontent\nMade glorious summer by this sun of York;\n" * 40


def shrink(cfg: C.Config, tmp_path) -> list[str]:
    """--set overrides that turn a real config into a seconds-long smoke run."""
    heads = min(cfg.model.num_heads, 2)
    sets = {
        "train.steps": 2, "train.log_every": 1, "train.eval_every": 2,
        "train.checkpoint_every": 1, "train.warmup_steps": 1, "train.progress": "false",
        "data.batch_size": 4, "data.eval_batches": 1, "data.seq_len": min(cfg.data.seq_len, 12),
        "model.dim": 8 * heads, "model.num_heads": heads, "model.depth": min(cfg.model.depth, 2),
        "model.ffn_hidden": min(cfg.model.ffn_hidden, 16),
    }
    if cfg.model.attention.name == "spin":
        sets["model.attention.solver.max_steps"] = min(cfg.model.attention.solver.max_steps, 8)
        sets["model.attention.num_steps"] = min(cfg.model.attention.num_steps, 2)
    if cfg.data.task in ("nli", "snli"):  # sentence pairs need their length
        sets["data.seq_len"] = cfg.data.seq_len
    for field in ("attention", "pool"):  # NeuroGame attention or its pooled head
        if isinstance(getattr(cfg.model, field), nn.NeuroGameConfig):
            sets[f"model.{field}.train_samples"] = 3
            sets[f"model.{field}.eval_samples"] = 3
    if cfg.data.task == "snli":
        sets["data.path"] = str(ROOT / "tests" / "fixtures" / "nli_sample.jsonl")
    if cfg.data.task == "fashion_mnist":  # the scikit-learn digits: no system package needed
        sets.update({"data.task": "digits", "model.embed": "patch", "model.patch": 4})
    if cfg.data.task == "chars":
        p = tmp_path / "text.txt"
        p.write_text(TEXT)
        sets["data.path"] = str(p)
        sets["data.max_chars"] = "null"
    return [f"{k}={v}" for k, v in sets.items()]


# Configs whose family, data path and training mode another config already runs end to end
# in the default test run (one per family: quickstart for spin, brackets_softmax, brackets_
# hopfield, boltzmann_shakespeare, the image families on digits; nli_softmax and ngt_snli for
# sentence pairs; shakespeare_stream for streaming). The default run still loads and builds
# each of them (`test_every_config_builds_shrunk`); measured with per-test coverage,
# the full runs of these cover no line the rest of the default run does not.
SLOW_CONFIGS = {"fmnist_hopfield", "shakespeare_char_hopfield", "ngt_nli", "nli_boltzmann",
                "brackets_spin", "boltzmann_brackets", "shakespeare_char", "shakespeare_spin",
                "shakespeare_char_softmax", "fmnist_softmax", "shakespeare_softmax"}


@pytest.mark.parametrize("path", [p for p in CONFIGS if p.stem in SLOW_CONFIGS],
                         ids=lambda p: p.stem)
def test_every_config_builds_shrunk(path, tmp_path):
    """A config the default run does not train (shrunk as below) resolves, and its data,
    model, objective and optimizer build: what `run` does before its first step."""
    from spinformer.train import _experiment as E

    cfg = C.load_config(path, shrink(C.load_config(path), tmp_path))
    E._objects(cfg)
    assert E.describe(cfg).startswith(f"{cfg.model.attention.name} attention")


@pytest.mark.parametrize("path", [pytest.param(p, marks=[pytest.mark.slow]
                                               if p.stem in SLOW_CONFIGS else [])
                                  for p in CONFIGS], ids=[p.stem for p in CONFIGS])
def test_every_config_runs_shrunk(path, tmp_path, capsys):
    cfg = C.load_config(path)
    out = tmp_path / "run"
    args = ["run", str(path), "--out", str(out), "--no-progress"]
    for s in shrink(cfg, tmp_path):
        args += ["--set", s]
    assert cli.main(args) == 0
    printed = json.loads(capsys.readouterr().out)
    summary = json.loads((out / "summary.json").read_text())
    # the printed result has summary.json's shape: the metrics under "metrics"
    assert summary["steps"] == 2 and printed["metrics"] == summary["metrics"]
    saved = C.load_config(out / "config.yaml")
    assert saved.model.attention.name == cfg.model.attention.name
    # what was trained, from the config (not its file's text, written for its defaults)
    assert summary["description"].startswith(f"{saved.model.attention.name} attention, data.task "
                                             f"{saved.data.task}")
    assert summary["config_description"] == cfg.description
    assert saved.data.task == ("digits" if cfg.data.task == "fashion_mnist" else cfg.data.task)
    assert (out / "loss.png").exists() and (out / "accuracy.png").exists()


def test_list_report_and_errors(tmp_path, capsys, monkeypatch):
    assert cli.main(["list", "--dir", str(ROOT / "configs")]) == 0
    listing = capsys.readouterr().out
    assert "quickstart" in listing
    for p in CONFIGS:
        assert p.stem in listing
    # each experiment folder says how its script takes configs, and only what it accepts
    assert "spinformer grid plan|price|run|report zoo/NAME" in listing
    assert "experiments/attractor.py all --config" in listing
    assert "spin_lm.py all --config" not in listing and "spin_lm.py --help" in listing
    # one short line each: the first sentence of the description, which fits unclipped
    width = max(len(p.stem) for p in (ROOT / "configs").rglob("*.yaml"))
    for p in (ROOT / "configs").rglob("*.yaml"):
        line = cli.summary_line(yaml.safe_load(p.read_text())["description"])
        assert len(line) <= cli._SUMMARY_WIDTH and not line.endswith("…"), (p, line)
    rows = [x for x in listing.splitlines() if x.strip() and not x.startswith(("experiment", "`"))]
    assert max(len(x) for x in rows) <= 2 + width + 2 + cli._SUMMARY_WIDTH
    assert "spinformer show NAME" in listing
    # `show`: the whole description, and every key the config sets with its meaning
    assert cli.main(["show", str(ROOT / "configs" / "quickstart.yaml"), "--set",
                     "model.attention.solver.tol=1e-4"]) == 0
    shown = capsys.readouterr().out
    cfg = C.load_config(ROOT / "configs" / "quickstart.yaml", ["model.attention.solver.tol=1e-4"])
    flat = {}
    def walk(d, prefix=""):
        for k, v in d.items():
            walk(v, f"{prefix}{k}.") if isinstance(v, dict) else flat.setdefault(prefix + k, v)
    walk(C.to_dict(cfg))
    lines = {x.split(" = ")[0]: x for x in shown.splitlines() if " = " in x}
    assert set(lines) == set(flat) - {"description"}
    assert lines["model.attention.solver.tol"].startswith("model.attention.solver.tol = 0.0001  # ")
    assert "the README's main job" in shown.replace("\n# ", " ")
    # a mistyped key names the key and the nearest valid one, exit status 2
    code = cli.main(["run", str(ROOT / "configs" / "quickstart.yaml"), "--set", "train.stpes=3",
                     "--out", str(tmp_path / "x")])
    err = capsys.readouterr().err
    assert code == 2 and "train.stpes" in err and "train.steps" in err
    assert cli.main(["report", str(tmp_path / "nothing")]) == 2
    assert "summary.json" in capsys.readouterr().err
    monkeypatch.setenv("SPINFORMER_CACHE", str(tmp_path / "cache"))
    p = tmp_path / "lm.yaml"
    p.write_text("description: lm\ndata:\n  task: chars\n  path: shakespeare\n")
    assert cli.main(["run", str(p), "--out", str(tmp_path / "lm")]) == 2
    assert "spinformer data fetch shakespeare" in capsys.readouterr().err
    # a grid given to `run` or `show` says how grids run; an experiment's config, its script
    for name, how in (("zoo/adjoints", "`spinformer grid run "),
                      ("attractor/quick", "`python experiments/attractor.py all --config ")):
        assert cli.main(["show", name]) == 2
        assert how in capsys.readouterr().err, name


def test_default_out_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfgp = pathlib.Path("quickstart.yaml")
    assert cli.default_out_dir(cfgp, resume=False) == pathlib.Path("runs/quickstart")
    pathlib.Path("runs/quickstart").mkdir(parents=True)
    (pathlib.Path("runs/quickstart") / "summary.json").write_text("{}")
    assert cli.default_out_dir(cfgp, resume=False) == pathlib.Path("runs/quickstart-1")
    assert cli.default_out_dir(cfgp, resume=True) == pathlib.Path("runs/quickstart")


def test_python_dash_m():
    out = subprocess.run([sys.executable, "-m", "spinformer", "list", "--dir",
                          str(ROOT / "configs")], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0 and "quickstart" in out.stdout


def test_list_does_not_import_jax():
    """`spinformer list` reads YAML files: it answers without loading JAX (seconds)."""
    code = ("import sys; from spinformer import cli; assert cli.main(['list']) == 0; "
            "print('jax loaded' if 'jax' in sys.modules else 'no jax')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[-1] == "no jax"


def test_ctrl_c_before_training_is_one_line(monkeypatch, capsys):
    """Ctrl-C while a run is being set up (building data and model) exits 130 with one line,
    not a traceback."""
    def setup(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_cmd_list", setup)
    assert cli.main(["list"]) == 130
    err = capsys.readouterr().err
    assert err.startswith("spinformer: interrupted") and len(err.splitlines()) == 1


def test_new_user_trip_ups(tmp_path, capsys):
    """What a first try from a fresh clone ran into: the version, a mistyped config name,
    an empty config file and `--resume` of a run that is not there are each one clear line,
    and nothing is trained."""
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.startswith("spinformer 0.")
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        assert cli.main(["run", "quickstrat"]) == 2
    finally:
        os.chdir(cwd)
    err = capsys.readouterr().err
    assert "'quickstrat' not found" in err and "Did you mean 'quickstart'" in err
    empty = tmp_path / "empty.yaml"
    empty.write_text("# nothing yet\n")
    assert cli.main(["run", str(empty), "--out", str(tmp_path / "e")]) == 2
    assert "the file is empty" in capsys.readouterr().err
    missing = tmp_path / "no_such_run"
    assert cli.main(["run", str(ROOT / "configs" / "quickstart.yaml"), "--out", str(missing),
                     "--resume"]) == 2
    assert "holds no run to resume" in capsys.readouterr().err
    assert not empty.with_name("e").exists() and not missing.exists()


def test_guide_resume_path_and_continuing_a_finished_run(tmp_path, capsys):
    """The command-line guide's path: a run with `--set train.steps=N`, then `--resume` without the
    `--set` (the saved config is used; nothing to do once finished, the summary untouched),
    then `--resume --set train.steps=M` continues it to M steps from its checkpoint."""
    out = tmp_path / "try"
    base = ["run", str(ROOT / "configs" / "brackets_hopfield.yaml"), "--out", str(out),
            "--no-progress"]
    small = ["--set", "model.dim=8", "--set", "model.ffn_hidden=8", "--set",
             "data.batch_size=4", "--set", "data.eval_batches=1", "--set", "train.eval_every=2",
             "--set", "train.warmup_steps=1", "--set", "train.log_every=1"]
    assert cli.main(base + small + ["--set", "train.steps=2"]) == 0
    first = (out / "summary.json").read_text()
    capsys.readouterr()
    assert cli.main(base + ["--resume"]) == 0
    err = capsys.readouterr().err
    assert "nothing to do" in err and "train.steps" in err
    assert "differs at" in err  # the file named on the command line is not the saved config
    assert (out / "summary.json").read_text() == first
    assert cli.main(base + ["--resume", "--set", "train.steps=4"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 4 and C.load_config(out / "config.yaml").train.steps == 4
    steps = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()
             if json.loads(x)["split"] == "train"]
    assert steps == [1, 2, 3, 4]  # continued from step 2, not restarted
    assert cli.main(base + ["--resume", "--set", "train.steps=3"]) == 2  # not fewer
    assert "not fewer" in capsys.readouterr().err
    # a resume that cannot go on is one error line, before any note or progress line
    assert cli.main(base + ["--resume", "--set", "model.depth=2"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("spinformer: error: --resume"), err
    # a saved config that no longer fits its checkpoints: refused, nothing changed
    saved = (out / "config.yaml").read_text()
    held = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    (out / "config.yaml").write_text(saved.replace("dim: 8", "dim: 16"))
    assert cli.main(base + ["--resume", "--set", "train.steps=6"]) == 2
    err = capsys.readouterr().err
    assert "no checkpoint there can be read into this model" in err and "Traceback" not in err
    (out / "config.yaml").write_text(saved)
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == held
    # a run directory without a checkpoint yet: says it starts from step 0
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    (fresh / "config.yaml").write_text(saved)
    run_fresh = ["run", str(ROOT / "configs" / "brackets_hopfield.yaml"), "--out", str(fresh),
                 "--no-progress", "--resume"]
    assert cli.main(run_fresh) == 0
    assert "holds no checkpoint yet" in capsys.readouterr().err
    assert json.loads((fresh / "summary.json").read_text())["steps"] == 4


def test_report_watches_an_unfinished_run(tmp_path, capsys, monkeypatch):
    """A run still training (no summary.json yet) is reported from its metrics.jsonl, marked
    unfinished, and the command says where it wrote."""
    monkeypatch.setenv("MPLBACKEND", "Agg")
    d = tmp_path / "going"
    d.mkdir()
    (d / "config.yaml").write_text("model:\n  attention: spin\n")
    recs = [{"step": 10, "split": "train", "loss": 2.0, "accuracy": 0.3, "time_s": 5.0},
            {"step": 20, "split": "train", "loss": 1.5, "accuracy": 0.4, "time_s": 7.0},
            {"step": 20, "split": "val", "loss": 1.6, "accuracy": 0.45, "time_s": 7.5}]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert cli.main(["report", str(d)]) == 0
    captured = capsys.readouterr()
    row = next(x for x in captured.out.splitlines() if x.startswith("| going"))
    assert "(unfinished)" in row and "| 20 |" in row and "1.6000" in row and "0.4500" in row
    assert "Unfinished" in captured.out
    assert f"wrote {d / 'report.md'}" in captured.err and (d / "report.md").exists()


def test_own_attention_from_the_command_line(tmp_path):
    """`--import my_attention.py` registers the user's attention before the config is read:
    `model.attention` may then name it, and the run trains with it."""
    mod = tmp_path / "my_attention.py"
    mod.write_text(
        "from spinformer import nn\n\n\n"
        "@nn.register_attention('halfsoft', help='softmax attention, outputs halved')\n"
        "class Half(nn.SoftmaxAttention):\n"
        "    def __call__(self, x, **kw):\n"
        "        out = super().__call__(x, **kw)\n"
        "        if isinstance(out, tuple):\n"
        "            return 0.5 * out[0], out[1]\n"
        "        return 0.5 * out\n")
    out = tmp_path / "run"
    args = ["run", str(ROOT / "configs" / "brackets_softmax.yaml"), "--import", str(mod),
            "--out", str(out), "--no-progress", "--set", "model.attention=halfsoft",
            "--set", "train.steps=2", "--set", "data.batch_size=4", "--set",
            "data.eval_batches=1", "--set", "train.warmup_steps=1"]
    proc = subprocess.run([sys.executable, "-m", "spinformer", *args], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "attention: halfsoft" in (out / "config.yaml").read_text()
    # without the import the name is unknown (with a pointer to --import), and a broken
    # module is named
    proc = subprocess.run([sys.executable, "-m", "spinformer", *args[:2], "--set",
                           "model.attention=halfsoft"], capture_output=True, text=True)
    assert proc.returncode == 2 and "halfsoft" in proc.stderr and "--import" in proc.stderr
    bad = tmp_path / "broken.py"
    bad.write_text("raise RuntimeError('oops')\n")
    proc = subprocess.run([sys.executable, "-m", "spinformer", "run", "quickstart", "--import",
                           str(bad)], capture_output=True, text=True)
    assert proc.returncode == 2 and "--import" in proc.stderr and "oops" in proc.stderr


def _forget(name, module):
    """Undo what a test's in-process import of a user module registered."""
    from spinformer import nn

    if name in nn.attention_names():
        spinformer._schema.unregister_attention(name)
    sys.modules.pop(module, None)


def test_run_with_import_is_read_again_without_it(tmp_path, capsys, monkeypatch):
    """A run trained with `--import` records its modules (`imports.json`, the path made
    absolute): `run --resume` and `diagnose` import them again without `--import`, from
    another directory. diagnose prints each stage's own duration."""
    mod = tmp_path / "mine_attention.py"
    mod.write_text(
        "from spinformer import nn\n\n\n"
        "@nn.register_attention('minesoft', help='softmax attention, registered by a test')\n"
        "class Mine(nn.SoftmaxAttention):\n"
        "    pass\n")
    monkeypatch.chdir(tmp_path)
    cfgp = str(ROOT / "configs" / "brackets_softmax.yaml")
    out = tmp_path / "run"
    sets = ["--set", "model.attention=minesoft", "--set", "train.steps=2", "--set",
            "data.batch_size=4", "--set", "data.eval_batches=1", "--set",
            "train.warmup_steps=1", "--set", "model.dim=8", "--set", "model.ffn_hidden=8"]
    try:
        assert cli.main(["run", cfgp, "--import", mod.name, "--out", str(out),
                         "--no-progress", *sets]) == 0
    finally:
        _forget("minesoft", "mine_attention")
    assert json.loads((out / "imports.json").read_text())["modules"] == [str(mod)]
    monkeypatch.chdir(ROOT)
    capsys.readouterr()
    try:
        assert cli.main(["run", cfgp, "--out", str(out), "--resume", *sets]) == 0
        assert "nothing to do" in capsys.readouterr().err
    finally:
        _forget("minesoft", "mine_attention")
    try:
        assert cli.main(["diagnose", str(out), "--starts", "0", "--out",
                         str(tmp_path / "diag")]) == 0
    finally:
        _forget("minesoft", "mine_attention")
    err = capsys.readouterr().err
    stages = [x for x in err.splitlines() if x.startswith("diagnose:") and "done in" not in x]
    done = [x for x in err.splitlines() if x.startswith("diagnose:") and "done in" in x]
    # loading, one batch, the solver effect (none here: no solves), summarising and drawing
    assert len(stages) == len(done) == 4
    assert done[-1].startswith("diagnose: summarising and drawing: done in ")


def test_no_shipped_configs_says_what_to_do(tmp_path, capsys, monkeypatch):
    """An installation without configs (an old wheel) is an error that says how to get
    them, not an empty listing with exit status 0."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(cli, "configs_dir", lambda: tmp_path / "site-packages" / "configs")
    assert cli.main(["list"]) == 2
    err = capsys.readouterr().err
    assert "no configs found" in err and "pip install ." in err
    assert cli.main(["run", "quickstart"]) == 2
    err = capsys.readouterr().err
    assert "'quickstart' not found" in err and "pip install ." in err


def test_configs_are_package_data(tmp_path, monkeypatch):
    """The wheel carries configs/ inside the package (spinformer/configs): pyproject maps it
    and lists every subpackage (a listed package list does not find new ones by itself);
    from a directory without ./configs the command finds the configs."""
    tomllib = pytest.importorskip("tomllib")
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    subpackages = {".".join(p.parent.relative_to(ROOT).parts)
                   for p in (ROOT / "spinformer").rglob("__init__.py")}
    assert set(tool["packages"]) == subpackages | {"spinformer.configs"}
    assert tool["package-dir"] == {"spinformer.configs": "configs"}
    patterns = tool["package-data"]["spinformer.configs"]
    shipped = {p for pat in patterns for p in (ROOT / "configs").glob(pat)}
    assert shipped == set((ROOT / "configs").rglob("*.yaml"))
    monkeypatch.chdir(tmp_path)
    assert (cli.configs_dir() / "quickstart.yaml").is_file()
    assert cli.find_config("quickstart").name == "quickstart.yaml"


def test_extras_are_named_where_they_are_needed(monkeypatch):
    """What needs an extra says which: the notebooks (their first cell), the digits dataset
    without scikit-learn, and the benchmarks without jaxopt (one line, no traceback)."""
    from spinformer import data
    from spinformer.train import _experiment

    tomllib = pytest.importorskip("tomllib")
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    names = {e.split(">")[0].split("[")[0] for e in extras["notebooks"]}
    assert {"jupyterlab", "ipykernel", "scipy", "scikit-learn"} <= names
    for nb in sorted((ROOT / "notebooks").glob("*.ipynb")):
        first = json.loads(nb.read_text())["cells"][0]
        assert first["cell_type"] == "markdown" and '.[notebooks]' in "".join(first["source"])

    def no_sklearn(**kw):
        raise ImportError("the digits dataset comes with scikit-learn, which is not installed")

    monkeypatch.setattr(data.ImageDataset, "digits", staticmethod(no_sklearn))
    cfg = C.load_config(ROOT / "configs" / "fmnist_softmax.yaml").replace(
        {"data.task": "digits"})
    with pytest.raises(C.ConfigError, match=r"\.\[notebooks\]"):
        _experiment.build_dataset(cfg)
    code = ("import sys, runpy; sys.modules['jaxopt'] = None; sys.argv = ['solvers.py', "
            "'--quick']; runpy.run_path('solvers.py', run_name='__main__')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=ROOT / "experiments" / "bench", timeout=120)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [
        'experiments/bench/solvers.py compares against jaxopt, which is not installed: '
        'pip install -e ".[bench]"']


def test_run_says_what_it_compiles_and_a_second_run_reads_it_back(tmp_path):
    """`spinformer run` names the compilation cache, says when a step starts compiling and
    how long compiling took; a second run of the same program reads it from the cache."""
    cache = tmp_path / "cache"
    env = {**os.environ, "SPINFORMER_COMPILATION_CACHE": str(cache)}
    args = ["run", "brackets_softmax", "--set", "train.steps=1", "--set", "data.batch_size=4",
            "--set", "data.eval_batches=1", "--set", "train.warmup_steps=0"]
    errs = []
    for out in ("first", "second"):
        proc = subprocess.run([sys.executable, "-m", "spinformer", *args, "--out",
                               str(tmp_path / out)], capture_output=True, text=True,
                              timeout=300, env=env)
        assert proc.returncode == 0, proc.stderr[-2000:]
        errs.append(proc.stderr)
    assert f"compiled programs kept in {cache}" in errs[0]
    for what in ("training step", "evaluation step"):
        assert f"compiling the {what}..." in errs[0]
        assert re.search(f"the {what} compiled in [0-9.]+ s \\(tracing", errs[0])
        assert "read from the compilation cache" not in errs[0]
        assert re.search(f"the {what} compiled in .*read from the compilation cache",
                         errs[1]), errs[1]
    assert any(cache.iterdir())
