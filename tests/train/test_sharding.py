"""Data parallelism on forced host devices: a sharded step equals the one-device step, a
sharded run resumes bit-identically, evaluation is global, two processes train as one.

The checks run in child processes (`tests/train/sharding_worker.py`) started with
`XLA_FLAGS=--xla_force_host_platform_device_count=N`: the device count is fixed when JAX
starts. On 2 CPU cores this tests correctness, not speed.
"""

from __future__ import annotations

import json
import os
import pathlib
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest

import spinformer as sf
from spinformer.train import _mesh

WORKER = pathlib.Path(__file__).with_name("sharding_worker.py")


def _env(devices: int) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} "
                         f"--xla_force_host_platform_device_count={devices}".strip())
    env["PYTHONPATH"] = os.pathsep.join(
        [str(WORKER.parents[2]), *filter(None, [env.get("PYTHONPATH")])])
    return env


def _records(out: str) -> dict:
    recs = [json.loads(line) for line in out.splitlines() if line.startswith('{"check"')]
    by = {}
    for r in recs:
        by.setdefault(r["check"], []).append(r)
    return by


def _worker(*args, devices=4, timeout=300) -> dict:
    p = subprocess.run([sys.executable, str(WORKER), *args], env=_env(devices),
                       capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, p.stderr[-3000:]
    return _records(p.stdout)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow  # a minute on 2 cores (child processes on 1, 2 and 4 simulated devices)
def test_sharded_step_eval_accumulation_and_bfloat16():
    got = _worker("local")
    steps = {tuple(sorted(r["mesh"].items())): r for r in got["step"]}
    for r in steps.values():
        # the update moved the parameters by ~1e-3; the sharded one agrees to float tolerance
        # (Adam's first step divides g by |g|: the all-reduce order moves it slightly)
        assert r["moved"] > 1e-4 and r["param_diff"] < 1e-2 * r["moved"]
        assert r["opt_diff"] < 1e-6
        assert abs(r["loss"][0] - r["loss"][1]) < 1e-5 * abs(r["loss"][0])
        assert abs(r["grad_norm"][0] - r["grad_norm"][1]) < 1e-5 * r["grad_norm"][0]
        assert r["devices_per_param"] == [4]
    assert steps[(("data", 4), ("model", 1))]["param_specs"] == ["P()"]  # replicated
    model_axis = steps[(("data", 2), ("model", 2))]["param_specs"]
    assert any("'model'" in spec for spec in model_axis)  # the large matrices are split
    (ev,) = got["eval"]
    assert ev["single"].keys() == ev["sharded"].keys()  # evaluate's metrics, name by name
    for name, value in ev["single"].items():
        np.testing.assert_allclose(value, ev["sharded"][name], rtol=1e-6, err_msg=name)
    (acc,) = got["accumulate"]
    np.testing.assert_allclose(acc["loss"][0], acc["loss"][1], rtol=1e-6)
    assert acc["moved"] > 1e-4 and acc["param_diff"] < 1e-3 * acc["moved"]
    (bf,) = got["bfloat16"]
    assert bf["dtypes"] == ["float32"]  # parameters stay float32
    assert bf["loss"][0] != bf["loss"][1]  # the bfloat16 products did run
    np.testing.assert_allclose(bf["loss"][1], bf["loss"][0], rtol=1e-2)


def _two_processes(tmp_path, variant):
    port = str(_free_port())
    procs = [subprocess.Popen([sys.executable, str(WORKER), "multiprocess", str(rank), port,
                               str(tmp_path), variant], env=_env(2), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    recs = [_records(out)["multiprocess"][0] for out, _ in outs]
    assert [r["devices"] for r in recs] == [4, 4] and [r["local"] for r in recs] == [2, 2]
    assert recs[0]["wrote"]  # process 0 wrote the summary (and only it may: `is_writer`)
    assert recs[0]["val_loss"] == recs[1]["val_loss"]  # global metrics, the same everywhere
    return recs


@pytest.mark.slow  # 35 s of child processes; the orbax test below resumes a sharded run
def test_sharded_resume_is_bit_identical_and_two_processes_train_as_one(tmp_path):
    """A sharded run resumes bit-identically (and on another mesh to float tolerance); two
    processes of 2 devices each (gloo over loopback) reach the parameters of one 4-device
    process."""
    (res,) = _worker("resume", str(tmp_path))["resume"]
    assert res["same_payload"]
    assert res["remeshed_diff"] < 1e-3 * res["moved"]  # resumed on 2 devices instead of 4
    _two_processes(tmp_path, "data")
    (cmp,) = _worker("compare", str(tmp_path / "full"), str(tmp_path / "mp"), devices=1)["compare"]
    assert cmp["moved"] > 1e-4 and cmp["param_diff"] < 1e-3 * cmp["moved"]
    metrics = (tmp_path / "mp" / "metrics.jsonl").read_text().splitlines()
    assert len(metrics) == len((tmp_path / "full" / "metrics.jsonl").read_text().splitlines())


def test_orbax_checkpoints_of_a_model_axis_resume_bit_identically(tmp_path):
    (orb,) = _worker("orbax", str(tmp_path))["orbax"]
    assert orb["steps"] == [6, 6] and orb["identical"] and orb["moved"] > 1e-4
    assert orb["kept"] == ["3", "6"] and orb["native_files"] == []  # keep_checkpoints 3
    assert orb["load_run_diff"] == 0.0


@pytest.mark.slow
def test_two_processes_with_a_model_axis_checkpoint_with_orbax(tmp_path):
    """Parameters split over a model axis that spans both processes: `checkpointer: auto`
    picks orbax, and the result equals one process with the same mesh."""
    _worker("orbax", str(tmp_path))
    _two_processes(tmp_path, "model")
    (orb,) = _worker("compare_orbax", str(tmp_path / "orbax_full"), str(tmp_path / "mp_model"),
                     devices=1)["compare_orbax"]
    assert orb["steps"] == [6, 6] and orb["param_diff"] < 1e-3 * orb["moved"]
    assert not list((tmp_path / "mp_model").glob("ckpt-*"))  # no native file: orbax wrote


def test_mesh_errors():
    with pytest.raises(sf.config.ConfigError, match="needs 8 devices; there are 1"):
        _mesh.make_mesh({"data": 8})
    mesh = _mesh.make_mesh(None)
    assert dict(mesh.shape) == {"data": jax.device_count(), "model": 1}
    fake = _mesh.make_mesh({"data": 1})
    _mesh.check_batch_size(3, fake)
    with pytest.raises(sf.config.ConfigError, match="needs 2 devices"):
        _mesh.make_mesh({"data": 2, "model": 1})


def test_batch_not_divisible_by_the_data_axis_is_a_config_error():
    got = subprocess.run(
        [sys.executable, "-c",
         "import spinformer as sf\n"
         "from spinformer.train import _mesh\n"
         "m = _mesh.make_mesh({'data': 4})\n"
         "try:\n"
         "    _mesh.check_batch_size(6, m)\n"
         "except sf.config.ConfigError as e:\n"
         "    print('ERR', e)\n"],
        env=_env(4), capture_output=True, text=True, timeout=120)
    assert "ERR data.batch_size=6 is not divisible by the data axis of the mesh (4 devices)" \
        in got.stdout, got.stderr[-2000:]


def test_cli_several_processes_need_every_flag(tmp_path, capsys):
    from spinformer import cli

    code = cli.main(["run", "quickstart", "--out", str(tmp_path / "r"), "--coordinator",
                     "127.0.0.1:1", "--num-processes", "2"])
    err = capsys.readouterr().err
    assert code == 2 and "missing --process-id" in err and "Traceback" not in err
    code = cli.main(["run", "quickstart", "--out", str(tmp_path / "r"), "--coordinator",
                     "127.0.0.1:1", "--num-processes", "2", "--process-id", "2"])
    assert code == 2 and "--process-id 2 must be in [0, 2)" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()
