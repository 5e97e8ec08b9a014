import dataclasses
import pathlib

import pytest

from spinformer import config as C

CONFIGS = sorted((pathlib.Path(__file__).parents[1] / "configs").glob("*.yaml"))


def test_defaults_and_help():
    cfg = C.load_config()
    assert cfg.train.steps == 1000 and cfg.model.spin.update == "tap"
    text = C.describe()
    for cls in (C.Config, C.DataConfig, C.ModelConfig, C.SpinConfig, C.TrainConfig):
        for f in dataclasses.fields(cls):
            assert f.metadata.get("help"), f"{cls.__name__}.{f.name} has no one-line meaning"
            assert f.name in text
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.train.steps = 3


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_shipped_configs_load(path):
    cfg = C.load_config(path)
    assert cfg.description, f"{path.name} needs a description"


def test_overrides():
    cfg = C.load_config(None, ["train.steps=200", "train.lr=1e-3", "model.spin.update=naive",
                               "train.coupling_lr=null", "data.max_chars=1000"])
    assert cfg.train.steps == 200 and cfg.train.lr == 1e-3
    assert cfg.model.spin.update == "naive" and cfg.train.coupling_lr is None
    assert cfg.data.max_chars == 1000
    assert cfg.replace(**{"train.steps": "5"}).train.steps == 5


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.stpes=3", "'train.steps'"),
        ("trian.steps=3", "'train'"),
        ("model.spin.bata=2", "'model.spin.beta'"),
        ("train.steps=many", "expected an integer"),
        ("model.spin.update=tapp", "Did you mean 'tap'"),
        ("train.progress=3", "true or false"),
        ("train=3", "is a section"),
        ("train.steps.x=3", "is a value"),
        ("model.dim=30", "not divisible"),
        ("steps", "KEY=VALUE"),
    ],
)
def test_errors_name_the_key(override, message):
    overrides = [override] + (["model.num_heads=4"] if override.startswith("model.dim") else [])
    with pytest.raises(C.ConfigError, match=message):
        C.load_config(None, overrides)


def test_yaml_errors(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("train:\n  step: 10\n")
    with pytest.raises(C.ConfigError, match="unknown config key 'train.step'. Did you mean 'train.steps'"):
        C.load_config(p)
    p.write_text("model: [1, 2]\n")
    with pytest.raises(C.ConfigError, match="mapping"):
        C.load_config(p)
    with pytest.raises(C.ConfigError, match="not found"):
        C.load_config(tmp_path / "missing.yaml")


def test_save_roundtrip(tmp_path):
    cfg = C.load_config(None, ["train.steps=7", "model.attention=softmax"])
    C.save_config(cfg, tmp_path / "c.yaml")
    assert C.load_config(tmp_path / "c.yaml") == cfg
