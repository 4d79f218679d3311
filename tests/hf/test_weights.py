"""Weight sources, import-hf and export-hf (shardtrain/weights.py), LoRA fine-tuning from an import."""

import dataclasses
import json

import jax
import numpy as np
import pytest
from hf_reference import FIXTURES, NEW_FAMILIES, our_logits, reference

import models
from shardtrain import cli, config, weights
from shardtrain.config import ConfigError
from shardtrain.hf import safetensors_io
from shardtrain.hf.config import model_config
from shardtrain.hf.io import HfDir, safetensors_files
from shardtrain.parallel import mesh as mesh_lib, sharding


def test_import_then_export_round_trips_bit_exactly(tmp_path, monkeypatch, capfd):
    src = FIXTURES / "qwen3"  # sharded with an index, bf16
    weights.import_hf(str(src), str(tmp_path / "imp"), say=lambda _: None)
    assert (tmp_path / "imp" / "config.yaml").exists() and (tmp_path / "imp" / "tokenizer.json").exists()
    written = (tmp_path / "imp" / "config.yaml").read_text()
    assert "name: imp-ft" in written  # runs go to runs/imp-ft
    assert "\n  name: qwen3\n" in written  # the model is named by its family, which runs announce
    with pytest.raises(SystemExit) as e:  # a run directory that is the import's own would resume from it
        cli.main(["train", str(tmp_path / "imp" / "config.yaml"), f"run_dir={tmp_path / 'imp'}"])
    assert e.value.code == 2
    monkeypatch.chdir(tmp_path)  # relative paths, as typed on a command line
    weights.export_hf("imp", "exp", max_shard_size="30KB", say=lambda _: None)
    console = capfd.readouterr()
    assert "absl" not in console.err + console.out  # Orbax's warnings went to the log beside checkpoints/
    assert "Metadata file does not exist" in (tmp_path / "imp" / "shardtrain.log").read_text()
    a = safetensors_io.Reader(safetensors_files(src))
    b = safetensors_io.Reader(safetensors_files(tmp_path / "exp"))
    assert sorted(a.names()) == sorted(b.names())
    for name in a.names():
        assert a.dtype(name) == b.dtype(name) and np.array_equal(a.get(name), b.get(name)), name
    assert (tmp_path / "exp" / "model.safetensors.index.json").exists()
    assert model_config(json.loads((tmp_path / "exp" / "config.json").read_text())) == HfDir(src).model


def round_trip(src, tmp_path):
    """import-hf then export-hf of `src`: every tensor comes back bit for bit; the export's directory."""
    weights.import_hf(str(src), str(tmp_path / "imp"), say=lambda _: None)
    weights.export_hf(str(tmp_path / "imp"), str(tmp_path / "exp"), say=lambda _: None)
    a = safetensors_io.Reader(safetensors_files(src))
    b = safetensors_io.Reader(safetensors_files(tmp_path / "exp"))
    assert sorted(a.names()) == sorted(b.names())
    for name in a.names():
        assert a.dtype(name) == b.dtype(name) and np.array_equal(a.get(name), b.get(name)), name
    return tmp_path / "exp"


def test_moe_import_then_export_round_trips_bit_exactly(tmp_path):
    round_trip(FIXTURES / "qwen2_moe", tmp_path)  # per-expert tensors, a gated shared expert, qkv bias


@pytest.mark.parametrize("family", [*NEW_FAMILIES, "deepseek_v3", "deepseek_v3_full_q", "deepseek_v3_yarn", "llama4"])
def test_new_families_import_then_export_round_trip_bit_exactly(tmp_path, family):
    """Every tensor (OLMo 2's post-norms and whole-projection qk-norm weights, Gemma's four norms a
    layer and tied embeddings, DeepSeek-V3's latent attention with its interleaved rotary channels,
    dense and MoE layers, router bias) and the config.json (layer kinds, soft caps, Gemma 3's rope per
    layer kind, DeepSeek's ranks and routing)."""
    src = FIXTURES / family
    exported = json.loads((round_trip(src, tmp_path) / "config.json").read_text())
    assert model_config(exported) == HfDir(src).model
    original = json.loads((src / "config.json").read_text())
    assert {k: exported.get(k) for k in original} == original


