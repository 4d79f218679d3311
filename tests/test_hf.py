"""Hugging Face models in and out, against what transformers computes.

tests/fixtures/hf/<family>/ holds a tiny random model per supported family, saved by
transformers, with transformers' logits and greedy generation (tests/fixtures/make_hf_fixtures.py
made them; the one slow test here remakes them when torch is installed). Llama uses llama3 rope
scaling, Qwen2 qkv biases and tied embeddings, Qwen3 qk-norm, head_dim 16 != 32/4 and a
sharded checkpoint with an index. The mixtures of experts (4 experts, top 2): Mixtral, Qwen2-MoE
with a gated shared expert and unnormalised top-k weights, Qwen3-MoE; their sharded parity runs
on an expert-parallel 2x2x2 mesh (expert x fsdp x tensor).
"""

import dataclasses
import json
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from shardtrain import cli, config, generate, hf, mesh as mesh_lib, safetensors_io, sharding, step, weights
from shardtrain.config import ConfigError

FIXTURES = Path(__file__).parent / "fixtures" / "hf"
MOE_FAMILIES = ["mixtral", "qwen2_moe", "qwen3_moe"]
FAMILIES = ["llama", "mistral", "qwen2", "qwen3", *MOE_FAMILIES]


def reference(family):
    d = FIXTURES / family
    return json.loads((d / "reference.json").read_text()), np.load(d / "reference_logits.npy")


def our_logits(source, tokens_bt, mesh_overrides, devices=None, run_dir="/tmp/unused"):
    """Our model's logits for `source`'s weights on a mesh."""
    cfg = config.load(None, [*mesh_overrides, "train.global_batch_size=8", f"run_dir={run_dir}"])
    cfg = dataclasses.replace(cfg, model=source.model)
    layout = sharding.param_layout(cfg, mesh_lib.make_mesh(cfg.mesh, devices))
    params = source.params(layout.params)
    out = jax.jit(lambda p, t: nnx.merge(layout.graphdef, p)(t))(params, tokens_bt)
    return np.asarray(out[0] if isinstance(out, tuple) else out)  # an MoE model: (logits, aux losses)


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_equal_transformers_on_2x2x2_mesh_and_one_device(family):
    ref, want = reference(family)
    source = weights.find(FIXTURES / family)
    tokens = np.tile(np.array(ref["tokens"], np.int32), (2, 1))  # 4 rows: the batch splits over data x fsdp
    split = "mesh.expert=2" if family in MOE_FAMILIES else "mesh.data=2"
    sharded = our_logits(source, tokens, [split, "mesh.fsdp=2", "mesh.tensor=2"])[:2]
    single = our_logits(source, tokens[:2], [], devices=jax.devices()[:1])
    assert np.abs(sharded - want).max() < 1e-4
    assert np.abs(single - want).max() < 1e-4
    assert np.abs(sharded - single).max() < 1e-5 * np.abs(want).max()  # logits up to ~8: reduction order


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3", "mixtral"])
def test_greedy_generation_equals_transformers(family):
    ref, _ = reference(family)
    gen = generate.Generator.from_source(FIXTURES / family)
    assert gen.encode(ref["prompt"]) == ref["prompt_ids"]
    short = ref["prompt_ids"][4:]
    out = gen.generate([ref["prompt_ids"], short], 20, stop_at_eos=False)
    assert out[0] == ref["new_ids"]
    stopped = gen.generate([ref["prompt_ids"], short], 20)  # EOS (id 0) ends a row, EOS included
    eos_at = ref["new_ids"].index(0) + 1 if 0 in ref["new_ids"] else 20
    assert stopped[0] == ref["new_ids"][:eos_at]
    if family in ("llama", "mistral"):  # the left-padded row generates what it does alone (window too)
        assert out[1] == gen.generate([short], 20, stop_at_eos=False)[0]


def test_generate_command_json_and_streaming(capsys):
    ref, _ = reference("llama")
    args = ["--prompt", ref["prompt"], "--max-new-tokens", "20"]
    for extra in (["--json"], []):
        with pytest.raises(SystemExit) as e:
            cli.main(["generate", str(FIXTURES / "llama"), *([] if extra else ["mesh.fsdp=4", "mesh.tensor=2"]),
                      *args, *extra])
        assert e.value.code == 0
    json_out, text_out = capsys.readouterr().out.split("\n", 1)
    got = json.loads(json_out)
    assert got["prompt_ids"] == ref["prompt_ids"] and got["generated_ids"] == ref["new_ids"]
    assert text_out == ref["prompt"] + got["text"] + "\n"


