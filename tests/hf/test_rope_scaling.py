"""Rope scaling as transformers computes it: our frequencies, yarn's attention factor on cos / sin and
DeepSeek's softmax scale against tests/fixtures/hf/rope_reference.json (transformers' rope init
functions for published configs' rope_parameters: DeepSeek-V3 / V2-Lite, Kimi-K2, gpt-oss, Qwen3 and
OLMo 3 yarn, llama3, linear, dynamic); the published DeepSeek-V3 and Kimi-K2 fixtures' parity is in
test_hf_parity.py."""

import json

import numpy as np
import pytest
from hf_reference import FIXTURES

from models import rope
from models.gpt import inv_frequencies
from shardtrain import config
from shardtrain.config import ConfigError
from shardtrain.hf.config import model_config

CASES = json.loads((FIXTURES / "rope_reference.json").read_text())


@pytest.mark.parametrize("name", CASES)
def test_frequencies_and_attention_factors_equal_transformers(name):
    case = CASES[name]
    hf = {"architectures": ["LlamaForCausalLM"], "vocab_size": 8, "hidden_size": 4 * case["head_dim"],
          "num_attention_heads": 4, "head_dim": case["head_dim"], "num_hidden_layers": 1, "intermediate_size": 8,
          "max_position_embeddings": case["max_position_embeddings"], "rope_parameters": case["rope_parameters"]}
    m = model_config(hf)
    want = np.asarray(case["inv_freq"], np.float32)
    got = inv_frequencies(case["head_dim"], m.rope_theta, m.rope_scaling)
    np.testing.assert_allclose(got, want, rtol=2.4e-7, atol=0)  # 2 float32 ulps: torch's pow is not numpy's
    assert rope.attention_factor(m.rope_scaling) == pytest.approx(case["attention_factor"], rel=1e-12)
    assert rope.score_scale(m.rope_scaling) == pytest.approx(case["score_scale"], rel=1e-12)


def test_published_yarn_keys_read_as_transformers_reads_them():
    """DeepSeek-V3's config.json: top-level rope_theta and rope_scaling with `type` (not rope_type)."""
    hf = json.loads((FIXTURES / "deepseek_v3_yarn" / "config.json").read_text())
    s = model_config(hf).rope_scaling
    assert (s.type, s.factor, s.original_max_position_embeddings, s.mscale_all_dim) == ("yarn", 40, 4096, 1.0)
    hf["rope_scaling"] = {k: v for k, v in hf["rope_scaling"].items() if k != "factor"}  # V2's: the context's growth
    assert model_config(hf).rope_scaling.factor == 163840 / 4096
    del hf["rope_scaling"]["original_max_position_embeddings"]
    with pytest.raises(ConfigError, match="'yarn' needs original_max_position_embeddings"):
        model_config(hf)
    hf["rope_scaling"] = {"type": "longrope", "factor": 2.0}
    with pytest.raises(ConfigError, match="rope type 'longrope' is not supported; supported: default, linear"):
        model_config(hf)


def test_dynamic_rope_refuses_sequences_past_its_original_context():
    """transformers' dynamic NTK changes the frequencies only past max_position_embeddings (at inference)."""
    dynamic = "model.rope_scaling={type: dynamic, factor: 2.0, original_max_position_embeddings: 16}"
    config.validate(config.load(None, [dynamic, "data.seq_len=16"]))
    with pytest.raises(ConfigError, match="data.seq_len=32: model.rope_scaling.type=dynamic"):
        config.validate(config.load(None, [dynamic, "data.seq_len=32"]))
