"""How the trainer runs a model's stacked blocks: a layer scan, each layer rematerialised by
`train.remat`. `step` runs the whole stack with it; `pipeline` runs each stage's group of layers."""

from __future__ import annotations

from collections.abc import Callable

import jax

from models import layers
from shardtrain.config import RunConfig

# The block matmuls' outputs models name with checkpoint_name (by their weight: models/gpt.py `mm`).
QKV, OUT, GATE_UP, DOWN = ["wq_dhe", "wk_dke", "wv_dke"], ["wo_hed"], ["w_gate_df", "w_up_df"], ["w_down_fd"]
SAVED = {"minimal": QKV + OUT + GATE_UP + DOWN, "save_dot_except_mlp": QKV + OUT, "save_qkv_proj": QKV,
         "save_out_proj": OUT, "save_attn_out": ["attention_out"], "save_mlp_gate_up": GATE_UP}
OFFLOADED = {"minimal_offloaded": SAVED["minimal"], "qkv_proj_offloaded": QKV}

REMAT_POLICIES = {
    **{name: jax.checkpoint_policies.save_only_these_names(*names) for name, names in SAVED.items()},
    **{name: jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=names, offload_src="device",
        offload_dst="pinned_host") for name, names in OFFLOADED.items()},
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.checkpoint_dots,
    "dots_no_batch": jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
    # the activations models name with checkpoint_name go to host memory, everything else is recomputed
    "offload": jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=["layer_input", "attention_out"],
        offload_src="device", offload_dst="pinned_host"),
}


def scan_runner(cfg: RunConfig) -> Callable:
    """Runs the stacked blocks with lax.scan, each layer rematerialised by the configured policy;
    `**docs` (segment_ids, positions) describe packed documents."""
    policy = REMAT_POLICIES.get(cfg.train.remat)
    wrap = (lambda f: jax.checkpoint(f, policy=policy)) if policy else (lambda f: f)
    return lambda blocks, x, **docs: layers.scan_blocks(blocks, x, wrap=wrap, unroll=cfg.train.scan_unroll, **docs)
