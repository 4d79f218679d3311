"""Our logits and greedy generation equal what transformers computes, for every supported family.

tests/hf/hf_reference.py describes the fixtures; the MoE families' sharded parity runs on an
expert-parallel 2x2x2 mesh (expert x fsdp x tensor).
"""

import dataclasses
import json

import jax
import numpy as np
import pytest
from hf_reference import FAMILIES, FIXTURES, MOE_FAMILIES, our_logits, reference

from shardtrain import cli, config, generate, weights
from shardtrain.config import ConfigError

SCALED_MOE = ["gpt_oss", "qwen3_next"]  # fixtures scaled to well-conditioned float32 logits (make_hf_fixtures.SCALES)


@pytest.mark.parametrize("family", [*FAMILIES, *SCALED_MOE])
def test_logits_equal_transformers_on_2x2x2_mesh_and_one_device(family):
    ref, want = reference(family)
    source = weights.find(FIXTURES / family)
    tokens = np.tile(np.array(ref["tokens"], np.int32), (2, 1))  # 4 rows: the batch splits over data x fsdp
    split = "mesh.expert=2" if family in MOE_FAMILIES + SCALED_MOE else "mesh.data=2"
    sharded = our_logits(source, tokens, [split, "mesh.fsdp=2", "mesh.tensor=2"])[:2]
    single = our_logits(source, tokens[:2], [], devices=jax.devices()[:1])
    # float32 logits of two implementations (torch's, XLA's) in different accumulation orders; the
    # MoE router's softmax-weighted sum of experts adds to it (Mixtral measured 2.7e-4 on this machine)
    tolerance = 5e-4 if family in MOE_FAMILIES else 1e-4
    assert np.abs(sharded - want).max() < tolerance
    assert np.abs(single - want).max() < tolerance
    # logits up to ~8, summed in another order on 8 devices; an MoE sums its experts' outputs on other
    # devices too (Mixtral measured 1.02e-5 of the largest logit on this machine)
    relative = 3e-5 if family in MOE_FAMILIES else 1e-5
    assert np.abs(sharded - single).max() < relative * np.abs(want).max()


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3", "mixtral", "olmo2", "gemma2", "gemma3",
                                    "olmo3", "llama4", "deepseek_v3", "deepseek_v3_full_q", "deepseek_v3_v_eq_rope",
                                    "deepseek_v3_yarn"])  # the other MLA fixtures: parity above
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
    if family in ("llama", "mistral", "gemma3"):  # the left-padded row generates what it does alone (windows too)
        assert out[1] == gen.generate([short], 20, stop_at_eos=False)[0]


def test_deepseek_v3_generation_caches_the_latent_not_keys_and_values():
    """Per layer and token the cache holds kv_lora_rank + qk_rope_head_dim = 16 + 8 numbers (the greedy
    tokens above come through it), not 2 x heads x head size = 128."""
    gen = generate.Generator.from_source(FIXTURES / "deepseek_v3")
    layout = type(gen.model).cache_layout(gen.cfg.model, 2, 10)
    assert {k: shape for k, (shape, _) in layout.items()} == {"k": (3, 2, 10, 16), "v": (3, 2, 10, 8)}


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
@pytest.mark.parametrize("impl, mesh", [("chunked", []), ("splash", []), ("xla", ["mesh.data=2", "mesh.context=4"]),
                                        ("chunked", ["mesh.data=2", "mesh.context=4"])],
                         ids=["chunked", "splash", "ring_xla", "ring_chunked"])
def test_gemma_soft_caps_and_local_layers_under_every_attention_implementation(family, impl, mesh):
    """Gemma 2's soft caps and both families' local (window 6) and global layers over 128 tokens:
    every attention implementation, and ring attention with the sequence over 4 devices, equals the
    reference (xla, one device) within 1.5e-5 of the logits' scale (the reduction order differs;
    ring attention over 4 devices on Gemma 2: 9.3e-5 on logits up to 10.7 with jax 0.10.2, 1.2e-4 with
    jax 0.12.0.1). cuDNN (a GPU's) has no soft cap: a config error."""
    source = weights.find(FIXTURES / family)
    tokens = np.random.default_rng(0).integers(1, source.model.vocab_size, (4, 128)).astype(np.int32)
    model = dataclasses.replace(source.model, attention="xla")
    want = our_logits(source, tokens, [], devices=jax.devices()[:1], model=model)
    got = our_logits(source, tokens, mesh, devices=None if mesh else jax.devices()[:1],
                     model=dataclasses.replace(model, attention=impl))
    print(f"{family} {impl} {mesh}: {np.abs(got - want).max():.2e} (logits up to {np.abs(want).max():.1f})")
    assert np.abs(got - want).max() < 1.5e-5 * np.abs(want).max()
    if family == "gemma2":
        with pytest.raises(ConfigError, match="attention=cudnn cannot soft-cap attention scores"):
            cudnn = dataclasses.replace(model, attention="cudnn")
            config.validate(dataclasses.replace(config.load(None, []), model=cudnn))


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


@pytest.mark.slow
@pytest.mark.parametrize("impl, mesh", [("splash", []), ("chunked", ["mesh.data=2", "mesh.context=4"])],
                         ids=["splash", "ring_chunked"])
def test_llama4_chunked_attention_under_splash_and_ring(impl, mesh):
    """Llama 4's chunks (segment ids per chunk, models/attention.py chunk_segments) and NoPE layers over
    128 tokens: splash (interpreted) and ring attention with the sequence over 4 devices equal the
    xla path on one device within 1.5e-5 of the logits' scale."""
    source = weights.find(FIXTURES / "llama4")
    tokens = np.random.default_rng(0).integers(1, source.model.vocab_size, (4, 128)).astype(np.int32)
    model = dataclasses.replace(source.model, attention="xla")
    want = our_logits(source, tokens, [], devices=jax.devices()[:1], model=model)
    got = our_logits(source, tokens, mesh, devices=None if mesh else jax.devices()[:1],
                     model=dataclasses.replace(model, attention=impl))
    assert np.abs(got - want).max() < 1.5e-5 * np.abs(want).max()