def test_sampling_is_seeded_and_top_p_keeps_the_smallest_set_reaching_p():
    logits_bv = np.log(np.array([[0.5, 0.3, 0.15, 0.05]] * 4000, np.float32))

    def draw(top_p, seed):
        return np.asarray(generate.sample(logits_bv, jax.random.key(seed), 1.0, top_p))
    counts = np.bincount(draw(1.0, 0), minlength=4) / 4000
    assert np.abs(counts - [0.5, 0.3, 0.15, 0.05]).max() < 0.03
    assert set(draw(0.7, 0)) == {0, 1} and set(draw(0.8, 0)) == {0, 1} and set(draw(0.81, 0)) == {0, 1, 2}
    assert set(draw(0.2, 0)) == {0}
    assert np.array_equal(draw(0.9, 1), draw(0.9, 1)) and not np.array_equal(draw(0.9, 1), draw(0.9, 2))


def test_import_then_export_round_trips_bit_exactly(tmp_path, monkeypatch):
    src = FIXTURES / "qwen3"  # sharded with an index, bf16
    weights.import_hf(str(src), str(tmp_path / "imp"), say=lambda _: None)
    assert (tmp_path / "imp" / "config.yaml").exists() and (tmp_path / "imp" / "tokenizer.json").exists()
    assert "name: imp-ft" in (tmp_path / "imp" / "config.yaml").read_text()  # runs go to runs/imp-ft
    with pytest.raises(SystemExit) as e:  # a run directory that is the import's own would resume from it
        cli.main(["train", str(tmp_path / "imp" / "config.yaml"), f"run_dir={tmp_path / 'imp'}"])
    assert e.value.code == 2
    monkeypatch.chdir(tmp_path)  # relative paths, as typed on a command line
    weights.export_hf("imp", "exp", max_shard_size="30KB", say=lambda _: None)
    a = safetensors_io.Reader(hf.safetensors_files(src))
    b = safetensors_io.Reader(hf.safetensors_files(tmp_path / "exp"))
    assert sorted(a.names()) == sorted(b.names())
    for name in a.names():
        assert a.dtype(name) == b.dtype(name) and np.array_equal(a.get(name), b.get(name)), name
    assert (tmp_path / "exp" / "model.safetensors.index.json").exists()
    assert hf.model_config(json.loads((tmp_path / "exp" / "config.json").read_text())) == hf.Source(src).model


def test_moe_import_then_export_round_trips_bit_exactly(tmp_path):
    src = FIXTURES / "qwen2_moe"  # per-expert tensors, a gated shared expert, qkv bias
    weights.import_hf(str(src), str(tmp_path / "imp"), say=lambda _: None)
    weights.export_hf(str(tmp_path / "imp"), str(tmp_path / "exp"), say=lambda _: None)
    a = safetensors_io.Reader(hf.safetensors_files(src))
    b = safetensors_io.Reader(hf.safetensors_files(tmp_path / "exp"))
    assert sorted(a.names()) == sorted(b.names())
    for name in a.names():
        assert a.dtype(name) == b.dtype(name) and np.array_equal(a.get(name), b.get(name)), name
    for family in MOE_FAMILIES:  # each MoE config comes back as its own family's config.json
        m = hf.Source(FIXTURES / family).model
        assert hf.model_config(hf.hf_config(m)) == m
        assert hf.hf_config(m)["architectures"] == hf.read_config(FIXTURES / family)["architectures"]


def test_config_json_in_both_rope_forms():
    new = json.loads((FIXTURES / "llama" / "config.json").read_text())  # transformers 5: rope_parameters
    old = {k: v for k, v in new.items() if k != "rope_parameters"}  # published Llama 3.1 files
    old.update(rope_theta=500000.0, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 16})
    m = hf.model_config(new)
    assert m == hf.model_config(old)
    assert m.rope_theta == 500000.0 and m.rope_scaling == config.RopeScalingConfig(
        type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=16)
    assert hf.model_config(hf.hf_config(m)) == m


