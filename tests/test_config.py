import dataclasses
import pathlib

import pytest

import spinformer._schema
from spinformer import config as C
from spinformer import nn, solvers

CONFIGS = sorted((pathlib.Path(__file__).parents[1] / "configs").glob("*.yaml"))


def test_defaults_and_help():
    cfg = C.load_config()
    assert cfg.train.steps == 1000 and str(cfg.model.attention.update) == "tap"
    text = C.describe() + C.reference_markdown()  # the default attention's, every other's
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
    cfg = C.load_config(None, ["train.steps=200", "train.lr=1e-3", "model.attention.update=mean_field",
                               "train.coupling_lr=null", "data.task=chars",
                               "data.max_chars=1000"])
    assert cfg.train.steps == 200 and cfg.train.lr == 1e-3
    assert str(cfg.model.attention.update) == "mean_field" and cfg.train.coupling_lr is None
    assert cfg.data.max_chars == 1000
    assert C.parse_overrides(["train.steps=5", "model.attention.beta=0.5", "train.steps=6"]) == {
        "train.steps": 6, "model.attention.beta": 0.5}


def test_replace_takes_typed_values():
    cfg = C.load_config()
    new = cfg.replace({"train.steps": 5, "model.attention": "boltzmann",
                       "model.attention.mode": "h", "train.lr": 1, "data.max_chars": None})
    assert new.train.steps == 5 and new.model.attention.mode == "h"
    assert new.train.lr == 1.0 and isinstance(new.train.lr, float)
    assert cfg.train.steps == 1000  # the original is unchanged
    # the same checks as a file, and the same code as load_config's overrides
    assert new == C.load_config(None, {"train.steps": 5, "model.attention": "boltzmann",
                                       "model.attention.mode": "h", "train.lr": 1.0,
                                       "data.max_chars": None})
    for changes, message in (({"train.steps": "5"}, "expected an integer"),
                             ({"train.stpes": 5}, "Did you mean 'train.steps'"),
                             ({"model.attention.update": "xx"}, "is not one of"),
                             ({"model.attention.mode": "h"}, "'h' is not one of"),
                             ({"train": 3}, "is a section"),
                             # a family's settings live in model.attention (as before 0.3)
                             ({"model.softmax.foo": 1}, "settings live in model.attention"),
                             ({"model.attention": "softmax", "model.attention.beta": 1},
                              "unknown config key 'model.attention.beta'"),
                             # a key that another task reads keeps its default
                             ({"data.path": "x.txt"}, "read only by data.task chars")):
        with pytest.raises(C.ConfigError, match=message):
            cfg.replace(changes)


def test_the_attention_is_an_object_like_a_solver():
    keys = C.keys(C.ModelConfig)
    assert keys["attention"].choices == nn.attention_names()
    assert keys["attention"].kind == "attention" and spinformer._schema.default_attention() == "spin"
    assert keys["attention"].default == nn.SpinConfig() and keys["attention"].is_section
    assert set(keys) == {f.name for f in dataclasses.fields(C.ModelConfig)}
    # a name, or a mapping of its name and settings; settings without a name are the default's
    cfg = C.load_config(None, {"model.attention": {"name": "boltzmann", "mode": "h"}})
    assert cfg.model.attention == nn.BoltzmannConfig(mode="h") and cfg.model.attention.name == "boltzmann"
    assert C.to_dict(cfg)["model"]["attention"]["name"] == "boltzmann"
    assert C.to_dict(C.load_config(None, ["model.attention=softmax"]))["model"]["attention"] == "softmax"
    # the settings belong to their attention: a new name starts from its defaults, and the
    # name it already has keeps them; a family's settings survive a change of solver class
    spin = C.load_config(None, ["model.attention.beta=3", "model.attention.solver.tol=1e-5"])
    assert spin.replace({"model.attention": "hopfield"}).model.attention == nn.HopfieldConfig()
    assert spin.replace({"model.attention": "spin"}) == spin
    assert spin.replace({"model.attention.name": "spin"}) == spin
    picard = spin.replace({"model.attention.solver.name": "picard"}).model.attention
    assert picard.beta == 3 and picard.solver == solvers.Picard(tol=1e-5, max_steps=30)
    # in Python: the settings object, or a name for its defaults
    assert C.ModelConfig(attention="boltzmann").attention == nn.BoltzmannConfig()
    with pytest.raises(C.ConfigError, match="settings object of a registered attention"):
        C.ModelConfig(attention=nn.BoltzmannConfig).attention  # the class, not an instance


