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
    ("checkpoint.writer_niceness=20",
     "checkpoint.writer_niceness: must be 0 (no change) to 19 (lowest priority), got 20"),
])
def test_bad_input_names_the_field(override, message):
    overrides = [override] if override != "mesh.data=-1" else ["mesh.data=-1", "mesh.fsdp=-1"]
    with pytest.raises(ConfigError) as e:
        config.load("meshes/demo.yaml", overrides)
    assert message in str(e.value)


def test_yaml_syntax_error(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("mesh:\n  data: [2\n")
    with pytest.raises(ConfigError, match=r"bad.yaml:3:1: YAML syntax error"):
        config.load(str(bad))


def test_missing_config_file():
    with pytest.raises(ConfigError, match="config file 'nope.yaml' does not exist"):
        config.load("nope.yaml")


@pytest.mark.parametrize("override, message", [
    ("train.profile_steps=[12, 10]",
     "train.profile_steps: [12, 10] must be [first, last] steps with 1 <= first <= last"),
    ("train.profile_steps=[0, 2]", "train.profile_steps: [0, 2] must be"),
    ("train.profile_steps=[190, 201]", "last <= train.steps=200"),
    ("optimizer.learning_rate=-1", "optimizer.learning_rate: must be > 0"),
    ("optimizer.learning_rate=0", "optimizer.learning_rate: must be > 0"),
    ("optimizer.b1=1", "optimizer.b1: must be in [0, 1)"),
    ("optimizer.b2=-0.1", "optimizer.b2: must be in [0, 1)"),
    ("optimizer.weight_decay=-0.1", "optimizer.weight_decay: must be >= 0"),
    ("optimizer.grad_clip=0", "optimizer.grad_clip: must be > 0"),
    ("optimizer.warmup_steps=-1", "optimizer.warmup_steps: must be >= 0"),
    ("optimizer.min_lr_ratio=1.5", "optimizer.min_lr_ratio: must be in [0, 1]"),
    ("optimizer.decay_steps=0", "optimizer.decay_steps: must be >= 1"),
])
def test_invalid_values_are_refused_at_load(override, message):
    with pytest.raises(ConfigError) as e:
        config.load("meshes/demo.yaml", [override])
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("text, message", [
    ("", "config file '{p}' is empty"),
    ("# only a comment\n", "config file '{p}' holds only comments"),
    ("mesh:\n  fsdp: [2\n", "{p}:3:1: YAML syntax error: while parsing a flow sequence expected ',' or ']'"),
    ("mesh:\n  data: 2\ntrain:\n  steps: 3\nmesh:\n  fsdp: 2\n", "{p}:5:1: duplicate key 'mesh'"),
    ("train:\n  steps: 3\n  steps: 4\n", "{p}:3:3: duplicate key 'steps'"),
    ("- a\n- b\n", "{p}: expected a mapping of sections"),
])
def test_unusable_config_files_name_the_file(tmp_path, text, message):
    p = tmp_path / "c.yaml"
    p.write_text(text)
    with pytest.raises(ConfigError) as e:
        config.load(str(p))
    assert message.format(p=p) in str(e.value) and "\n" not in str(e.value)
    assert "<unicode string>" not in str(e.value)


def test_a_directory_as_config_says_so(tmp_path):
    with pytest.raises(ConfigError, match="is a directory, not a YAML file"):
        config.load(str(tmp_path))


def test_run_dir_that_is_a_file_or_unwritable_is_refused(tmp_path):
    (tmp_path / "f").write_text("")
    with pytest.raises(ConfigError, match=f"run_dir={tmp_path}/f/run: '{tmp_path}/f' is a file, not a directory"):
        config.prepare_dir(str(tmp_path / "f" / "run"), "run_dir")
    with pytest.raises(ConfigError, match="run_dir=/proc/shardtrain-run: cannot write there"):
        config.prepare_dir("/proc/shardtrain-run", "run_dir")
    config.prepare_dir(str(tmp_path / "new" / "run"), "run_dir")
    assert (tmp_path / "new" / "run").is_dir() and not list((tmp_path / "new" / "run").iterdir())