def test_published_config_files_map_to_our_fields():
    """config.json of published models (the fields that matter, as on the Hub in 2025)."""
    llama31_8b = {"architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
                  "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-5,
                  "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 8192, "rope_type": "llama3"},
                  "rope_theta": 500000.0, "tie_word_embeddings": False, "vocab_size": 128256, "hidden_act": "silu",
                  "attention_bias": False, "mlp_bias": False, "torch_dtype": "bfloat16",
                  "eos_token_id": [128001, 128008, 128009]}
    m = hf.model_config(llama31_8b)
    assert (m.d_model, m.n_heads, m.n_kv_heads, m.head_dim, m.d_ff) == (4096, 32, 8, None, 14336)
    assert m.rope_scaling.factor == 8.0 and m.rope_theta == 500000.0
    qwen25_7b = {"architectures": ["Qwen2ForCausalLM"], "hidden_size": 3584, "intermediate_size": 18944,
                 "num_attention_heads": 28, "num_hidden_layers": 28, "num_key_value_heads": 4, "rms_norm_eps": 1e-6,
                 "rope_theta": 1000000.0, "sliding_window": 131072, "use_sliding_window": False,
                 "tie_word_embeddings": False, "vocab_size": 152064, "hidden_act": "silu", "rope_scaling": None}
    m = hf.model_config(qwen25_7b)
    assert m.qkv_bias and not m.qk_norm and m.rope_scaling is None and m.head_dim is None
    qwen3_8b = {"architectures": ["Qwen3ForCausalLM"], "hidden_size": 4096, "intermediate_size": 12288, "head_dim": 128,
                "num_attention_heads": 32, "num_hidden_layers": 36, "num_key_value_heads": 8, "rms_norm_eps": 1e-6,
                "rope_theta": 1000000, "tie_word_embeddings": False, "vocab_size": 151936, "attention_bias": False}
    assert hf.model_config(qwen3_8b).qk_norm
    mistral = {"architectures": ["MistralForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
               "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-5,
               "rope_theta": 1000000.0, "sliding_window": None, "vocab_size": 32768, "head_dim": 128}
    assert hf.model_config(mistral).head_dim is None  # 128 = 4096 / 32
    mixtral_8x7b = {"architectures": ["MixtralForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
                    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
                    "num_local_experts": 8, "num_experts_per_tok": 2, "rms_norm_eps": 1e-5, "rope_theta": 1e6,
                    "router_aux_loss_coef": 0.02, "sliding_window": None, "vocab_size": 32000}
    m = hf.model_config(mixtral_8x7b)
    assert (m.n_experts, m.experts_per_token, m.d_ff, m.norm_topk_prob, m.n_shared_experts) == (8, 2, 14336, True, 0)
    qwen15_moe = {"architectures": ["Qwen2MoeForCausalLM"], "hidden_size": 2048, "intermediate_size": 5632,
                  "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632, "num_experts": 60,
                  "num_experts_per_tok": 4, "norm_topk_prob": False, "decoder_sparse_step": 1,
                  "mlp_only_layers": [], "num_attention_heads": 16, "num_hidden_layers": 24,
                  "num_key_value_heads": 16, "rope_theta": 1e6, "vocab_size": 151936}
    m = hf.model_config(qwen15_moe)
    assert (m.n_experts, m.d_ff, m.shared_expert_d_ff, m.shared_expert_gate, m.norm_topk_prob, m.qkv_bias) == (
        60, 1408, 5632, True, False, True)
    qwen3_30b_a3b = {**qwen3_8b, "architectures": ["Qwen3MoeForCausalLM"], "num_experts": 128,
                     "num_experts_per_tok": 8, "moe_intermediate_size": 768, "norm_topk_prob": True,
                     "decoder_sparse_step": 1, "mlp_only_layers": []}
    m = hf.model_config(qwen3_30b_a3b)
    assert (m.n_experts, m.experts_per_token, m.d_ff, m.qk_norm, m.n_shared_experts) == (128, 8, 768, True, 0)
    with pytest.raises(ConfigError, match="dense layers between MoE layers are not supported"):
        hf.model_config({**qwen3_30b_a3b, "mlp_only_layers": [0]})
    mistral_v01 = hf.model_config({**mistral, "sliding_window": 4096})
    assert mistral_v01.sliding_window == 4096 and hf.model_config(hf.hf_config(mistral_v01)) == mistral_v01
    assert hf.model_config(qwen25_7b).sliding_window is None  # use_sliding_window false
    qwen_windowed = hf.model_config({**qwen25_7b, "use_sliding_window": True, "max_window_layers": 0})
    assert qwen_windowed.sliding_window == 131072 and hf.model_config(hf.hf_config(qwen_windowed)) == qwen_windowed
    with pytest.raises(ConfigError, match="20 of 28 layers use sliding_window=131072 and the others full"):
        hf.model_config({**qwen25_7b, "use_sliding_window": True, "max_window_layers": 8})
    with pytest.raises(ConfigError, match="rope type 'yarn' is not supported"):
        hf.model_config({**qwen25_7b, "rope_scaling": {"type": "yarn", "factor": 4.0}})


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
        hf.Source(d)
    (d / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 96}))
    with pytest.raises(ConfigError, match=r"model.layers.0.mlp.gate_proj.weight: weights \(64, 32\), "
                                          r"config.json implies \(96, 32\)"):
        hf.Source(d)
    d = copy("qwen3")
    (d / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(ConfigError, match="lists 3 shards but model-00002-of-00003.safetensors is missing"):
        hf.Source(d)
    with pytest.raises(SystemExit) as e:
        cli.main(["import-hf", str(d), str(tmp_path / "out")])
    assert e.value.code == 2 and not (tmp_path / "out").exists()
    source = weights.find(FIXTURES / "llama")  # checkpoint.init_from an HF dir with another model config
    cfg = config.load(None, [f"run_dir={tmp_path / 'run'}", "train.global_batch_size=8"])
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(source.model, d_ff=96))
    prog = step.build(cfg, mesh_lib.make_mesh(cfg.mesh, jax.devices()[:1]))
    with pytest.raises(ConfigError, match=r"gate_proj.weight: weights \(64, 32\), the model config implies \(96, 32\)"):
        weights.initial_state(prog, source)


