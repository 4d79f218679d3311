import os

import pytest

from shardtrain import config
from shardtrain.config import ConfigError


def test_demo_loads_with_overrides():
    cfg = config.load("meshes/demo.yaml", ["train.steps=7", "mesh.data=2", "mesh.tensor=4", "run_dir=/tmp/x",
                                           "rules.batch=[data]", "train.profile_steps=[2, 3]",
                                           "optimizer.learning_rate=1e-2"])
    assert (cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor) == (2, 2, 4)
    assert cfg.train.steps == 7 and cfg.run_dir == "/tmp/x" and cfg.name == "demo"
    assert cfg.rules.batch == ("data",) and cfg.train.profile_steps == (2, 3)
    assert cfg.optimizer.learning_rate == 0.01


def test_default_run_dir_is_runs_config_name_under_the_cwd():
    assert config.load("meshes/demo.yaml").run_dir == os.path.abspath("runs/demo")


def test_dump_round_trips(tmp_path):
    cfg = config.load("meshes/demo.yaml", ["train.steps=9", "rules.seq=tensor"])
    path = tmp_path / "resolved.yaml"
    path.write_text(config.dump(cfg))
    assert config.load(str(path)) == cfg


@pytest.mark.parametrize("override, message", [
    ("train.stpes=3", "unknown config key 'train.stpes'; did you mean 'steps'?"),
    ("trian.steps=3", "unknown config key 'trian'; did you mean 'train'?"),
    ("train.steps=many", "train.steps: expected int, got 'many'"),
    ("optimizer.learning_rate=fast", "optimizer.learning_rate: expected float, got 'fast'"),
    ("train.steps=0", "train.steps: must be >= 1, got 0"),
    ("train.remat=some", "train.remat: 'some' is not one of: none, full, dots, dots_no_batch"),
    ("rules.batch=[data, slice]", "rules.batch: unknown mesh axis 'slice'"),
    ("rules.embedding=fsdp", "unknown config key 'rules.embedding'; did you mean 'embed'?"),
    ("mesh.data=-1", "mesh: only one axis may be -1"),
    ("model.n_kv_heads=3", "model.n_kv_heads=3 must divide model.n_heads=4"),
    ("train.grad_accum_steps=5", "train.global_batch_size=32 is not divisible by train.grad_accum_steps=5"),
    ("steps", "override 'steps' is not KEY=VALUE"),
    ("checkpoint.writer_niceness=20", "checkpoint.writer_niceness: must be 0 (no change) to 19 (lowest priority), got 20"),
])
def test_bad_input_names_the_field(override, message):
    overrides = [override] if override != "mesh.data=-1" else ["mesh.data=-1", "mesh.fsdp=-1"]
    with pytest.raises(ConfigError) as e:
        config.load("meshes/demo.yaml", overrides)
    assert message in str(e.value)


def test_yaml_syntax_error(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("mesh:\n  data: [2\n")
    with pytest.raises(ConfigError, match="bad.yaml: YAML syntax error"):
        config.load(str(bad))


def test_missing_config_file():
    with pytest.raises(ConfigError, match="config file 'nope.yaml' does not exist"):
        config.load("nope.yaml")
