"""Reading an HF directory (hf/io.py HfDir): everything is checked before any weight is read."""

import dataclasses
import json
import shutil

import jax
import pytest
from hf_reference import FIXTURES

from shardtrain import cli, config, step, weights
from shardtrain.config import ConfigError
from shardtrain.hf.io import HfDir
from shardtrain.parallel import mesh as mesh_lib


def test_bad_hf_directories_fail_before_any_work(tmp_path):
    def copy(family):
        d = tmp_path / family
        shutil.copytree(FIXTURES / family, d, dirs_exist_ok=True)
        return d
    d = copy("llama")
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ConfigError, match="'GPT2LMHeadModel' is not supported; supported: LlamaForCausalLM, "
                                          "MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM"):
        HfDir(d)
    (d / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 96}))
    with pytest.raises(ConfigError, match=r"model.layers.0.mlp.gate_proj.weight: weights \(64, 32\), "
                                          r"config.json implies \(96, 32\)"):
        HfDir(d)
    d = copy("qwen3")
    (d / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(ConfigError, match="lists 3 shards but model-00002-of-00003.safetensors is missing"):
        HfDir(d)
    with pytest.raises(SystemExit) as e:
        cli.main(["import-hf", str(d), str(tmp_path / "out")])
    assert e.value.code == 2 and not (tmp_path / "out").exists()
    source = weights.find(FIXTURES / "llama")  # checkpoint.init_from an HF dir with another model config
    cfg = config.load(None, [f"run_dir={tmp_path / 'run'}", "train.global_batch_size=8"])
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(source.model, d_ff=96))
    prog = step.build(cfg, mesh_lib.make_mesh(cfg.mesh, jax.devices()[:1]))
    with pytest.raises(ConfigError, match=r"gate_proj.weight: weights \(64, 32\), the model config implies \(96, 32\)"):
        weights.initial_state(prog, source)
