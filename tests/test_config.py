import dataclasses
import pathlib

import pytest

import spinformer._schema
from spinformer import config as C
from spinformer import nn, solvers

CONFIGS = sorted((pathlib.Path(__file__).parents[1] / "configs").glob("*.yaml"))


def test_defaults_and_help():
    cfg = C.load_config()
    assert cfg.train.steps == 1000 and str(cfg.model.spin.update) == "tap"
    text = C.describe()
    for cls in (C.Config, C.DataConfig, C.ModelConfig, C.TrainConfig,
                *(r.config for r in spinformer._schema.registrations() if r.config is not None)):
        for k in C.keys(cls).values():
            assert k.help, f"{cls.__name__}.{k.name} has no one-line meaning"
            assert k.name in text
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.train.steps = 3


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_shipped_configs_load(path):
    cfg = C.load_config(path)
    assert cfg.description, f"{path.name} needs a description"


def test_overrides():
    cfg = C.load_config(None, ["train.steps=200", "train.lr=1e-3", "model.spin.update=mean_field",
                               "train.coupling_lr=null", "data.max_chars=1000"])
    assert cfg.train.steps == 200 and cfg.train.lr == 1e-3
    assert str(cfg.model.spin.update) == "mean_field" and cfg.train.coupling_lr is None
    assert cfg.data.max_chars == 1000
    assert C.parse_overrides(["train.steps=5", "model.spin.beta=0.5", "train.steps=6"]) == {
        "train.steps": 6, "model.spin.beta": 0.5}


def test_replace_takes_typed_values():
    cfg = C.load_config()
    new = cfg.replace({"train.steps": 5, "model.attention": "boltzmann",
                       "model.boltzmann.mode": "h", "train.lr": 1, "data.max_chars": None})
    assert new.train.steps == 5 and new.model.boltzmann.mode == "h"
    assert new.train.lr == 1.0 and isinstance(new.train.lr, float)
    assert cfg.train.steps == 1000  # the original is unchanged
    # the same checks as a file, and the same code as load_config's overrides
    assert new == C.load_config(None, {"train.steps": 5, "model.attention": "boltzmann",
                                       "model.boltzmann.mode": "h", "train.lr": 1.0,
                                       "data.max_chars": None})
    for changes, message in (({"train.steps": "5"}, "expected an integer"),
                             ({"train.stpes": 5}, "Did you mean 'train.steps'"),
                             ({"model.spin.update": "xx"}, "is not one of"),
                             ({"model.boltzmann.mode": "h"}, "model.attention is spin"),
                             ({"train": 3}, "is a section"),
                             # a family without settings: said so, not another family's name
                             ({"model.softmax.foo": 1}, "softmax attention has no settings")):
        with pytest.raises(C.ConfigError, match=message):
            cfg.replace(changes)


def test_sections_come_from_the_registry():
    keys = C.keys(C.ModelConfig)
    assert keys["attention"].choices == nn.attention_names()
    assert keys["attention"].default == spinformer._schema.default_attention() == "spin"
    assert "spin" in keys and "boltzmann" in keys and "softmax" not in keys
    assert "sections" not in keys and "sections" not in C.to_dict(C.load_config())["model"]
    assert not hasattr(C.ModelConfig, "attention_kwargs")


def test_model_config_is_never_stale():
    """A `ModelConfig` imported before an attention is registered still knows it: the
    sections are read from the registry when a config is made, not when the module is."""
    import equinox as eqx

    from spinformer.config import ModelConfig

    @dataclasses.dataclass(frozen=True)
    class LateConfig:
        width: int = C.option(3, "a width")

    @nn.register_attention("late", config=LateConfig, help="registered late")
    class Late(eqx.Module):
        width: int = eqx.field(static=True)

        def __init__(self, dim, num_heads=1, causal=False, *, width=3, key=None):
            self.width = width

    try:
        m = ModelConfig(attention="late")
        assert m.late == LateConfig() and m.section() == LateConfig()
        cfg = C.load_config(None, ["model.attention=late", "model.late.width=5"])
        assert cfg.model.late.width == 5 and C.to_dict(cfg)["model"]["late"] == {"width": 5}
        assert "model.late.width = 3" in C.describe()
        assert C.from_dict(C.to_dict(cfg)) == cfg
    finally:
        spinformer._schema.unregister_attention("late")
    with pytest.raises(C.ConfigError, match="unknown config key 'model.late'"):
        C.load_config(None, ["model.late.width=5"])
    with pytest.raises(C.ConfigError, match="not one of"):
        C.load_config(None, ["model.attention=late"])


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


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["model.spin.adjoint.name=phantom", "model.spin.adjoint.restart=7"],
         r"unknown config key 'model.spin.adjoint.restart'.* Valid keys here: "
         r"model.spin.adjoint.name, model.spin.adjoint.steps, model.spin.adjoint.damping\."),
        (["model.spin.solver.name=broyden", "model.spin.solver.damping=0.5"],
         r"unknown config key 'model.spin.solver.damping'"),
        (["model.spin.solver.damping=0.5", "model.spin.solver.name=broyden"],
         r"unknown config key 'model.spin.solver.damping'"),
        (["model.spin.solver.name=broyden", "model.spin.solver.unroll=true"],
         r"unknown config key 'model.spin.solver.unroll'"),
        (["model.attention=free_energy", "model.free_energy.adjoint.steps=3"],
         r"unknown config key 'model.free_energy.adjoint.steps'"),
    ],
)
def test_a_solver_key_its_solver_does_not_read_is_refused(overrides, message):
    """A solver or adjoint is an object whose keys are its class's fields: a key its class
    does not have is an error naming the keys it has, whatever the order of the overrides.
    A change of class keeps the settings of the family's default (or of the file) that the
    new class shares, and drops the others."""
    with pytest.raises(C.ConfigError, match=message):
        C.load_config(None, overrides)
    assert C.load_config(None, ["model.spin.adjoint.name=phantom"]).model.spin.adjoint == \
        solvers.Phantom()
    assert C.load_config(None, ["model.spin.solver=broyden"]).model.spin.solver == \
        solvers.Broyden(tol=1e-3, max_steps=30)  # spin's tolerance and budget, carried
    quick = C.load_config(CONFIGS[0].parent / "quickstart.yaml",
                          ["model.spin.solver.name=picard", "model.spin.solver.damping=0.3",
                           "model.spin.adjoint.linear_solver.name=dense"])
    assert quick.model.spin.solver == solvers.Picard(tol=1e-3, max_steps=30, damping=0.3)
    assert quick.model.spin.adjoint.linear_solver == solvers.Dense()
