import os
import subprocess
import sys
import time

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
    ("checkpoint.max_to_keep=0", "checkpoint.max_to_keep: must be >= 1, got 0 (0 would delete every checkpoint"),
    ("checkpoint.keep_period=-2", "checkpoint.keep_period: must be >= 1, got -2"),
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
    ("train.seed=-1", "train.seed: must be between 0 and 2147483647, got -1"),
    ("train.seed=4294967296", "train.seed: must be between 0 and 2147483647, got 4294967296"),
    ("model.d_model=0", "model.d_model: must be > 0, got 0"),
    ("model.n_heads=0", "model.n_heads: must be > 0, got 0"),  # was a ZeroDivisionError
    ("model.vocab_size=-3", "model.vocab_size: must be > 0, got -3"),
    ("model.rope_scaling={factor: 0}", "model.rope_scaling.factor: must be > 0, got 0.0"),
    ("train.steps=99999999999999999999999",
     "train.steps: 99999999999999999999999 is out of range (an integer here is at most 9223372036854775807 in "
     "magnitude)"),
    ("train.steps=2147483648", "train.steps: must be at most 2147483647 (the optimizer counts steps in an int32)"),
    ("model.rope_theta=.nan", "model.rope_theta: must be a finite number, got nan"),
    ("optimizer.learning_rate=.inf", "optimizer.learning_rate: must be a finite number, got inf"),
    ("optimizer.b1=nan", "optimizer.b1: must be a finite number, got 'nan'"),  # a string YAML leaves to float()
    ("data.mixture=[{path: /a, weight: .nan}]", "data.mixture[0].weight: must be a finite number, got nan"),
    ("data.mixture=[{path: /a, weight: -.inf}]", "data.mixture[0].weight: must be a finite number, got -inf"),
    ("train.watchdog.hang_min_s=.inf", "train.watchdog.hang_min_s: must be a finite number, got inf"),
    ("checkpoint.allow_changes=[model.activaton]",
     "checkpoint.allow_changes: 'model.activaton' is not a config key; did you mean 'model.activation'?"),
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


def test_a_key_given_twice_is_said_and_the_last_one_wins():  # (the CLI prints these lines)
    overrides = ["train.steps=3", "train.log_every=2", "train.steps=5", "train.steps=7"]
    assert config.repeated(overrides) == ["train.steps is given 3 times ('3', then '5', then '7'); the last one wins"]
    assert config.load("meshes/demo.yaml", overrides).train.steps == 7
    assert config.repeated(["train.steps=3", "train.log_every=3"]) == []


def test_a_yaml_alias_bomb_is_refused_at_once_in_a_short_line(tmp_path):
    """9 levels of 9 aliases: 9^9 items that PyYAML shares by reference; their repr would be 3 GB."""
    levels = "abcdefghi"
    bomb = ", ".join(["&a [" + ", ".join(["lol"] * 9) + "]"] +
                     [f"&{c} [" + ", ".join([f"*{p}"] * 9) + "]" for p, c in zip(levels, levels[1:])])
    (tmp_path / "bomb.yaml").write_text(f"train:\n  steps: [{bomb}]\n")
    t0 = time.perf_counter()
    with pytest.raises(ConfigError) as e:
        config.load(str(tmp_path / "bomb.yaml"))
    assert time.perf_counter() - t0 < 1
    assert str(e.value).startswith("train.steps: expected int, got [['lol', 'lol', ") and len(str(e.value)) < 240


def test_a_directory_as_config_says_so(tmp_path):
    with pytest.raises(ConfigError, match="is a directory, not a YAML file"):
        config.load(str(tmp_path))


MOVED = [  # the 18 flat names that moved into a section, each with its new place
    *[(f"model.{n}", f"model.moe.{n}") for n in (
        "n_experts", "experts_per_token", "n_shared_experts", "shared_expert_d_ff", "shared_expert_gate",
        "norm_topk_prob", "capacity_factor", "router_aux_loss_coef", "router_z_loss_coef")],
    ("train.pipeline_schedule", "train.pipeline.schedule"), ("train.microbatches", "train.pipeline.microbatches"),
    ("train.pipeline_repeats", "train.pipeline.repeats"),
    *[(f"train.{n}", f"train.comm.{n}") for n in (
        "grad_reduce_dtype", "sync", "sync_every", "sync_axes", "outer_learning_rate", "outer_momentum")],
]


