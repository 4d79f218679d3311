"""What tests/hf share: the tiny HF models of tests/fixtures/hf/, what transformers computed with
them, and our logits for a weights source (`from hf_reference import ...`).

tests/fixtures/hf/<family>/ holds a tiny random model per supported family, saved by
transformers, with transformers' logits and greedy generation (tests/fixtures/make_hf_fixtures.py
made them). Llama uses llama3 rope scaling, Qwen2 qkv biases and tied embeddings, Qwen3 qk-norm,
head_dim 16 != 32/4 and a sharded checkpoint with an index. The mixtures of experts (4 experts,
top 2): Mixtral, Qwen2-MoE with a gated shared expert and unnormalised top-k weights, Qwen3-MoE.
OLMo 2: post-norms, qk-norm over the whole projection. Gemma 2 (3 layers: local, global, local;
window 6, soft caps) and Gemma 3 (4 layers: local, local, global, local; qk-norm, the local
layers' rotary base, linear scaling on the global ones): head_dim 16, query_pre_attn_scalar 24.
OLMo 3 (4 layers: three local (window 6), one global): OLMo 2's norms, yarn on the global layer as
published (top-level rope_scaling, attention_factor 1.21), the local ones unscaled.
Llama 4 (4 layers: rotary ones attending in chunks of 4, NoPE ones with the attention temperature
alternating; dense, MoE, MoE, dense; 4 experts, top 1 by sigmoid-scaled input, a shared expert; qk
L2 norm; llama3 rope).
DeepSeek-V3 (3 layers: one dense, two MoE): multi-head latent attention (q and kv ranks 16, 8
rotary and 8 other query/key channels, 12 value channels), 4 sigmoid-routed experts in 2 groups
(1 kept), top 2 renormalised x 2.5, a random balancing bias, one shared expert; deepseek_v3_full_q
the same with a full query projection (q_lora_rank null, DeepSeek-V2-Lite's); the `_v_eq_rope` pair
the same two with 16 rotary, other query/key and value channels each (no size tells value rows from
rotary ones). deepseek_v3_yarn and kimi_k2: the published DeepSeek-V3 / Kimi-K2 config.json's shape
fields scaled down (3 layers, 8 experts in 4 groups keeping 2 / in 1 group, q rank 24, 16 other
query/key and value channels, 8 rotary) and their rope keys verbatim (top-level rope_theta and
rope_scaling of type yarn, factor 40 / 32, with mscale and mscale_all_dim).
"""

import dataclasses
import json
import struct
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from shardtrain import config
from shardtrain.parallel import mesh as mesh_lib, sharding

FIXTURES = Path(__file__).parent.parent / "fixtures" / "hf"
MLA_FAMILIES = ["deepseek_v3", "deepseek_v3_full_q", "deepseek_v3_v_eq_rope", "deepseek_v3_full_q_v_eq_rope",
                "deepseek_v3_yarn", "kimi_k2"]
MOE_FAMILIES = ["mixtral", "qwen2_moe", "qwen3_moe", *MLA_FAMILIES, "llama4"]
NEW_FAMILIES = ["olmo2", "gemma2", "gemma3", "olmo3"]
FAMILIES = ["llama", "mistral", "qwen2", "qwen3", *MOE_FAMILIES, *NEW_FAMILIES]


def reference(family):
    d = FIXTURES / family
    return json.loads((d / "reference.json").read_text()), np.load(d / "reference_logits.npy")


def our_logits(source, tokens_bt, mesh_overrides, devices=None, run_dir="/tmp/unused", model=None):
    """Our model's logits for `source`'s weights on a mesh (as `model`, default the source's own config)."""
    cfg = config.load(None, [*mesh_overrides, "train.global_batch_size=8", f"run_dir={run_dir}"])
    cfg = dataclasses.replace(cfg, model=model or source.model)
    layout = sharding.param_layout(cfg, mesh_lib.make_mesh(cfg.mesh, devices))
    params = source.params(layout.params, cfg.model)
    out = jax.jit(lambda p, t: nnx.merge(layout.graphdef, p)(t))(params, tokens_bt)
    return np.asarray(out[0] if isinstance(out, tuple) else out)  # an MoE model: (logits, aux losses)


def rewrite_header(path: Path, edit=None, length: int | None = None) -> None:
    """The safetensors file at `path` with its header edited in place (`edit(header)`) or its length
    field replaced by `length`."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    if edit:
        edit(header)
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text) if length is None else length) + text + raw[8 + n:])
