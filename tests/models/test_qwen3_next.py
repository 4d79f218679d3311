"""Qwen3-Next's gated full-attention layer (models/qwen3_next.py) equals transformers' Qwen3NextAttention
(tests/fixtures/gated_attention_layer.npz, made by tests/fixtures/make_hf_fixtures.py): per-head output
gates, 1 + w q/k norms, rotary on a quarter of each head; q_proj's layout round trips bit for bit; and the
whole decoder (`logits`: 3 gated DeltaNet layers, then a gated attention one, MoE with a gated shared
expert) reads the qwen3_next fixture's checkpoint with logits and 20 greedy tokens equal to transformers'."""

import functools
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_step import one_step

from conftest import TINY
from models import qwen3_next
from shardtrain import config, step
from shardtrain.config import ConfigError
from shardtrain.hf import safetensors_io
from shardtrain.hf.layout import gated_query_to_hf, gated_query_to_ours, grouped_to_ours
from shardtrain.parallel import mesh as mesh_lib

LAYER = Path(__file__).parent.parent / "fixtures" / "gated_attention_layer.npz"
MODEL = Path(__file__).parent.parent / "fixtures" / "hf" / "qwen3_next"


def test_gated_attention_layer_equals_transformers_and_its_layout_round_trips():
    t = np.load(LAYER)
    qg = gated_query_to_ours(t["q_proj.weight"], 4)
    np.testing.assert_array_equal(gated_query_to_hf(qg), t["q_proj.weight"])
    p = {"wq_dhe": qg[..., :16], "wgate_dhe": qg[..., 16:], "q_norm": t["q_norm.weight"], "k_norm": t["k_norm.weight"],
         **{f"w{n}_dke": t[f"{n}_proj.weight"].T.reshape(32, 2, 16) for n in "kv"},
         "wo_hed": t["o_proj.weight"].T.reshape(4, 16, 32)}
    out, _ = qwen3_next.gated_attention(p, jnp.asarray(t["x"]), rotary_dim=4, theta=10000.0)
    np.testing.assert_allclose(out, t["out"], atol=1e-5, rtol=1e-5)


def checkpoint_params(get, cfg: dict) -> dict:
    """The fixture checkpoint's tensors (HF names, through `get`) as qwen3_next.logits' params."""
    hk, k, hv, v = (cfg[f"linear_{n}"] for n in ("num_key_heads", "key_head_dim", "num_value_heads",
                                                 "value_head_dim"))
    h, kv, e, d, n = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"], cfg["hidden_size"], \
        cfg["num_experts"]
    layers = []
    for i, kind in enumerate(cfg["layer_types"]):
        def w(name, i=i):
            return get(f"model.layers.{i}.{name}")
        experts = {ours: np.stack([w(f"mlp.experts.{j}.{hf}.weight").T for j in range(n)])
                   for ours, hf in [("w_gate_edf", "gate_proj"), ("w_up_edf", "up_proj"), ("w_down_efd", "down_proj")]}
        layer = {"mixer_norm": w("input_layernorm.weight"), "mlp_norm": w("post_attention_layernorm.weight"),
                 "moe": {"router_de": w("mlp.gate.weight").T, **experts,
                         **{f"shared_w_{p}": w(f"mlp.shared_expert.{p[:-3]}_proj.weight").T
                            for p in ("gate_df", "up_df", "down_fd")},
                         "shared_expert_gate_d1": w("mlp.shared_expert_gate.weight").T}}
        if kind == "linear_attention":
            r = hv // hk
            layer["linear"] = {
                "w_qkvz_dc": grouped_to_ours(w("linear_attn.in_proj_qkvz.weight"), hk, (k, k, r * v, r * v)),
                "w_ba_dh2": grouped_to_ours(w("linear_attn.in_proj_ba.weight"), hk, (r, r)),
                "conv_wc": w("linear_attn.conv1d.weight")[:, 0].T, "a_log_h": w("linear_attn.A_log"),
                "dt_bias_h": w("linear_attn.dt_bias"), "norm_v": w("linear_attn.norm.weight"),
                "wo_vd": w("linear_attn.out_proj.weight").T}
        else:
            qg = gated_query_to_ours(w("self_attn.q_proj.weight"), h)
            layer["attention"] = {"wq_dhe": qg[..., :e], "wgate_dhe": qg[..., e:],
                                  "q_norm": w("self_attn.q_norm.weight"), "k_norm": w("self_attn.k_norm.weight"),
                                  **{f"w{x}_dke": w(f"self_attn.{x}_proj.weight").T.reshape(d, kv, e) for x in "kv"},
                                  "wo_hed": w("self_attn.o_proj.weight").T.reshape(h, e, d)}
        layers.append(layer)
    return {"embedding_vd": get("model.embed_tokens.weight"), "final_norm": get("model.norm.weight"),
            "unembed_dv": get("lm_head.weight").T, "layers": layers}