@pytest.mark.parametrize("old, new", MOVED, ids=[old for old, _ in MOVED])
def test_an_old_flat_name_says_where_it_moved(tmp_path, old, new):
    message = f"{old} moved to {new}"
    with pytest.raises(ConfigError) as e:
        config.load("meshes/demo.yaml", [f"{old}=1"])
    assert str(e.value) == message
    section, name = old.split(".")
    (tmp_path / "old.yaml").write_text(f"{section}:\n  {name}: 1\n")
    with pytest.raises(ConfigError) as e:
        config.load(str(tmp_path / "old.yaml"))
    assert str(e.value) == message


def test_an_old_flat_name_on_the_command_line_exits_2_with_one_line(tmp_path):
    result = subprocess.run([sys.executable, "-m", "shardtrain.cli", "train", "meshes/demo.yaml", "model.n_experts=4",
                             f"run_dir={tmp_path}"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().endswith("error: model.n_experts moved to model.moe.n_experts")
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr


def test_nested_sections_load_from_yaml_and_overrides(tmp_path):
    (tmp_path / "nested.yaml").write_text(
        "model:\n  moe: {n_experts: 4, experts_per_token: 1, capacity_factor: 1.5}\n"
        "train:\n  pipeline: {schedule: circular, repeats: 2}\n  comm: {sync: local_sgd, sync_axes: [data, fsdp]}\n")
    cfg = config.load(str(tmp_path / "nested.yaml"), [
        "model.moe.router_z_loss_coef=0", "train.pipeline.microbatches=8", "train.comm.sync_every=4",
        "train.comm.grad_reduce_dtype=bfloat16"])
    moe, pipe, comm = cfg.model.moe, cfg.train.pipeline, cfg.train.comm
    assert (moe.n_experts, moe.experts_per_token, moe.capacity_factor, moe.router_z_loss_coef) == (4, 1, 1.5, 0.0)
    assert (moe.norm_topk_prob, moe.router_aux_loss_coef) == (True, 0.01)  # untouched fields keep their defaults
    assert (pipe.schedule, pipe.repeats, pipe.microbatches) == ("circular", 2, 8)
    assert (comm.sync, comm.sync_axes, comm.sync_every, comm.grad_reduce_dtype) == (
        "local_sgd", ("data", "fsdp"), 4, "bfloat16")


@pytest.mark.parametrize("overrides, message", [
    (["model.moe.n_experts=4", "model.moe.experts_per_token=5"],
     "model.moe.experts_per_token=5 must be between 1 and model.moe.n_experts=4"),
    (["model.moe.capacity_factor=0"], "model.moe.capacity_factor=0.0 must be > 0"),
    (["train.pipeline.repeats=0"], "train.pipeline.repeats: must be >= 1, got 0"),
    (["train.comm.sync_every=0"], "train.comm.sync_every: must be >= 1, got 0"),
    (["train.comm.sync_axes=[data, slice]"], "train.comm.sync_axes: unknown mesh axis 'slice'"),
    (["train.pipeline.schedule=zigzag"], "train.pipeline.schedule: 'zigzag' is not one of: gpipe, circular"),
    (["train.comm.moo=1"], "unknown config key 'train.comm.moo'"),
])
def test_nested_fields_are_checked_under_their_new_names(overrides, message):
    with pytest.raises(ConfigError) as e:
        config.load("meshes/demo.yaml", overrides)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_head_size_is_head_dim_or_d_model_over_heads():
    assert config.ModelConfig(d_model=128, n_heads=4).head_size == 32
    assert config.ModelConfig(d_model=128, n_heads=4, head_dim=16).head_size == 16