def test_safetensors_writer_reads_back_and_transformers_layout(tmp_path):
    import ml_dtypes
    arrays = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.ones((3,), ml_dtypes.bfloat16)}
    safetensors_io.write(tmp_path / "x.safetensors", [(k, v.shape, v.dtype) for k, v in arrays.items()],
                         arrays.__getitem__, metadata={"format": "pt"})
    r = safetensors_io.Reader([tmp_path / "x.safetensors"])
    assert all(np.array_equal(r.get(k), v) and r.dtype(k) == v.dtype for k, v in arrays.items())
    import safetensors.numpy
    assert np.array_equal(safetensors.numpy.load_file(tmp_path / "x.safetensors")["a"], arrays["a"])


@pytest.mark.slow
def test_fixtures_match_live_transformers(tmp_path):
    """Remakes the fixtures with transformers and checks the committed ones are what it makes."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    script = Path(__file__).parent / "fixtures" / "make_hf_fixtures.py"
    subprocess.run([sys.executable, str(script), str(tmp_path)], check=True, capture_output=True)
    for family in FAMILIES:
        new = json.loads((tmp_path / family / "reference.json").read_text())
        old, logits = reference(family)
        assert new == old
        assert np.abs(np.load(tmp_path / family / "reference_logits.npy") - logits).max() < 1e-5
        a = safetensors_io.Reader(hf.safetensors_files(tmp_path / family))
        b = safetensors_io.Reader(hf.safetensors_files(FIXTURES / family))
        assert all(np.array_equal(a.get(n), b.get(n)) for n in b.names())


@pytest.mark.slow
def test_lora_fine_tune_from_import_then_merged_export(tmp_path, capsys):
    """`train` with checkpoint.init_from an imported Qwen2 (tied embeddings, qkv bias) and LoRA
    on a 2x2x2 mesh: after a few steps only adapter parameters differ from the import, and the
    merged export computes what the adapted model computes (in transformers too, where installed)."""
    weights.import_hf(str(FIXTURES / "qwen2"), str(tmp_path / "imp"), say=lambda _: None)
    run = tmp_path / "run"
    mesh = ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"]
    with pytest.raises(SystemExit) as e:
        cli.main(["train", str(tmp_path / "imp" / "config.yaml"), f"run_dir={run}", "train.steps=3",
                  "data.seq_len=16", "train.global_batch_size=8", *mesh, "train.compile_cache=false",
                  "model.lora.rank=4", "model.lora.targets=[q_proj,v_proj,wo_hed,w_up_df]",
                  "optimizer.learning_rate=1e-2", "optimizer.warmup_steps=1"])
    assert e.value.code == 0
    assert "starting from the weights of" in capsys.readouterr().out
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
    try:  # where transformers is installed (not in CI), the exported model runs there too
        import torch
        import transformers
    except ImportError:
        return
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "exp", dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = model(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
    assert np.abs(theirs - adapted).max() < 1e-4


def test_lora_config_mistakes():
    with pytest.raises(ConfigError, match="model.lora.targets: unknown weight 'q'; choose from wq_dhe, "):
        config.load(None, ["model.lora.rank=4", "model.lora.targets=[q,wq_dhe]"])
    with pytest.raises(ConfigError, match="model.lora.rank > 0 needs train.sync=every_step"):
        config.load(None, ["model.lora.rank=4", "train.sync=local_sgd"])
    lora = config.load(None, ["model.lora.rank=4", "model.lora.targets=[q_proj,w_up_df]"]).model.lora
    assert lora.target_params() == ("wq_dhe", "w_up_df")
