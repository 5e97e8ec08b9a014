"""Every benchmark (`experiments/bench/*.py`) and every experiment script (`experiments/*.py`)
runs end to end at its smallest size, as a user runs it: `python SCRIPT ...` in a subprocess
from the repository root, on the CPU, writing only under the test's temporary directory. Each
run must exit with status 0 and print (or write) what it measures. Their numbers are not
results: only that the scripts still run against the library as it is.

The experiment scripts that another test module already runs end to end are listed in
`COVERED_ELSEWHERE` instead (with the test that runs them); a new script in neither list
fails `test_every_script_is_listed`. The default run keeps the few scripts that take under
~10 s at their smallest size; the others are `slow` (`pytest -m slow tests/test_scripts.py`).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import pathlib
import random
import re
import subprocess
import sys
from collections.abc import Callable

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
EXPERIMENTS = ROOT / "experiments"
# bench/peers.py's optional peers (jaxopt is a dev dependency): a missing one is left out with
# a line that says so
MISSING_PEERS = tuple(m for m in ("optimistix", "banax") if importlib.util.find_spec(m) is None)

# the experiment scripts run end to end by other test modules (not run again here)
COVERED_ELSEWHERE = {
    "experiments/attractor.py":
        "tests/nn/test_attractor.py::test_experiment_quick_config_runs_resumes_and_reports",
    "experiments/boltzmann_ablation.py":
        "tests/test_experiments.py::test_boltzmann_ablation_quick",
    "experiments/implicit_images.py": "tests/test_experiments.py::test_implicit_images_quick",
    "experiments/ngt_nli.py": "tests/test_experiments.py::test_ngt_nli_quick",
    "experiments/spin_lm.py": "tests/test_experiments.py::test_spin_lm_runs_resumes_and_reports",
}


def _text(tmp: pathlib.Path) -> None:
    """About 100 kB of made-up lines, for the character-level scripts (Shakespeare is fetched,
    not shipped)."""
    rng = random.Random(0)
    words = ("the", "king", "and", "queen", "of", "a", "to", "my", "lord", "thou", "art", "not",
             "what", "is", "love", "night", "day", "sweet", "death", "fair")
    lines = [" ".join(rng.choice(words) for _ in range(rng.randint(4, 12))).capitalize() + "."
             for _ in range(3000)]
    (tmp / "text.txt").write_text("\n".join(lines) + "\n")


@dataclasses.dataclass(frozen=True)
class Case:
    """One script at its smallest size: `args` with `{tmp}` (the test's directory) and
    `{quickstart}` (the tiny quickstart runs of `spin_lm.py`, the `quickstart_runs` fixture)
    filled in; `expect`: regular expressions its standard output must match (multiline);
    `reject`: ones it must not; `files`: paths under `{tmp}` it must write (non-empty);
    `written`: (path, regular expression) pairs, a file's text that must match;
    `setup`: what to put into `{tmp}` first."""

    script: str
    args: tuple[str, ...] = ()
    expect: tuple[str, ...] = ()
    reject: tuple[str, ...] = ()
    files: tuple[str, ...] = ()
    written: tuple[tuple[str, str], ...] = ()
    setup: Callable[[pathlib.Path], None] | None = None
    quickstart: bool = False
    timeout: int = 900


# Measured on 2 shared CPU cores (2026-12-02; the suite's compile settings of conftest.py):
# the time of each script at the sizes below is in the comment beside it.
CASES = [
    # --------------------------------------------------------------------- default run
    pytest.param(Case(  # ~5 s
        "experiments/bench/boltzmann.py", ("--quick", "--repeats", "1"),
        expect=(r"^ratios are per-query enumeration time / boltzmann_marginals time",
                r"^T= 8 causal=True +fwd\+bwd .* ratio x +\d+\.\d"), timeout=300),
        id="bench/boltzmann"),
    pytest.param(Case(  # ~6 s
        "experiments/bench/attractor.py", ("--quick", "--repeats", "1", "--out", "{tmp}/att"),
        expect=(r"^size +N +d +step ms +pairs ms +ratio", r"^2x2 patches of 8x8, d=8 .*\d",
                r"^largest N that fits"),
        files=("att/bench_quick.json",)), id="bench/attractor"),
    pytest.param(Case(  # ~10 s: jaxopt's Anderson beside ours
        "experiments/bench/tap_ness.py", ("--quick",),
        expect=(r"^gradient +rel\. diff x: ", r"^ratio jaxopt/ours = \d+\.\d+")),
        marks=pytest.mark.slow, id="bench/tap_ness"),  # (the default run: ~10-minute budget)
    # --------------------------------------------------------------------- slow
    pytest.param(Case(  # ~11 s
        "experiments/bench/energy_attention.py", ("--quick", "--repeats", "1"),
        expect=(r"^ratios are softmax time / contender time",
                r"^hopfield fixed_point \(implicit\) +\d+\.\d+ ms +softmax / it = \d",
                r"^retrieval: .* forward steps per solve")),
        marks=pytest.mark.slow, id="bench/energy_attention"),
    pytest.param(Case(  # ~29 s: every part, the breakdown included, and the markdown + figure
        "experiments/bench/neurogame.py", ("--quick", "--out", "{tmp}/ngt/bench.md"),
        expect=(r"^### mode = 'pooled'", r"^### mode = 'query'",
                r"^ +forward \+ backward +\S+ +\S+ +\d+\.\d+ ",
                r"^ +breakdown over the same \d+ games", r"^ +sum of the pieces ",
                r"^ +φ \(Shapley\) +unbiased MC vs exact", r"ratio Alg\.1/shared$",
                r"^Total time of the run"),
        files=("ngt/bench.md", "ngt/estimator_error.png")),
        marks=pytest.mark.slow, id="bench/neurogame"),
    pytest.param(Case(  # ~17 s
        "experiments/bench/peers.py", ("--quick", "--repeats", "1"),
        expect=(r"^## 1\. binary TAP", r"^ +spinformer Anderson +\d+ ",
                r"^fastest peer .* / fastest ours .*: x\d", r"^## Summary",
                r"^- tap: x\d",
                *(rf"^{m}: not available here \(.*\); " for m in MISSING_PEERS))),
        marks=pytest.mark.slow, id="bench/peers"),
    pytest.param(Case(  # ~32 s
        "experiments/bench/generate.py", ("--quick", "--out", "{tmp}/gen"),
        expect=(r"^spin TAP steady state .* ratio \d+\.\d+x, .* same text: ",
                r"^\| model \| incremental \(ms/char\) \| re-solve \(ms/char\) \| ratio"),
        files=("gen/generate_quick_cpu.json", "gen/generate_quick_cpu.md")),
        marks=pytest.mark.slow, id="bench/generate"),
    pytest.param(Case(  # ~27 s: a child process with 2 host devices
        "experiments/bench/scaling.py",
        ("--devices", "2", "--batch", "4", "--repeats", "1", "--out", "{tmp}/sc"),
        expect=(r"^\| devices \| ms / step \| steps / s \| vs 1 device",
                r"^\| 2 \| \d+\.\d \| \d+\.\d \| \d+\.\d\d \| .*all-reduce"),
        files=("sc/cpu_quickstart.md",)), marks=pytest.mark.slow, id="bench/scaling"),
    pytest.param(Case(  # ~70 s
        "experiments/bench/implicit.py", ("--quick",),
        expect=(r"^## 1\. forward\+backward", r"^implicit 40/10: x\d+\.\d+",
                r"^## 3\. amortised couplings", r"^ +1\.0 +\d+\.\d +\d+\.\d+ +\d+\.\d+ +\d+")),
        marks=pytest.mark.slow, id="bench/implicit"),
    pytest.param(Case(  # ~64 s
        "experiments/bench/spin_attention.py", ("--quick", "--repeats", "1"),
        expect=(r"^ +ours, Anderson \+ implicit GMRES\(restart=5\) .*: ratio \d+\.\d+",
                r"^\[2\] compile time of a training step .* ratio \d+\.\d+",
                r"^\[3\] training throughput", r"medians over interleaved rounds .*: \d+\.\d+")),
        marks=pytest.mark.slow, id="bench/spin_attention"),
    pytest.param(Case(  # ~83 s
        "experiments/bench/solvers.py", ("--quick",),
        expect=(r"^## 1a\. Binary TAP", r"^## 4\. Implicit's fallback", r"^## Targets",
                r"^- Anderson evaluations <= jaxopt's .*: x\d+\.\d+ -> ")),
        marks=pytest.mark.slow, id="bench/solvers"),
    pytest.param(Case(  # ~160 s: ten backward solvers, compiled for two problems
        "experiments/bench/adjoint.py", ("--quick", "--repeats", "1"),
        expect=(r"^## 1\. DEQ layer", r"^## 2\. SpinAttention TAP steady state",
                r"^ +default +\d+ +\d+\.\d +\d+ +\S+ yes ",
                r"^fastest converged: .*against the default\)")),
        marks=pytest.mark.slow, id="bench/adjoint"),
    pytest.param(Case(  # ~58 s: one family (the iterative spin one), 20 training steps
        "experiments/bench/cost.py", ("--quick", "--families", "spin", "--out", "{tmp}/cost"),
        expect=(r"^\| task \| family \| step \(ms\) \| softmax \(ms\) \| ratio \| bound",
                r"^\| brackets16 \| spin \| \d+\.\d \| \d+\.\d \| \d\.\d\d \| \d\.\d\d"),
        reject=(r'"error"',), files=("cost/cost.json", "cost/cost.md")),
        marks=pytest.mark.slow, id="bench/cost"),
    pytest.param(Case(  # ~3 min: spin's gradient under seven adjoints at steps 0 and 20
        "experiments/bench/gradients.py", ("--quick", "--out", "{tmp}/grad"),
        expect=(r"^\| brackets16/spin \| default \| 0: 1\.0000 / .* \| \d\.\d\d \|$",
                r"^\| brackets16/spin \| shine \| 0: 0\.9\d+ / .* \| \d\.\d\d \|$"),
        reject=(r'"error"',), files=("grad/gradients.json", "grad/gradients.md")),
        marks=pytest.mark.slow, id="bench/gradients"),
    pytest.param(Case(  # ~15 s: softmax's steps and the minimal pure-JAX step
        "experiments/bench/compile.py", ("--configs", "brackets_softmax", "--tasks", "none",
                                         "--out", "{tmp}/compile"),
        expect=(r"^brackets_softmax \(softmax\) +train: \d+\.\d s \(\d+\.\d XLA, \d+ lines, "
                r"\d+ loops, x1\.00, x\d+\.\d\d minimal\)",
                r"^\| brackets_softmax \(softmax\) \| minimal \| "),
        files=("compile/compile.json", "compile/compile.md")),
        marks=pytest.mark.slow, id="bench/compile"),
    pytest.param(Case(  # ~30 s
        "experiments/ngt_worked_example.py", ("run", "--quick", "--results", "{tmp}/ngt"),
        expect=(r"^wrote .* in \d+ s",),
        written=(("ngt/worked_example.md", r"^\| v \| 0 \| 0\.2 \| 0\.5 \|"),
                 ("ngt/estimators.md", r"^## Numbers: K = 256 draws")),
        files=("ngt/worked_example.md", "ngt/estimators.md")),
        marks=pytest.mark.slow, id="ngt_worked_example"),
    pytest.param(Case(  # ~38 s
        "experiments/nonequilibrium_mc.py", ("all", "--quick", "--results", "{tmp}/mc"),
        files=("mc/monte_carlo.json", "mc/monte_carlo.md", "mc/monte_carlo.png"),
        written=(("mc/monte_carlo.md", r"^\| 4 \| 32 \| 0\.5 \| \d\.\d\d \| \d+\.\d%"),
                 ("mc/monte_carlo.md", r"^## β dependence"))),
        marks=pytest.mark.slow, id="nonequilibrium_mc"),
    pytest.param(Case(  # ~80 s: five variants, 2 steps, one seed, on a made-up text
        "experiments/streaming_ablation.py",
        ("all", "--steps", "2", "--seeds", "1", "--data", "{tmp}/text.txt", "--runs",
         "{tmp}/runs", "--results", "{tmp}/res"),
        expect=(r"^\| variant \| seeds \| val loss \| gap to stream",
                r"^\| stream \| 1 \| \d+\.\d+ ± ", r"^\| local \| 1 \| \d+\.\d+ ± .* \| [+-]\d"),
        files=("res/streaming.md", "res/streaming.json"), setup=_text),
        marks=pytest.mark.slow, id="streaming_ablation"),
    pytest.param(Case(  # ~40 s, after the quickstart runs (the fixture: ~35 s, once)
        "experiments/quickstart_init_swap.py",
        ("all", "--base", "2", "--donor", "0", "--parts", "qk", "--steps", "4", "--runs",
         "{tmp}/swap", "--reference", "{quickstart}/quickstart", "--results", "{tmp}/res"),
        expect=(r"^2_qk_from0: accuracy \d\.\d+", r"^\| base \| parts from donor \|",
                r"^\| 2 \| qk \| 0 \| 0 \| \d+\.\d\d \| \d+\.\d\d \| \d+\.\d\d \|$"),
        files=("res/quickstart_init_swap.md", "res/quickstart_init_swap.json",
               "swap/2_qk_from0/swap.json"), quickstart=True),
        marks=pytest.mark.slow, id="quickstart_init_swap"),
    pytest.param(Case(  # ~54 s, after the quickstart runs (the fixture: ~35 s, once)
        "experiments/quickstart_diagnosis.py",
        ("--runs", "{quickstart}/quickstart", "spin_s2_d0", "softmax_s2_d0", "--batches", "1",
         "--fp-batches", "1", "--grad-batches", "1", "--results", "{tmp}/res"),
        expect=(r"^# Quickstart runs side by side", r'^\{"closing_brackets": \d+, "accuracy"',
                # the spin run: its fixed points' spectral radius and gradient cosines
                (r"^\| spin_s2_d0 \| \d+\.\d\d \| .* \| \d\.\d{3} \| \d\.\d{3} \| "
                 r"\d\.\d{4} \(\d\)"), r"^\| softmax_s2_d0 \| \d+\.\d\d \| "),
        files=("res/quickstart_diagnosis.md", "res/quickstart_diagnosis.json"),
        quickstart=True),
        marks=pytest.mark.slow, id="quickstart_diagnosis"),
]


def _env() -> dict:
    # the suite's compile settings (conftest.py) pass through os.environ
    return {**os.environ, "JAX_PLATFORMS": "cpu", "MPLBACKEND": "Agg"}


def _python(args, timeout):
    return subprocess.run([sys.executable, *map(str, args)], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=timeout, check=False)


def _checkout_files() -> dict:
    """Size and modification time of every file under experiments/ and runs/ (what a script
    writes by default), caches left out."""
    out = {}
    for top in (EXPERIMENTS, ROOT / "runs"):
        for p in top.rglob("*") if top.exists() else ():
            if p.is_file() and "__pycache__" not in p.parts:
                st = p.stat()
                out[p] = (st.st_size, st.st_mtime_ns)
    return out


@pytest.fixture(scope="module")
def quickstart_runs(tmp_path_factory) -> pathlib.Path:
    """Tiny quickstart runs (4 steps) made by `spin_lm.py` as `quickstart_diagnosis.py` and
    `quickstart_init_swap.py` expect them: spin from model seeds 0 and 2 and softmax from 2,
    all on data seed 0."""
    runs = tmp_path_factory.mktemp("quickstart")
    proc = _python([EXPERIMENTS / "spin_lm.py", "run", "--variants", "spin,softmax", "--seeds",
                    "0,2", "--data-seeds", "0", "--steps", "4", "--runs", runs], 900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    for name in ("spin_s0", "spin_s2_d0", "softmax_s2_d0"):
        assert (runs / "quickstart" / name / "summary.json").exists(), name
    return runs


@pytest.mark.parametrize("case", CASES)
def test_script_runs_at_its_smallest_size(case: Case, tmp_path, request):
    if case.setup is not None:
        case.setup(tmp_path)
    fill = {"tmp": str(tmp_path)}
    if case.quickstart:
        fill["quickstart"] = str(request.getfixturevalue("quickstart_runs"))
    args = [a.format(**fill) for a in case.args]
    before = _checkout_files()
    proc = _python([ROOT / case.script, *args], case.timeout)
    out = proc.stdout
    assert proc.returncode == 0, (f"{case.script} exited with {proc.returncode}:\n"
                                  f"{out[-3000:]}\n{proc.stderr[-6000:]}")
    for pattern in case.expect:
        assert re.search(pattern, out, re.MULTILINE), (
            f"{case.script} printed no line matching {pattern!r}:\n{out[-4000:]}")
    for pattern in case.reject:
        assert not re.search(pattern, out, re.MULTILINE), (
            f"{case.script} printed {pattern!r}:\n{out[-4000:]}")
    for f in case.files:
        assert (tmp_path / f).is_file() and (tmp_path / f).stat().st_size > 0, (
            f"{case.script} did not write {f}")
    for f, pattern in case.written:
        text = (tmp_path / f).read_text()
        assert re.search(pattern, text, re.MULTILINE), (
            f"{case.script} wrote no line matching {pattern!r} into {f}:\n{text[:3000]}")
    # nothing written into the checkout (its results, its run directories)
    assert _checkout_files() == before


def test_every_script_is_listed():
    """Each benchmark and experiment script (not the `_`-prefixed helpers) is run here or by
    the test named in COVERED_ELSEWHERE, and every name in both lists is a script that
    exists: a new script cannot be forgotten, a renamed one cannot leave a stale entry."""
    scripts = {p.relative_to(ROOT).as_posix()
               for p in [*EXPERIMENTS.glob("*.py"), *(EXPERIMENTS / "bench").glob("*.py")]
               if not p.name.startswith("_")}
    here = [p.values[0].script for p in CASES]
    assert len(here) == len(set(here)), "a script listed twice"
    assert not set(here) & set(COVERED_ELSEWHERE), "run here and elsewhere"
    listed = set(here) | set(COVERED_ELSEWHERE)
    assert not scripts - listed, f"scripts no test runs: {sorted(scripts - listed)}"
    assert not listed - scripts, f"listed scripts that do not exist: {sorted(listed - scripts)}"
    for script, where in COVERED_ELSEWHERE.items():
        module, test = where.split("::")
        text = (ROOT / module).read_text()
        assert f"def {test}(" in text, where
        body = text.split(f"def {test}(", 1)[1].split("\ndef ", 1)[0]
        stem = pathlib.Path(script).stem
        assert stem in body, f"{where} does not run {script}"
