"""Qwen3-Next's gated full-attention layer (models/qwen3_next.py) equals transformers' Qwen3NextAttention
(tests/fixtures/gated_attention_layer.npz, made by tests/fixtures/make_hf_fixtures.py): per-head output
gates, 1 + w q/k norms, rotary on a quarter of each head; q_proj's layout round trips bit for bit."""

from pathlib import Path

import jax.numpy as jnp
import numpy as np

from models import qwen3_next
from shardtrain.hf.layout import gated_query_to_hf, gated_query_to_ours

LAYER = Path(__file__).parent.parent / "fixtures" / "gated_attention_layer.npz"


def test_gated_attention_layer_equals_transformers_and_its_layout_round_trips():
    t = np.load(LAYER)
    qg = gated_query_to_ours(t["q_proj.weight"], 4)
    np.testing.assert_array_equal(gated_query_to_hf(qg), t["q_proj.weight"])
    p = {"wq_dhe": qg[..., :16], "wgate_dhe": qg[..., 16:], "q_norm": t["q_norm.weight"], "k_norm": t["k_norm.weight"],
         **{f"w{n}_dke": t[f"{n}_proj.weight"].T.reshape(32, 2, 16) for n in "kv"},
         "wo_hed": t["o_proj.weight"].T.reshape(4, 16, 32)}
    out = qwen3_next.gated_attention(p, jnp.asarray(t["x"]), rotary_dim=4, theta=10000.0)
    np.testing.assert_allclose(out, t["out"], atol=1e-5, rtol=1e-5)
