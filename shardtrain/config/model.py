"""The `model:` section of the run config: the decoder's shape and the features families differ by
(`ModelConfig`), and its sub-sections (`rope_scaling`, `lora`, `moe`, `mla`). Part of the schema
(schema.py), kept apart because it is the largest section."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional


@dataclass(frozen=True)
class RopeScalingConfig:
    """Rotary frequency scaling for contexts longer than pre-training (Hugging Face `rope_scaling`)."""

    type: Literal["linear", "llama3", "yarn", "dynamic"] = "llama3"
    """`linear`: every frequency divided by `factor`; `llama3`: Llama 3.1's low/high-frequency blend;
    `yarn`: YaRN (DeepSeek-V3, Kimi-K2, gpt-oss, Qwen / OLMo 3 long context; models/rope.py);
    `dynamic`: dynamic NTK, which changes nothing within original_max_position_embeddings (the most a
    sequence may hold with it)."""
    factor: float = 8.0
    low_freq_factor: float = 1.0
    """llama3: wavelengths above original_max_position_embeddings / low_freq_factor are divided by factor."""
    high_freq_factor: float = 4.0
    """llama3: wavelengths below original_max_position_embeddings / high_freq_factor are kept."""
    original_max_position_embeddings: int = 8192
    """llama3, yarn, dynamic: the pre-training context length (dynamic: transformers' max_position_embeddings)."""
    beta_fast: float = 32.0
    """yarn: frequencies that turn more than beta_fast times in the original context keep their value ..."""
    beta_slow: float = 1.0
    """yarn: ... those that turn fewer than beta_slow times are divided by factor; a linear ramp between."""
    truncate: bool = True
    """yarn: the ramp's ends rounded outward to whole dimensions (gpt-oss: false)."""
    attention_factor: Optional[float] = None
    """yarn: cos and sin times this; null: mscale / mscale_all_dim's ratio if both are set, else
    0.1 ln(factor) + 1."""
    mscale: Optional[float] = None
    """yarn (DeepSeek): the numerator's scale of the default attention_factor."""
    mscale_all_dim: Optional[float] = None
    """yarn (DeepSeek): the denominator's scale; with latent attention the scores are also multiplied
    by (0.1 mscale_all_dim ln(factor) + 1)^2, as DeepSeek's softmax scale."""


@dataclass(frozen=True)
class LoraConfig:
    """Low-rank adapters: each target weight W is used as W + (alpha / rank) * A @ B with A
    (W's input dims, rank) and B (rank, W's output dims), sharded like W's dims; B starts at zero.
    With rank > 0 only the adapters train (the rest is frozen) and export-hf merges them into W."""

    rank: int = 0
    """Adapter rank; 0: no adapters."""
    alpha: float = 16.0
    targets: tuple[str, ...] = ("wq_dhe", "wk_dke", "wv_dke", "wo_hed")
    """Adapted block weights by parameter name (wq_dhe, w_up_df, ...) or HF module name (q_proj, up_proj, ...):
    the model says which it has (e.g. no wk_dke with latent attention, no MLP weights in an MoE model)."""


@dataclass(frozen=True)
class MoeConfig:
    """Mixture of experts: with n_experts > 1 every block's MLP is a routed set of experts
    (models/moe.py: Mixtral, Qwen-MoE); the other fields matter only then."""

    n_experts: int = 0
    """Experts per MoE layer (every layer's MLP; d_ff is each expert's hidden size); 0 or 1: a
    dense MLP."""
    experts_per_token: int = 2
    """Experts each token is routed to (top-k, by softmax router probability)."""
    n_shared_experts: int = 0
    """Experts every token also passes through (DeepSeek / Qwen-MoE style), unweighted."""
    shared_expert_d_ff: Optional[int] = None
    """Hidden size of the shared experts' one SwiGLU MLP; default n_shared_experts x d_ff."""
    shared_expert_gate: bool = False
    """The shared experts' output is scaled by sigmoid(h . w), w a learned vector (Qwen2-MoE)."""
    norm_topk_prob: bool = True
    """The top-k router probabilities are renormalised to sum to 1 (Mixtral, Qwen3-MoE);
    false weights each expert by its softmax probability over all experts (Qwen2-MoE's default)."""
    capacity_factor: Optional[float] = None
    """null routes every token (dropless); a number caps each expert at capacity_factor x
    (tokens x experts_per_token / n_experts) assignments per expert shard's batch, dropping the rest."""
    receive_buffer: float = 1.25
    """Rows each device's experts take per round of dispatch, in units of a balanced load (its own
    tokens x experts_per_token); rows past it go in further rounds, so memory stays bounded and no
    assignment is dropped however the tokens route (all to one expert included)."""
    router_aux_loss_coef: float = 0.01
    """Weight of the load-balancing loss n_experts x sum_e (fraction of assignments to e) x
    (mean router probability of e)."""
    router_z_loss_coef: float = 0.001
    """Weight of the router z-loss, the mean of logsumexp(router logits)^2 (ST-MoE)."""
    router: Literal["softmax", "sigmoid", "sigmoid_input"] = "softmax"
    """`softmax` (Mixtral, Qwen-MoE); `sigmoid` (DeepSeek-V3): each expert scored sigmoid(logit),
    chosen by score + a per-expert load-balancing bias (state, never a gradient: it moves by
    bias_update_rate x sign(mean load - load) each step), weighted by its score; no auxiliary
    losses (router_aux_loss_coef and router_z_loss_coef are not used); `sigmoid_input` (Llama 4): the
    top experts by logit, each fed the token times sigmoid(its logit), their outputs summed."""
    n_groups: int = 1
    """sigmoid: experts split into n_groups groups; each token picks among the experts of its
    topk_groups best groups (by the sum of each group's two best biased scores), DeepSeek-V3's n_group."""
    topk_groups: int = 1
    """sigmoid: the groups each token keeps (DeepSeek-V3's topk_group)."""
    routed_scaling_factor: float = 1.0
    """The routed experts' weights times this (DeepSeek-V3's routed_scaling_factor)."""
    bias_update_rate: float = 0.001
    """sigmoid: the load-balancing bias's step per train step (DeepSeek-V3's gamma)."""
    first_dense_layers: int = 0
    """The first k layers have a dense MLP of dense_d_ff hidden units, the others experts
    (DeepSeek's first_k_dense_replace); the two kinds run as two rolled scans."""
    dense_d_ff: Optional[int] = None
    """Hidden size of the dense layers' MLP (first_dense_layers, dense_layers); default d_ff."""
    dense_layers: tuple[int, ...] = ()
    """Further layers (by index) with a dense MLP among the MoE ones (Llama 4: those not in moe_layers);
    each run of consecutive layers of one kind is its own rolled scan."""
    router_logit_bias: bool = False
    """A learned bias added to the router logits before the top-k (gpt-oss)."""
    expert_bias: bool = False
    """Biases on each expert's gate, up and down projections (gpt-oss)."""
    swiglu_limit: Optional[float] = None
    """The experts' clamped SwiGLU (gpt-oss): gate clamped to <= limit, up to [-limit, limit], output
    (up + 1) * gate * sigmoid(swiglu_alpha * gate); null: the plain SwiGLU silu(gate) * up."""
    swiglu_alpha: float = 1.702
    """With swiglu_limit: the sigmoid's gain."""


@dataclass(frozen=True)
class MlaConfig:
    """Multi-head latent attention (DeepSeek-V2/V3): queries through a rank q_lora_rank bottleneck,
    keys and values from one shared kv_lora_rank latent, plus a qk_rope_head_dim rotary part of
    the key shared by all heads."""

    q_lora_rank: Optional[int] = None
    """Rank of the query's compression (RMSNormed); null: a full query projection."""
    kv_lora_rank: int = 512
    """Rank of the key/value latent (RMSNormed)."""
    qk_nope_head_dim: int = 128
    """Per-head query/key channels without rotary."""
    qk_rope_head_dim: int = 64
    """Per-head query channels with rotary; the key's are one rotary part shared by all heads."""
    v_head_dim: int = 128
    """Per-head value channels."""


@dataclass(frozen=True)
class LinearAttentionConfig:
    """Qwen3-Next's hybrid decoder (model.name qwen3_next, models/qwen3_next.py): in each group of
    full_attention_interval layers the first ones are gated DeltaNet linear attention (models/deltanet.py)
    and the last is gated full attention (n_heads, n_kv_heads, head_dim, qk_norm with 1 + w)."""

    full_attention_interval: int = 4
    """Layers per group: interval - 1 DeltaNet layers, then one full-attention layer; must divide n_layers."""
    key_heads: int = 16
    """DeltaNet query / key heads (linear_num_key_heads); each serves value_heads / key_heads value heads."""
    value_heads: int = 32
    """DeltaNet value heads (linear_num_value_heads), one recurrent state each."""
    key_head_dim: int = 128
    value_head_dim: int = 128
    conv_kernel: int = 4
    """Width of the causal depthwise convolution over q, k, v (linear_conv_kernel_dim)."""
    chunk: int = 64
    """Tokens per chunk of the chunked delta-rule scan (a speed / memory knob, the same numbers)."""


@dataclass(frozen=True)
class ModelConfig:
    """Model architecture. `name` picks the class from the registry in `models/`. Llama 2/3,
    Mistral, Qwen2/2.5/3, OLMo 2, Gemma 2/3, DeepSeek-V3 and gpt-oss are configs of the one decoder
    `gpt` (alias `llama`)."""

    name: str = "gpt"
    vocab_size: int = 256
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 4
    """Key/value heads (grouped-query attention); must divide n_heads."""
    d_ff: int = 512
    """Hidden size of the (SwiGLU) MLP."""
    rope_theta: float = 10000.0
    attention: Literal["auto", "xla", "chunked", "splash", "cudnn"] = "auto"
    """Attention implementation (models/attention.py): `xla` materialises the T x T scores;
    `chunked` is flash-style plain XLA (long sequences anywhere); `splash` the Pallas TPU kernel;
    `cudnn` cuDNN flash attention on NVIDIA GPUs (heads of up to 128 channels); `auto`: splash on TPU,
    cudnn on GPU (chunked where cudnn cannot run), xla on CPU."""
    embed: Literal["gather", "one_hot"] = "gather"
    """Token embedding: `gather` rows of the table (no B x T x V intermediate); `one_hot` a one-hot
    matmul (shards cleanly over a vocab-sharded table; 2 V D FLOPs per token)."""
    rope_scaling: Optional[RopeScalingConfig] = None
    """Rotary frequency scaling (Llama 3.1+ `llama3`, or `linear`); null: none."""
    rms_norm_eps: float = 1e-6
    """Epsilon of every RMSNorm (Llama 1e-5, Qwen 1e-6)."""
    tie_embeddings: bool = False
    """The output projection is the transposed token embedding (Llama 3.2 1B/3B, small Qwens)."""
    head_dim: Optional[int] = None
    """Attention head size; default d_model / n_heads (Qwen3 sets its own)."""
    qkv_bias: bool = False
    """Biases on the query, key and value projections (Qwen2 / Qwen2.5)."""
    qk_norm: bool = False
    """RMSNorm on the queries and keys before rotary (Qwen3, OLMo 2, Gemma 3; see qk_norm_scope)."""
    qk_norm_scope: Literal["head", "projection"] = "head"
    """With qk_norm: RMSNorm over each head (Qwen3, Gemma 3) or over the whole query / key
    projection, all heads at once (OLMo 2)."""
    sliding_window: Optional[int] = None
    """Sliding-window causal attention: a token attends to itself and the W - 1 tokens before it
    (Hugging Face's `sliding_window`: Mistral, Qwen2 with use_sliding_window); null: the whole
    causal context. Every attention implementation and generation's KV cache honour it. With
    layer_pattern, only its `local` layers use it."""
    layer_pattern: tuple[Literal["global", "local"], ...] = ()
    """A repeating group of layer kinds: `local` layers attend within sliding_window, `global` ones
    to the whole context (Gemma 2: [local, global]; Gemma 3: five local, one global). The layers
    run as a rolled scan over groups (n_layers need not be a multiple: the last partial group
    follows the pattern's start). Empty: every layer alike."""
    attention_chunk: Optional[int] = None
    """The `local` layers of layer_pattern attend within aligned chunks of this many tokens (a token
    sees the earlier tokens of its chunk; Llama 4's attention_chunk_size) instead of sliding_window."""
    global_nope: bool = False
    """The `global` layers of layer_pattern use no rotary embedding (Llama 4's NoPE layers)."""
    attn_temperature: Optional[float] = None
    """global_nope layers: queries at position p times 1 + attn_temperature ln(1 + floor((p + 1) /
    attn_temperature_floor)) (Llama 4's attn_scale with attn_temperature_tuning); null: none."""
    attn_temperature_floor: int = 8192
    """Llama 4's floor_scale."""
    qk_l2_norm: bool = False
    """RMS-normalise each query and key head without a weight after rotary, on the rotary layers only
    (Llama 4's use_qk_norm)."""
    rope_local_theta: Optional[float] = None
    """Rotary base of the `local` layers of layer_pattern, without rope_scaling (Gemma 3's
    rope_local_base_freq); null: they rotate as the global ones (rope_theta, rope_scaling)."""
    norm_position: Literal["pre", "post", "pre_post"] = "pre"
    """Where each block's RMSNorms sit: `pre` on the attention and MLP inputs (Llama); `post` on
    their outputs, before the residual add (OLMo 2); `pre_post` both (Gemma 2/3)."""
    norm_scale: Literal["weight", "one_plus_weight"] = "weight"
    """Every RMSNorm multiplies by its weight w, or by 1 + w computed in float32 (Gemma; w starts at 0)."""
    activation: Literal["silu", "gelu_tanh"] = "silu"
    """The gated MLP's activation: SwiGLU (silu) or GeGLU with tanh-approximated GELU (Gemma)."""
    scale_embeddings: bool = False
    """Token embeddings times sqrt(d_model), rounded to the compute dtype (Gemma)."""
    query_pre_attn_scalar: Optional[int] = None
    """Attention scores scaled by query_pre_attn_scalar**-0.5 instead of head_size**-0.5 (Gemma)."""
    attn_softcap: Optional[float] = None
    """Attention scores soft-capped to c * tanh(s / c) before the mask (Gemma 2's
    attn_logit_softcapping); null: none. Not with attention=cudnn (its kernel has no cap)."""
    final_softcap: Optional[float] = None
    """Output logits soft-capped to c * tanh(logits / c) (Gemma 2's final_logit_softcapping)."""
    attn_sinks: bool = False
    """A learned logit per query head joins every query's softmax denominator as a key with no value
    (gpt-oss's attention sinks): a query may attend to nothing. Every attention implementation and
    the KV cache honour it."""
    attn_out_bias: bool = False
    """A bias on the attention's output projection (gpt-oss, with qkv_bias)."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """Low-rank adapters for fine-tuning (off unless lora.rank > 0)."""
    moe: MoeConfig = field(default_factory=MoeConfig)
    """Mixture of experts (off unless moe.n_experts > 1)."""
    mla: Optional[MlaConfig] = None
    """Multi-head latent attention (DeepSeek-V2/V3) instead of grouped-query attention; null: off.
    Then n_kv_heads = n_heads and head_dim is unused."""
    linear_attention: Optional[LinearAttentionConfig] = None
    """Qwen3-Next's gated DeltaNet layers among gated full-attention ones (model.name qwen3_next only)."""
    rotary_fraction: float = 1.0
    """The fraction of each head's channels that rotate, the first ones (partial_rotary_factor; qwen3_next)."""

    @property
    def mlp_runs(self) -> list[tuple[str, int, int, bool]]:
        """(name, first layer, layers, dense) of each run of consecutive layers with a dense MLP or with
        experts (moe.first_dense_layers, moe.dense_layers), each a rolled scan of its own: named `dense`
        and `sparse` (DeepSeek's two), later runs of a kind with their index (`dense2`, ...)."""
        e = self.moe
        dense = [e.n_experts <= 1 or i < e.first_dense_layers or i in e.dense_layers for i in range(self.n_layers)]
        runs, seen = [], set()
        for i, kind in enumerate(dense):
            if i and kind == dense[i - 1]:
                name, first, count, _ = runs[-1]
                runs[-1] = (name, first, count + 1, kind)
                continue
            name = "dense" if kind else "sparse"
            runs.append((name if name not in seen else f"{name}{len(runs)}", i, 1, kind))
            seen.add(name)
        return runs

    @property
    def head_size(self) -> int:
        """Attention head size E: head_dim, or d_model / n_heads; with mla the larger of the
        query/key and value head sizes (the smaller padded with zeros)."""
        if self.mla is not None:
            a = self.mla
            return max(a.qk_nope_head_dim + a.qk_rope_head_dim, a.v_head_dim)
        return self.head_dim or self.d_model // self.n_heads
