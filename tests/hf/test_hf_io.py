"""Reading an HF directory (hf/io.py HfDir): everything is checked before any weight is read."""

import dataclasses
import json
import shutil

import jax
import pytest
from hf_reference import FIXTURES, rewrite_header

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


def test_weight_files_must_be_the_directorys_own(tmp_path, capsys):
    """An index naming ../ or an absolute path, a shard that links out of the directory, a header with
    negative offsets: one line naming the file (and tensor), exit 2, nothing written; a Hugging Face
    hub snapshot's links into its blobs/ load."""
    shard = "model-00001-of-00003.safetensors"

    def copy(name):
        d = tmp_path / name
        shutil.copytree(FIXTURES / "qwen3", d)
        (tmp_path / f"{name}-outside").mkdir()
        shutil.move(d / shard, tmp_path / f"{name}-outside" / shard)
        return d

    def index(d, target):
        ix = json.loads((d / "model.safetensors.index.json").read_text())
        ix["weight_map"] = {k: target if v == shard else v for k, v in ix["weight_map"].items()}
        (d / "model.safetensors.index.json").write_text(json.dumps(ix))

    index(copy("dotdot"), f"../dotdot-outside/{shard}")
    index(copy("absolute"), str(tmp_path / "absolute-outside" / shard))
    (copy("link") / shard).symlink_to(tmp_path / "link-outside" / shard)
    for name, what in [("dotdot", "which is not a plain path inside"), ("absolute", "which is not a plain path"),
                       ("link", "a link out of")]:
        with pytest.raises(SystemExit) as e:
            cli.main(["import-hf", str(tmp_path / name), str(tmp_path / "out")])
        err = capsys.readouterr().err
        assert e.value.code == 2 and len(err.strip().splitlines()) == 1, err
        assert "model.safetensors.index.json names weight file" in err and shard in err and what in err, err
        assert not (tmp_path / "out").exists()
    shutil.copytree(FIXTURES / "qwen2", tmp_path / "negative")
    layernorm = "model.layers.0.input_layernorm.weight"
    rewrite_header(tmp_path / "negative" / "model.safetensors", lambda h: h[layernorm].update(data_offsets=[-72, -8]))
    with pytest.raises(SystemExit) as e:  # would read the header's JSON as weights
        cli.main(["import-hf", str(tmp_path / "negative"), str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.strip().splitlines()) == 1 and not (tmp_path / "out").exists(), err
    assert f"negative/model.safetensors: tensor {layernorm}: data_offsets [-72, -8] lie outside" in err, err
    hub = tmp_path / "models--x" / "snapshots" / "rev"  # huggingface_hub's cache: FILE -> ../../blobs/HASH
    shutil.copytree(FIXTURES / "qwen3", hub)
    (tmp_path / "models--x" / "blobs").mkdir()
    shutil.move(hub / shard, tmp_path / "models--x" / "blobs" / "hash")
    (hub / shard).symlink_to("../../blobs/hash")
    assert HfDir(hub).reader.shape("model.embed_tokens.weight")


def test_a_command_never_writes_into_its_source(tmp_path, capsys):
    """import-hf X X, export-hf X X, an output inside the source or around it: one line, exit 2."""
    shutil.copytree(FIXTURES / "qwen2", tmp_path / "hf")
    for argv, says in [(["import-hf", "hf", "hf"], "OUT_DIR hf is the source hf"),
                       (["import-hf", "hf", "hf/sub"], "OUT_DIR hf/sub is inside the source hf"),
                       (["export-hf", "hf", "hf"], "OUT_DIR hf is the source hf"),
                       (["export-hf", "hf/checkpoints/0", "hf"], "OUT_DIR hf holds the source hf/checkpoints/0")]:
        with pytest.raises(SystemExit) as e:
            cli.main([argv[0], *(str(tmp_path / a) for a in argv[1:])])
        err = capsys.readouterr().err.replace(f"{tmp_path}/", "")
        assert e.value.code == 2 and says in err and len(err.strip().splitlines()) == 1, err
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == sorted(p.name for p in (FIXTURES / "qwen2").iterdir())
