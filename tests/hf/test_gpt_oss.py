"""gpt-oss (GptOssForCausalLM): greedy tokens equal transformers' (logits: test_hf_parity.py), import -> export is
bit-exact, and its MXFP4 expert weights are dequantized on import.

The fixture (tests/fixtures/make_hf_fixtures.py): 3 layers, sliding (window 6) / full / sliding,
learned attention sinks, q/k/v/o biases, 4 experts (top 2) with biases and the clamped SwiGLU, and the
published checkpoints' yarn rope block (factor 32 over 4096 positions; plain rope changes the greedy
tokens from the second one). Its q, k and down projections are scaled down (SCALES there) so that its
float32 logits are well-conditioned: transformers' are 1.3e-5 from its own float64 ones."""

import json

import jax
import numpy as np
from hf_reference import FIXTURES, our_logits, reference
from test_weights import round_trip

from shardtrain import generate, weights
from shardtrain.hf.config import model_config
from shardtrain.hf.io import HfDir

GPT_OSS = FIXTURES / "gpt_oss"


def test_gpt_oss_greedy_generation_equals_transformers():
    """20 tokens through the KV cache: the sinks in every step's softmax, the window on layers 0 and 2."""
    ref, _ = reference("gpt_oss")
    gen = generate.Generator.from_source(GPT_OSS)
    assert gen.generate([ref["prompt_ids"]], 20, stop_at_eos=False)[0] == ref["new_ids"]


def test_gpt_oss_import_then_export_round_trips_bit_exactly(tmp_path):
    """Every tensor (gate_up_proj's interleaved columns split into our gate and up and back, the
    sinks, the biases) and config.json."""
    exported = json.loads((round_trip(GPT_OSS, tmp_path) / "config.json").read_text())
    assert model_config(exported) == HfDir(GPT_OSS).model
    original = json.loads((GPT_OSS / "config.json").read_text())
    assert {k: exported.get(k) for k in original} == original
    assert "use_sliding_window" not in exported  # the layer kinds say it (Qwen's keys are not gpt-oss's)


def test_gpt_oss_without_rope_keys_reads_transformers_default_yarn():
    """config.json with no rope_parameters / rope_scaling (or rope_scaling null): transformers rotates
    by yarn (factor 32 over 4096 positions, GptOssConfig's default), never by plain rope; so do we: the
    same model config as the fixture's published yarn block, whose logits and tokens equal transformers'."""
    hf = json.loads((GPT_OSS / "config.json").read_text())
    published = model_config(hf)
    assert published.rope_scaling.type == "yarn" and published.rope_scaling.factor == 32.0
    bare = {k: v for k, v in hf.items() if k not in ("rope_scaling", "rope_parameters")}
    assert model_config(bare) == published
    assert model_config({**bare, "rope_scaling": None}) == published


def test_gpt_oss_mxfp4_experts_are_dequantized_on_import_as_transformers_does(tmp_path):
    """gpt_oss_mxfp4: the same model with its experts in MXFP4 blocks and scales (quantization_config
    mxfp4, as published): our logits equal the ones transformers computes with its own dequantization
    (which moves them by up to 5.0 from the unquantized model's); export-hf writes the dequantized
    experts in bfloat16 and no quantization_config, and they read back as the same model."""
    src = FIXTURES / "gpt_oss_mxfp4"
    want = np.load(src / "reference_logits.npy")
    tokens = np.array(json.loads((src / "reference.json").read_text())["tokens"], np.int32)
    source = weights.find(src)
    got = our_logits(source, tokens, [], devices=jax.devices()[:1])
    assert np.abs(got - want).max() < 1e-4  # measured 2.8e-5
    weights.import_hf(str(src), str(tmp_path / "imp"), say=lambda _: None)
    weights.export_hf(str(tmp_path / "imp"), str(tmp_path / "exp"), say=lambda _: None)
    exported = HfDir(tmp_path / "exp")
    assert "quantization_config" not in exported.hf and exported.model == source.model
    assert str(exported.reader.dtype("model.layers.0.mlp.experts.gate_up_proj")) == "bfloat16"
    again = our_logits(weights.find(tmp_path / "exp"), tokens, [], devices=jax.devices()[:1])
    np.testing.assert_array_equal(again, got)
