"""Rotary scalings beyond Llama 3's, computed exactly as transformers' rope init functions
(modeling_rope_utils) compute them, in float32 numpy, so imported models rotate as they were trained.

- `yarn` (YaRN: DeepSeek-V3/R1, Kimi-K2, gpt-oss, Qwen and OLMo 3 long context): each frequency blends
  its interpolated (divided by factor) and original value by a linear ramp over the dimensions whose
  wavelength falls between original_max_position_embeddings / beta_fast and / beta_slow rotations;
  cos and sin are multiplied by an attention factor (given, or 0.1 ln(factor) + 1, or DeepSeek's
  mscale ratio); latent attention also scales its scores by mscale(factor, mscale_all_dim)^2
  (`score_scale`, DeepSeek's reference softmax scale).
- `dynamic` (dynamic NTK): transformers changes the base only for positions past
  original_max_position_embeddings (its max_position_embeddings); within it the frequencies are
  the unscaled ones, which is all a model may use here (config validation keeps sequences within it).
"""

from __future__ import annotations

import math

import numpy as np


def mscale(factor: float, scale: float = 1.0) -> float:
    """YaRN's `0.1 * scale * ln(factor) + 1` (1 for factor <= 1): transformers' yarn_get_mscale."""
    return 1.0 if factor <= 1 else 0.1 * scale * math.log(factor) + 1.0


def attention_factor(scaling) -> float:
    """What cos and sin are multiplied by (1 but for yarn)."""
    if scaling is None or scaling.type != "yarn":
        return 1.0
    if scaling.attention_factor is not None:
        return float(scaling.attention_factor)
    if scaling.mscale and scaling.mscale_all_dim:
        return mscale(scaling.factor, scaling.mscale) / mscale(scaling.factor, scaling.mscale_all_dim)
    return mscale(scaling.factor)


def score_scale(scaling) -> float:
    """Latent attention's extra factor on the scores (DeepSeek): mscale(factor, mscale_all_dim)^2."""
    if scaling is None or not getattr(scaling, "mscale_all_dim", None):
        return 1.0
    return mscale(scaling.factor, scaling.mscale_all_dim) ** 2


def yarn_frequencies(e: int, theta: float, scaling) -> np.ndarray:
    """The E/2 yarn frequencies of a head of E rotary channels."""
    def dim_of(rotations):  # the dimension whose wavelength fits `rotations` times in the original context
        turns = scaling.original_max_position_embeddings / (rotations * 2 * math.pi)
        return e * math.log(turns) / (2 * math.log(theta))
    low, high = dim_of(scaling.beta_fast), dim_of(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, e - 1)
    high = high + 0.001 if low == high else high  # transformers' guard against a zero-width ramp
    ramp_f = np.clip((np.arange(e // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    keep_f = (1 - ramp_f).astype(np.float32)  # 1: the original frequency (extrapolation), 0: interpolated
    wavenumber_f = (theta ** (np.arange(0, e, 2, dtype=np.float32) / np.float32(e))).astype(np.float32)
    original_f, interpolated_f = 1 / wavenumber_f, 1 / (np.float32(scaling.factor) * wavenumber_f)
    return (interpolated_f * (1 - keep_f) + original_f * keep_f).astype(np.float32)
