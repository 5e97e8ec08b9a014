"""The installed toolchain, where a known upstream bug would hurt this library.

jaxlib 0.10.0–0.10.2 split every batched LAPACK call on the CPU (Cholesky, LU, triangular
solves, eigh) over XLA's intra-op thread pool and wait for the parts there. When as many
such calls run at once as the pool has threads, every thread waits for parts queued behind
the others and the program never returns. Free-energy attention (batched Cholesky),
adaptive TAP and Deep Implicit attention (batched solves) call them in every step; the zoo
hung this way on 2 cores. `pyproject.toml` excludes those releases; this test keeps a
release with the same bug from coming back unnoticed.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

# Six independent batched factorisations in one program, in a process restricted to two
# CPUs so that XLA's pool has two threads (it sizes the pool from the CPU affinity): with
# jaxlib 0.10.2 this hangs on its first call, every time (measured for Cholesky, LU solve,
# triangular solve, eigh and inverse; QR does not hang); jaxlib 0.9.2 runs it in ~3 s.
_PROGRAM = textwrap.dedent(
    """
    import os, sys
    cpus = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, set(cpus[:2]))
    import jax, jax.numpy as jnp
    op = {"cholesky": jnp.linalg.cholesky,
          "solve": lambda a: jnp.linalg.solve(a, a[..., :1])}[sys.argv[1]]

    @jax.jit
    def f(xs):
        return sum(op(x).sum() for x in xs)

    keys = jax.random.split(jax.random.PRNGKey(0), 6)
    xs = [x @ jnp.swapaxes(x, -1, -2) + 32 * jnp.eye(32)
          for x in (jax.random.normal(k, (64, 32, 32)) for k in keys)]
    for i in range(20):
        f([x + 1e-3 * i for x in xs]).block_until_ready()
    print("done")
    """
)


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs CPU affinity (Linux)")
@pytest.mark.parametrize("op", ["cholesky", "solve"])
def test_concurrent_batched_lapack_calls_return(op):
    import jaxlib

    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    try:
        out = subprocess.run([sys.executable, "-c", _PROGRAM, op], env=env, timeout=120,
                             capture_output=True, text=True)
    except subprocess.TimeoutExpired:
        pytest.fail(
            f"six concurrent batched {op} calls did not return in 120 s with jaxlib "
            f"{jaxlib.__version__} on a 2-thread pool: this jaxlib deadlocks batched LAPACK "
            "calls (see docs/guides/installing.md, 'Known problem'); install a jaxlib the "
            "bounds in pyproject.toml allow (pip install -e .)."
        )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().endswith("done")


@pytest.mark.parametrize("version, cpus, warns", [
    ("0.10.2", 2, True), ("0.10.0", 16, True), ("0.10.2", 1, False), ("0.9.2", 2, False),
])
def test_training_warns_about_a_deadlocking_jaxlib(monkeypatch, version, cpus, warns):
    import warnings

    import jax
    import jaxlib

    from spinformer import _toolchain

    monkeypatch.setattr(jaxlib, "__version__", version)
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cpus)), raising=False)
    _toolchain.check_jaxlib.cache_clear()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert _toolchain.check_jaxlib() is warns
            assert _toolchain.check_jaxlib() is warns  # cached: warns once per process
        msgs = [str(w.message) for w in caught if w.category is RuntimeWarning]
        assert len(msgs) == int(warns)
        if warns:
            assert version in msgs[0] and "jaxlib!=0.10.*" in msgs[0] and "taskset" in msgs[0]
    finally:
        _toolchain.check_jaxlib.cache_clear()


@pytest.mark.parametrize("environ, libc, thp, expected", [
    ({}, ("glibc", "2.36"), "always defer [madvise] never", "glibc.malloc.hugetlb=1"),
    ({}, ("glibc", "2.35"), "[always] madvise never", "glibc.malloc.hugetlb=1"),
    ({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}, ("glibc", "2.39"), "[madvise]",
     "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"),  # the user's tunables are kept
    ({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}, ("glibc", "2.36"), "[madvise]", None),
    ({"SPINFORMER_HUGEPAGES": "0"}, ("glibc", "2.36"), "[madvise]", None),  # opted out
    ({}, ("glibc", "2.31"), "[madvise]", None),  # the tunable is new in glibc 2.35
    ({}, ("", ""), "[madvise]", None),  # musl, or not known
    ({}, ("glibc", "2.36"), "always madvise [never]", None),  # THP off
    ({}, ("glibc", "2.36"), None, None),  # no THP setting to read
])
def test_hugepage_environment(tmp_path, monkeypatch, environ, libc, thp, expected):
    from spinformer import _toolchain

    monkeypatch.setattr(sys, "platform", "linux")
    setting = tmp_path / "enabled"
    if thp is not None:
        setting.write_text(thp + "\n")
    env = _toolchain.hugepage_environment(environ, libc=libc, thp_setting=str(setting))
    if expected is None:
        assert env is None
    else:
        assert env["GLIBC_TUNABLES"] == expected
        assert {k: v for k, v in env.items() if k != "GLIBC_TUNABLES"} == {
            k: v for k, v in environ.items() if k != "GLIBC_TUNABLES"}
    monkeypatch.setattr(sys, "platform", "darwin")
    assert _toolchain.hugepage_environment(environ, libc=libc, thp_setting=str(setting)) is None


def test_the_command_restarts_itself_with_the_hugepage_tunable(tmp_path):
    """`spinformer ...` runs its command in a process whose environment has the tunable where
    this machine supports it (and exactly once: no restart loop), and not with
    SPINFORMER_HUGEPAGES=0. The probe: an `--import` module that records its environment,
    imported before the (missing) config fails the command."""
    from spinformer import _toolchain

    (tmp_path / "probe_env.py").write_text(
        "import os\n"
        "with open(os.environ['PROBE_OUT'], 'a') as f:\n"
        "    f.write(os.environ.get('GLIBC_TUNABLES', '<none>') + '\\n')\n")
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    env.update(PYTHONPATH=os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")]),
               PROBE_OUT=str(tmp_path / "seen.txt"))
    expected = _toolchain.hugepage_environment(env)
    for opt_out, want in ((False, expected["GLIBC_TUNABLES"] if expected else "<none>"),
                          (True, "<none>")):
        run_env = dict(env, SPINFORMER_HUGEPAGES="0") if opt_out else env
        (tmp_path / "seen.txt").unlink(missing_ok=True)
        cmd = [sys.executable, "-c", "import sys; from spinformer.cli import main; "
               "sys.argv = ['spinformer'] + sys.argv[1:]; sys.exit(main())",
               "run", str(tmp_path / "missing.yaml"), "--import", "probe_env"]
        out = subprocess.run(cmd, env=run_env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 2 and "missing.yaml" in out.stderr, out.stderr[-2000:]
        assert (tmp_path / "seen.txt").read_text().splitlines() == [want]


def test_experiment_scripts_restart_themselves_with_the_hugepage_tunable(tmp_path):
    """`experiments/_cli.run_script(main)`, the entry point of every experiment script:
    `main` runs once, in a process with the tunable where this machine supports it, with
    the script's own arguments, and its return value is the exit status."""
    from spinformer import _toolchain

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = tmp_path / "script.py"
    script.write_text(
        "import os, sys\n"
        f"sys.path.insert(0, {os.path.join(root, 'experiments')!r})\n"
        "from _cli import run_script\n"
        "def main():\n"
        "    with open(os.environ['PROBE_OUT'], 'a') as f:\n"
        "        f.write(os.environ.get('GLIBC_TUNABLES', '<none>') + ' ' + sys.argv[1] + '\\n')\n"
        "    return 3\n"
        "if __name__ == '__main__':\n"
        "    run_script(main)\n")
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    env["PROBE_OUT"] = str(tmp_path / "seen.txt")
    expected = _toolchain.hugepage_environment(env)
    want = expected["GLIBC_TUNABLES"] if expected else "<none>"
    out = subprocess.run([sys.executable, str(script), "arg"], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 3, out.stderr[-2000:]
    assert (tmp_path / "seen.txt").read_text().splitlines() == [f"{want} arg"]


# ----------------------------------------------------------- the persistent compilation cache


@pytest.mark.parametrize("environ, expected", [
    ({"HOME": "/h"}, "/h/.cache/spinformer/jax"),
    ({"HOME": "/h", "XDG_CACHE_HOME": "/x"}, "/x/spinformer/jax"),
    ({"HOME": "/h", "JAX_COMPILATION_CACHE_DIR": "/j"}, "/j"),
    ({"HOME": "/h", "JAX_COMPILATION_CACHE_DIR": "/j", "SPINFORMER_COMPILATION_CACHE": "/s"},
     "/s"),
    ({"HOME": "/h", "SPINFORMER_COMPILATION_CACHE": "off"}, None),
    ({"HOME": "/h", "SPINFORMER_COMPILATION_CACHE": "0"}, None),
])
def test_compilation_cache_folder(environ, expected, monkeypatch):
    """The cache's folder: SPINFORMER_COMPILATION_CACHE, else JAX's own variable, else the
    user's cache directory; `off` or `0` switch it off."""
    from spinformer._toolchain import compilation_cache_dir

    monkeypatch.setenv("HOME", environ["HOME"])  # (expanduser reads the process's HOME)
    got = compilation_cache_dir(environ)
    assert (None if got is None else str(got)) == expected


def test_an_uncreatable_compilation_cache_warns_and_stays_off(tmp_path):
    from spinformer._toolchain import use_compilation_cache

    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.warns(RuntimeWarning, match="cannot be created.*SPINFORMER_COMPILATION_CACHE"):
        assert use_compilation_cache(
            {"SPINFORMER_COMPILATION_CACHE": str(blocker / "cache")}) is None


def test_a_jax_cache_folder_the_user_set_is_left_to_jax(tmp_path):
    import jax

    from spinformer._toolchain import use_compilation_cache

    before = jax.config.jax_compilation_cache_max_size
    assert use_compilation_cache({"JAX_COMPILATION_CACHE_DIR": str(tmp_path)}) == tmp_path
    assert jax.config.jax_compilation_cache_max_size == before


def test_the_compilation_cache_is_pruned_least_recently_used_first(tmp_path):
    """Past its limit, a cache folder loses its least recently used entries down to half the
    limit; under it, nothing."""
    import os

    from spinformer._toolchain import prune_compilation_cache

    for i in range(10):  # entry 0 was used longest ago
        f = tmp_path / f"entry{i}-cache"
        f.write_bytes(b"x" * 100)
        os.utime(f, (1_000_000 + i, 1_000_000 + i))
    assert prune_compilation_cache(tmp_path, max_bytes=1000) == 0
    assert len(list(tmp_path.iterdir())) == 10
    os.utime(tmp_path / "entry0-cache", (2_000_000, 1_000_000))  # read again: kept
    assert prune_compilation_cache(tmp_path, max_bytes=900) == 6
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "entry0-cache", "entry7-cache", "entry8-cache", "entry9-cache"]
    assert prune_compilation_cache(tmp_path / "absent", max_bytes=1) == 0


def test_the_command_line_cache_keeps_small_programs(tmp_path):
    """`use_compilation_cache` keeps every program, however quickly it compiled (a model's
    initialisation is many small ones), and sets no JAX size limit (no lock and scan per
    entry written)."""
    import jax

    from spinformer._toolchain import use_compilation_cache

    names = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
             "jax_persistent_cache_min_entry_size_bytes", "jax_compilation_cache_max_size")
    before = {n: getattr(jax.config, n) for n in names}
    try:
        assert use_compilation_cache({"SPINFORMER_COMPILATION_CACHE": str(tmp_path)}) == tmp_path
        assert jax.config.jax_compilation_cache_dir == str(tmp_path)
        assert jax.config.jax_persistent_cache_min_compile_time_secs == 0
        assert jax.config.jax_persistent_cache_min_entry_size_bytes == -1
        assert jax.config.jax_compilation_cache_max_size == -1
    finally:
        for n, v in before.items():
            jax.config.update(n, v)
