"""What a resume says about the config changes since its checkpoint (diagnose.check_changes): a change
to the model's function or to the data stream is refused in one line naming the field and both values,
unless checkpoint.allow_changes names it; every other change is said in one line."""

import json

import pytest

from shardtrain import config
from shardtrain.checkpoint import diagnose
from shardtrain.config import ConfigError

BASE = ["data.source=tokens", "data.path=/data/a", "run_dir=/runs/r"]


def resumed_from(*overrides) -> dict:
    """A checkpoint's meta as the run saved it (its config through JSON) after 2 steps."""
    saved = config.load("meshes/demo.yaml", [*BASE, *overrides])
    return {"step": 2, "config": json.loads(json.dumps(config.to_dict(saved)))}


def check(resumed: dict, *overrides) -> list[str]:
    said = []
    diagnose.check_changes(config.load("meshes/demo.yaml", [*BASE, *overrides]), resumed, "/runs/r/checkpoints",
                           said.append)
    return said


@pytest.mark.parametrize("before, after, named", [
    ([], ["model.activation=gelu_tanh"], "the model's function: model.activation silu -> gelu_tanh"),
    ([], ["model.rope_theta=500"], "the model's function: model.rope_theta 10000.0 -> 500.0"),
    ([], ["model.rope_scaling={type: linear, factor: 2}"],
     "model.rope_scaling None -> {'attention_factor': None, 'beta_fast': 32.0, 'beta_slow': 1.0, 'factor': 2.0, "),
    (["model.rope_scaling={type: linear, factor: 2}"], ["model.rope_scaling={type: linear, factor: 4}"],
     "model.rope_scaling.factor 2.0 -> 4.0"),
    ([], ["model.norm_position=pre_post"], "model.norm_position pre -> pre_post"),
    ([], ["model.layer_pattern=[local, global]", "model.sliding_window=8"],
     "model.sliding_window None -> 8, model.layer_pattern [] -> ['local', 'global']"),
    ([], ["model.lora.alpha=32"], "model.lora.alpha 16.0 -> 32.0"),
    ([], ["model.moe.capacity_factor=1.5"], "model.moe.capacity_factor None -> 1.5"),
    ([], ["train.seed=7"], "the data stream: train.seed 0 -> 7"),
    ([], ["data.seq_len=32"], "the data stream: data.seq_len 128 -> 32"),
    ([], ["data.path=/data/b"], "the data stream: data.path /data/a -> /data/b"),
    (["data.path=null", "data.mixture=[{path: /a, weight: 1}, {path: /b, weight: 1}]"],
     ["data.path=null", "data.mixture=[{path: /a, weight: 1}, {path: /b, weight: 3}]"],
     "data.mixture [{'path': '/a', 'weight': 1.0}, {'path': '/b', 'weight': 1.0}] -> [{'path': '/a', 'weight': 1.0}, "
     "{'path': '/b', 'weight': 3.0}]"),
    ([], ["model.activation=gelu_tanh", "train.seed=7", "train.log_every=2"],
     "would change the model's function and the data stream: model.activation silu -> gelu_tanh, train.seed 0 -> 7; "
     "to do it on purpose, allow it (checkpoint.allow_changes=[model.activation,train.seed]) or start a new run from "
     "these weights (checkpoint.init_from=/runs/r/checkpoints/2 run_dir=NEW_DIR)"),
])
def test_a_new_function_or_data_stream_is_refused_naming_the_field_and_both_values(before, after, named):
    resumed = resumed_from(*before)
    with pytest.raises(ConfigError) as e:
        check(resumed, *after)
    assert str(e.value).startswith("resuming from checkpoint step 2 in /runs/r/checkpoints would change ")
    assert named in str(e.value) and "\n" not in str(e.value)


def test_allowed_changes_are_said_instead():
    resumed = resumed_from("model.rope_scaling={type: linear, factor: 2}")
    assert check(resumed, "model.activation=gelu_tanh", "model.rope_scaling={type: linear, factor: 4}",
                 "train.log_every=2", "checkpoint.allow_changes=[model.activation, model.rope_scaling]") == [
        "changed since step 2: model.rope_scaling.factor (allowed) 2.0 -> 4.0, model.activation (allowed) "
        "silu -> gelu_tanh, train.log_every 1 -> 2"]
    with pytest.raises(ConfigError, match=r"the data stream: train.seed 0 -> 7; .*allow_changes=\[train.seed\]"):
        check(resumed, "model.rope_scaling={type: linear, factor: 2}", "model.activation=gelu_tanh", "train.seed=7",
              "checkpoint.allow_changes=[model.activation]")


@pytest.mark.parametrize("after, line", [
    (["train.log_every=2", "train.steps=400"], "changed since step 2: train.steps 200 -> 400, train.log_every 1 -> 2"),
    (["mesh.data=1", "mesh.fsdp=8", "mesh.tensor=1"], "changed since step 2: mesh.data -1 -> 1, mesh.fsdp 2 -> 8, "
                                                      "mesh.tensor 2 -> 1"),
    (["train.quantization=int8", "train.compute_dtype=bfloat16", "model.attention=chunked"],
     "changed since step 2: model.attention auto -> chunked, train.compute_dtype float32 -> bfloat16, "
     "train.quantization none -> int8"),
    (["run_dir=/runs/copy"], "changed since step 2: run_dir /runs/r -> /runs/copy"),
    (["model.moe.router_aux_loss_coef=0.1"], "changed since step 2: model.moe.router_aux_loss_coef 0.01 -> 0.1"),
    (["optimizer.weight_decay=0"], "changed since step 2: optimizer.weight_decay 0.1 -> 0.0"),
])
def test_other_changes_are_said_in_one_line(after, line):
    assert check(resumed_from(), *after) == [line]


def test_what_is_said_elsewhere_or_unchanged_is_not_listed():
    resumed = resumed_from()
    assert check(resumed) == []
    assert check(resumed, "optimizer.learning_rate=1e-3", "optimizer.warmup_steps=5") == []  # the lr line: re-planned
    resumed["config"]["model"].pop("activation")  # written before the field existed: no difference
    resumed["config"]["model"]["gone"] = 1  # a field since removed: none either
    assert check(resumed) == []
    diagnose.check_changes(config.load("meshes/demo.yaml", BASE), None, "/runs/r/checkpoints")  # a fresh start