@pytest.mark.slow
def test_lora_fine_tune_from_import_then_merged_export(tmp_path, capsys):
    """`train` with checkpoint.init_from an imported Qwen2 (tied embeddings, qkv bias) and LoRA
    on a 2x2x2 mesh: after a few steps only adapter parameters differ from the import, and the
    merged export computes what the adapted model computes (our Qwen2 equals transformers':
    tests/hf/test_hf_parity.py)."""
    weights.import_hf(str(FIXTURES / "qwen2"), str(tmp_path / "imp"), say=lambda _: None)
    run = tmp_path / "run"
    mesh = ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"]
    with pytest.raises(SystemExit) as e:
        cli.main(["train", str(tmp_path / "imp" / "config.yaml"), f"run_dir={run}", "train.steps=3",
                  "data.source=synthetic", "data.seq_len=16", "train.global_batch_size=8", *mesh,
                  "train.compile_cache=false",
                  "model.lora.rank=4", "model.lora.targets=[q_proj,v_proj,wo_hed,w_up_df]",
                  "optimizer.learning_rate=1e-2", "optimizer.warmup_steps=1"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "starting from the weights of" in out
    # per layer, rank 4 x (in + out): q 32 + 32, v 32 + 16 (2 kv heads of 8), o 32 + 32, up 32 + 64; 2 layers
    trainable = 2 * 4 * ((32 + 32) + (32 + 16) + (32 + 32) + (32 + 64))
    assert "shardtrain: qwen2, " in out and f", {trainable / 1e3:.1f}K (" in out
    assert "trainable: LoRA rank 4, alpha 16 on q_proj, v_proj, wo_hed, w_up_df (the other " in out
    trained, imported = weights.find(run), weights.find(tmp_path / "imp")
    layout = weights.fsdp_layout(weights.run_config_of(trained))
    after = jax.tree.map(np.asarray, trained.params(layout.params))
    base, adapters = weights.split_adapters(after)
    before = jax.tree.map(np.asarray, imported.params(weights.split_adapters(layout.params)[0]))
    assert jax.tree.all(jax.tree.map(np.array_equal, base, before))  # the base is frozen
    assert sorted(adapters["blocks"]) == sorted(f"{w}_lora_{x}" for w in ("wq_dhe", "wv_dke", "wo_hed", "w_up_df")
                                                for x in "ab")
    assert all(np.abs(b).max() > 0 for k, b in adapters["blocks"].items() if k.endswith("_b"))  # B left zero
    weights.export_hf(str(run), str(tmp_path / "exp"), dtype="float32", say=lambda _: None)
    tokens = np.tile(np.array(reference("qwen2")[0]["tokens"], np.int32), (2, 1))
    adapted = our_logits(trained, tokens, mesh)
    merged = our_logits(weights.find(tmp_path / "exp"), tokens, mesh)
    original = our_logits(imported, tokens, mesh)
    assert np.abs(adapted - merged).max() < 1e-4
    assert np.abs(adapted - original).max() > 1e-3


def test_lora_config_mistakes():
    """The config checks the adapter settings; the model says which weights it has (checked when the
    layout is built, before anything is compiled)."""
    def check(*overrides):
        sharding.check_adapters(config.load(None, ["model.lora.rank=4", *overrides]))
    with pytest.raises(ConfigError, match="model.lora.targets: unknown weight 'q' for this model; choose from wq_dhe"):
        check("model.lora.targets=[q,wq_dhe]")
    with pytest.raises(ConfigError, match="model.lora.targets: unknown weight 'q'"):
        sharding.abstract_model(config.load(None, ["model.lora.rank=4", "model.lora.targets=[q]"]))
    with pytest.raises(ConfigError, match="unknown weight 'wk_dke' for this model; choose from wq_dhe, wo_hed, "):
        check("model.mla.kv_lora_rank=8", "model.lora.targets=[wk_dke]")
    with pytest.raises(ConfigError, match=r"unknown weight 'up_proj' for this model; choose from wq_dhe, wk_dke, "
                                          r"wv_dke, wo_hed \(or q_proj"):
        check("model.moe.n_experts=4", "model.lora.targets=[up_proj]")
    with pytest.raises(ConfigError, match="model.name=mlp has no weights LoRA can adapt"):
        check("model.name=mlp")
    with pytest.raises(ConfigError, match="model.lora.rank > 0 needs train.comm.sync=every_step"):
        config.load(None, ["model.lora.rank=4", "train.comm.sync=local_sgd"])
    model = config.load(None, ["model.lora.rank=4", "model.lora.targets=[q_proj,w_up_df]"]).model
    assert models.adapted_weights(model) == ("wq_dhe", "w_up_df")
    check("model.lora.targets=[q_proj,w_up_df]")  # passes
    sharding.check_adapters(config.load(None, ["model.name=mlp"]))  # rank 0: nothing adapted, nothing to check


def test_find_reads_each_safetensors_header_once(monkeypatch):
    """weights.find checks the HF directory and its parameters come from that one reading."""
    read = []
    real = safetensors_io.read_header
    monkeypatch.setattr(safetensors_io, "read_header", lambda path: read.append(path.name) or real(path))
    source = weights.find(FIXTURES / "qwen3")  # three shards
    cfg = config.load(None, ["run_dir=/tmp/unused", "train.global_batch_size=8"])
    cfg = dataclasses.replace(cfg, model=source.model)
    params = source.params(sharding.param_layout(cfg, mesh_lib.make_mesh(cfg.mesh, jax.devices()[:1])).params)
    assert sorted(read) == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    want = safetensors_io.Reader(safetensors_files(FIXTURES / "qwen3")).get("model.norm.weight")
    assert np.array_equal(np.asarray(params["final_norm"]), want)