def decoder():
    cfg = json.loads((MODEL / "config.json").read_text())
    reader = safetensors_io.Reader(sorted(MODEL.glob("*.safetensors")))
    params = checkpoint_params(lambda name: reader.get(name).astype(np.float32), cfg)
    shape = dict(n_key_heads=cfg["linear_num_key_heads"], theta=cfg["rope_parameters"]["rope_theta"],
                 rotary_dim=int(cfg["head_dim"] * cfg["rope_parameters"]["partial_rotary_factor"]),
                 eps=cfg["rms_norm_eps"], experts_per_token=cfg["num_experts_per_tok"],
                 norm_topk_prob=cfg["norm_topk_prob"], chunk=8)
    return params, shape, json.loads((MODEL / "reference.json").read_text())


def test_decoder_logits_equal_transformers():
    """The qwen3_next fixture (bfloat16 weights, computed in float32): 2 x 16 tokens in chunks of 8."""
    params, shape, ref = decoder()
    got, _ = jax.jit(functools.partial(qwen3_next.logits, **shape))(params, jnp.asarray(ref["tokens"]))
    want = np.load(MODEL / "reference_logits.npy")
    assert np.abs(got - want).max() < 1e-4  # measured 4.3e-5 on logits up to 10.4 (float32, torch's order)


def test_greedy_generation_through_the_layer_states_equals_transformers():
    """20 tokens: the prompt's prefill, then each token through the DeltaNet layers' conv windows and
    recurrent states and the attention layer's keys and values."""
    params, shape, ref = decoder()
    assert qwen3_next.greedy(params, ref["prompt_ids"], 20, **shape) == ref["new_ids"]


QWEN3_NEXT = [*TINY, "model.name=qwen3_next", "model.n_layers=4", "model.n_heads=4", "model.n_kv_heads=2",
              "model.head_dim=16", "model.d_ff=16", "model.rotary_fraction=0.25", "model.qk_norm=true",
              "model.norm_scale=one_plus_weight",
              "model.linear_attention={key_heads: 2, value_heads: 4, key_head_dim: 8, value_head_dim: 8, chunk: 8}",
              "model.moe={n_experts: 4, experts_per_token: 2, n_shared_experts: 1, shared_expert_d_ff: 16, "
              "shared_expert_gate: true}"]
"""A tiny Qwen3-Next for the trainer: one group of 3 DeltaNet layers and a gated attention layer."""


@pytest.mark.slow
def test_trainer_step_on_2x2x2_equals_one_device():
    """The trainer's model (a rolled scan over groups of layers, DeltaNet scans per shard of heads, the
    experts through moe.Moe): loss and updated parameters on data=2 x fsdp=2 x tensor=2 equal one device's."""
    ref_loss, ref = one_step(config.load(None, QWEN3_NEXT), jax.devices()[:1])
    loss, got = one_step(config.load(None, [*QWEN3_NEXT, "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"]))
    assert abs(loss - ref_loss) <= 1e-5 * ref_loss and loss > 0
    assert jax.tree.structure(got) == jax.tree.structure(ref)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    assert got["blocks"]["layer_0"]["w_qkvz_dc"].shape == (1, 32, 2 * 16 + 2 * 32)  # (groups, D, q k v z)
    assert got["blocks"]["layer_3"]["wgate_dhe"].shape == (1, 32, 4, 16)


@pytest.mark.parametrize("overrides, message", [
    (["model.n_layers=6"], "full_attention_interval=4 must be >= 2 and divide model.n_layers=6"),
    (["model.linear_attention.value_heads=3"], "key_heads=2 must divide value_heads=3"),
    (["model.name=gpt"], "linear_attention is set exactly when model.name is qwen3_next"),
    (["model.moe.n_experts=0"], "every layer's MLP is a mixture of experts"),
    (["model.rotary_fraction=0.2"], "even number of rotating channels"),
])
def test_bad_qwen3_next_configs_are_one_line_errors(overrides, message):
    with pytest.raises(ConfigError, match=message):
        config.load(None, [*QWEN3_NEXT, *overrides])


@pytest.mark.parametrize("axis", ["pipeline", "context"])
def test_pipeline_stages_and_context_parallelism_are_refused_in_one_line(axis):
    """Neither splits a sequence's DeltaNet scan as it needs: pipeline stages (groups of layers) and the
    load-balanced order of context parallelism."""
    cfg = config.load(None, [*QWEN3_NEXT, "model.n_layers=8", f"mesh.{axis}=2", "mesh.data=1", "mesh.fsdp=2",
                             "mesh.tensor=2"])
    with pytest.raises(ConfigError, match=f"mesh.{axis} > 1 does not run model.name=qwen3_next"):
        step.build(cfg, mesh_lib.make_mesh(cfg.mesh))
