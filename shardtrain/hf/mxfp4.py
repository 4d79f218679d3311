"""gpt-oss's MXFP4 expert weights (config.json quantization_config, quant_method mxfp4), dequantized
on import: our checkpoint holds them in bfloat16, and export-hf writes bfloat16 without the
quantization_config.

A checkpoint stores an expert projection W, (E, C, R) as transformers computes with it, transposed:
`W_blocks` (E, R, C/32, 16) uint8, two e2m1 (FP4) codes a byte, the low nibble first, and
`W_scales` (E, R, C/32) uint8, each block of 32 values' power of two plus 127. W = FP4[code] x
2^(scale - 127), exact in bfloat16 (as transformers' `convert_moe_packed_tensors`)."""

from __future__ import annotations

import ml_dtypes
import numpy as np

from shardtrain.hf import safetensors_io

FP4 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)
"""e2m1 values by 4-bit code."""


def dequantize(blocks_ergb: np.ndarray, scales_erg: np.ndarray) -> np.ndarray:
    """W (E, C, R) in bfloat16 from its MXFP4 blocks (E, R, G, B) and scales (E, R, G), C = G * 2B."""
    e, r, g, b = blocks_ergb.shape
    codes = np.stack([blocks_ergb & 0x0F, blocks_ergb >> 4], -1).reshape(e, r, g, 2 * b)
    w_ergx = np.ldexp(FP4[codes], scales_erg.astype(np.int32)[..., None] - 127)
    return w_ergx.reshape(e, r, g * 2 * b).transpose(0, 2, 1).astype(ml_dtypes.bfloat16)


class Reader(safetensors_io.Reader):
    """safetensors_io.Reader that also serves each MXFP4 pair `W_blocks`, `W_scales` as `W`, dequantized."""

    def __init__(self, files):
        super().__init__(files)
        self.packed = {name.removesuffix("_blocks") for name in self.where
                       if name.endswith("_blocks") and name.removesuffix("_blocks") + "_scales" in self.where}
        for name in self.packed:
            self.where[name] = self.where[name + "_blocks"]

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self.packed:
            return super().shape(name)
        e, r, g, b = super().shape(name + "_blocks")
        return e, g * 2 * b, r

    def dtype(self, name: str) -> np.dtype:
        return np.dtype(ml_dtypes.bfloat16) if name in self.packed else super().dtype(name)

    def get(self, name: str) -> np.ndarray:
        if name not in self.packed:
            return super().get(name)
        return dequantize(super().get(name + "_blocks"), super().get(name + "_scales"))
