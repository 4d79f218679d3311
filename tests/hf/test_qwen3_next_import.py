"""Qwen3-Next (Qwen3NextForCausalLM) through import-hf: greedy tokens equal transformers' (logits: test_hf_parity.py),
import -> export is bit-exact, and the layer layout maps HF layer i to layer i % 4 of our group i // 4.

The fixture (tests/fixtures/make_hf_fixtures.py): 4 layers, three gated DeltaNet ones (2 key heads of 8,
4 value heads of 8, conv kernel 4) then a gated attention one (4 query heads, 2 kv heads of 16, rotary on a
quarter of each head); 4 experts (top 2, renormalised) and a gated shared expert; bfloat16 weights, the MoE's
scaled down (SCALES there) so that its float32 logits are well-conditioned: transformers' are 2.8e-5 from its
own float64 ones. transformers ran its pure-torch path (no flash-linear-attention or causal-conv1d kernels
installed)."""

import json

import pytest
from hf_reference import FIXTURES, reference
from test_weights import round_trip

from shardtrain import generate
from shardtrain.hf import safetensors_io
from shardtrain.hf.config import hf_config, model_config
from shardtrain.hf.io import HfDir, safetensors_files
from shardtrain.hf.layout import indexed_names, tensor_map

QWEN3_NEXT = FIXTURES / "qwen3_next"


def test_qwen3_next_reads_as_groups_of_three_deltanet_layers_and_an_attention_layer():
    m = HfDir(QWEN3_NEXT).model
    a = m.linear_attention
    assert (m.name, a.full_attention_interval, a.key_heads, a.value_heads, m.rotary_fraction) == (
        "qwen3_next", 4, 2, 4, 0.25)
    names = {name: entry for entry in tensor_map(m) for name, _ in indexed_names(entry, m)}
    assert sorted(names) == sorted(safetensors_io.Reader(safetensors_files(QWEN3_NEXT)).names())
    assert names["model.layers.2.linear_attn.A_log"].ours == ("blocks", "layer_2", "a_log_h")
    assert names["model.layers.3.self_attn.q_proj.weight"].paths == (("blocks", "layer_3", "wq_dhe"),
                                                                    ("blocks", "layer_3", "wgate_dhe"))
    assert names["model.layers.1.mlp.experts.3.up_proj.weight"].ours == ("blocks", "layer_1", "moe", "w_up_edf")
    fresh = hf_config(m)  # a trained model's config.json, no imported one to update
    assert model_config(fresh) == m and fresh["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]


def test_qwen3_next_import_then_export_round_trips_bit_exactly(tmp_path):
    """Every tensor (in_proj_qkvz / in_proj_ba regrouped from per-key-head order and back, q_proj's
    queries and gates split and joined, the conv kernel) and config.json."""
    exported = json.loads((round_trip(QWEN3_NEXT, tmp_path) / "config.json").read_text())
    assert model_config(exported) == HfDir(QWEN3_NEXT).model
    original = json.loads((QWEN3_NEXT / "config.json").read_text())
    assert {k: exported.get(k) for k in original} == original


@pytest.mark.slow
def test_qwen3_next_greedy_generation_equals_transformers():
    """20 tokens: the prompt's prefill, then each token through the DeltaNet layers' conv windows and
    recurrent states and the attention layer's keys and values (the cache of Qwen3Next.cache_layout);
    a left-padded row generates what it does alone (its padding leaves the states at zero)."""
    ref, _ = reference("qwen3_next")
    gen = generate.Generator.from_source(QWEN3_NEXT)
    assert gen.encode(ref["prompt"]) == ref["prompt_ids"]
    short = ref["prompt_ids"][4:]
    out = gen.generate([ref["prompt_ids"], short], 20, stop_at_eos=False)
    assert out[0] == ref["new_ids"]
    assert out[1] == gen.generate([short], 20, stop_at_eos=False)[0]
    layout = type(gen.model).cache_layout(gen.cfg.model, 2, 10)
    assert {k: shape for k, (shape, _) in layout.items()} == {
        "k": (1, 2, 10, 2, 16), "v": (1, 2, 10, 2, 16), "conv": (1, 3, 2, 3, 64), "state": (1, 3, 2, 4, 8, 8)}