def test_keys_another_task_reads():
    """A key that only some tasks read is left out of another task's config.yaml, and
    another task's config may not change it."""
    brackets = C.to_dict(C.load_config())
    assert "path" not in brackets["data"] and "pool" not in brackets["model"]
    assert "embed" not in brackets["model"] and "seq_len" in brackets["data"]
    pairs = C.to_dict(C.load_config(None, ["data.task=nli", "model.pool=cls"]))
    assert pairs["model"]["pool"] == "cls" and pairs["data"]["phenomena"]
    assert "seq_len" not in C.to_dict(C.load_config(None, ["data.task=digits"]))["data"]
    ngt = C.load_config(None, ["data.task=nli", "model.pool.name=neurogame",
                               "model.pool.gamma=0.5"])
    assert ngt.model.pool == nn.NeuroGameConfig(gamma=0.5)
    assert C.from_dict(C.to_dict(ngt)) == ngt
    with pytest.raises(C.ConfigError, match="model.pool='neurogame' is read only by data.task "
                                            "nli or snli; this config's data.task is brackets"):
        C.load_config(None, ["model.pool=neurogame"])


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
        assert m.attention == LateConfig() and m.attention.name == "late"
        cfg = C.load_config(None, ["model.attention=late", "model.attention.width=5"])
        assert cfg.model.attention.width == 5
        assert C.to_dict(cfg)["model"]["attention"] == {"name": "late", "width": 5}
        assert "`late` | `width: 3`" in C.reference_markdown()
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
        ("model.attention.bata=2", "'model.attention.beta'"),
        ("train.steps=many", "expected an integer"),
        ("model.attention.update=tapp", "Did you mean 'tap'"),
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
        (["model.attention.adjoint.name=phantom", "model.attention.adjoint.restart=7"],
         r"unknown config key 'model.attention.adjoint.restart'.* Valid keys here: "
         r"model.attention.adjoint.name, model.attention.adjoint.steps, model.attention.adjoint.damping\."),
        (["model.attention.solver.name=broyden", "model.attention.solver.damping=0.5"],
         r"unknown config key 'model.attention.solver.damping'"),
        (["model.attention.solver.damping=0.5", "model.attention.solver.name=broyden"],
         r"unknown config key 'model.attention.solver.damping'"),
        (["model.attention.solver.name=broyden", "model.attention.solver.unroll=true"],
         r"unknown config key 'model.attention.solver.unroll'"),
        (["model.attention=free_energy", "model.attention.adjoint.steps=3"],
         r"unknown config key 'model.attention.adjoint.steps'"),
    ],
)
def test_a_solver_key_its_solver_does_not_read_is_refused(overrides, message):
    """A solver or adjoint is an object whose keys are its class's fields: a key its class
    does not have is an error naming the keys it has, whatever the order of the overrides.
    A change of class keeps the settings of the family's default (or of the file) that the
    new class shares, and drops the others."""
    with pytest.raises(C.ConfigError, match=message):
        C.load_config(None, overrides)
    assert C.load_config(None, ["model.attention.adjoint.name=phantom"]).model.attention.adjoint == \
        solvers.Phantom()
    assert C.load_config(None, ["model.attention.solver=broyden"]).model.attention.solver == \
        solvers.Broyden(tol=1e-3, max_steps=30)  # spin's tolerance and budget, carried
    quick = C.load_config(CONFIGS[0].parent / "quickstart.yaml",
                          ["model.attention.solver.name=picard", "model.attention.solver.damping=0.3",
                           "model.attention.adjoint.linear_solver.name=dense"])
    assert quick.model.attention.solver == solvers.Picard(tol=1e-3, max_steps=30, damping=0.3)
    assert quick.model.attention.adjoint.linear_solver == solvers.Dense()
