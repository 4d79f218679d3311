"""A small residual MLP language model over byte tokens (no attention): the fastest test model.

Shapes: B batch, T sequence, D d_model, F d_ff, V vocab, L layers.
"""

from __future__ import annotations

import jax
from flax import nnx

from models.contract import no_constraint
from models.layers import BTD, BTF, BTV, dense, embed_lookup, lookup_table, matmul_params, param, scan_blocks, stacked

normal = nnx.initializers.normal


class Block(nnx.Module):
    def __init__(self, cfg, *, rngs: nnx.Rngs, constrain=no_constraint, quantization="none"):
        self.constrain, self.quantization = constrain, quantization
        self.w_in_df = param(rngs, normal(cfg.d_model ** -0.5), (cfg.d_model, cfg.d_ff), ("embed", "mlp"))
        self.w_out_fd = param(rngs, normal(cfg.d_ff ** -0.5 / 2), (cfg.d_ff, cfg.d_model), ("mlp", "embed"))

    def __call__(self, x_btd, segment_ids_bt=None, positions_bt=None):  # tokens do not mix: ignored
        q = self.quantization
        h_btf = self.constrain(jax.nn.gelu(dense(x_btd, self.w_in_df[...], quantization=q)), BTF)
        return self.constrain(x_btd + dense(h_btf, self.w_out_fd[...], quantization=q), BTD)


class Mlp(nnx.Module):
    @staticmethod
    def adaptable(cfg) -> dict[str, str]:
        """No weight here takes LoRA adapters."""
        return {}

    def __init__(self, cfg, *, rngs: nnx.Rngs, constrain=no_constraint, quantization="none"):
        self.constrain, self.embed_how = constrain, cfg.embed
        self.embedding_vd = param(rngs, normal(1.0), (cfg.vocab_size, cfg.d_model), ("vocab", "embed"))
        self.blocks = stacked(lambda r: Block(cfg, rngs=r, constrain=constrain, quantization=quantization),
                              cfg.n_layers, rngs)
        self.unembed_dv = param(rngs, normal(cfg.d_model ** -0.5), (cfg.d_model, cfg.vocab_size), ("embed", "vocab"))

    def embed(self, tokens_bt):
        table_vd = lookup_table(self.embedding_vd[...], self.constrain)
        return self.constrain(embed_lookup(table_vd, tokens_bt, self.embed_how), BTD)

    def unembedding(self):
        """The unembedding (D, V), whole along d_model (see gpt.GPT.unembedding)."""
        return self.constrain(self.unembed_dv[...], (None, "vocab"))

    def head(self, x_btd, unembed_dv=None):
        return self.constrain(dense(x_btd, self.unembed_dv[...] if unembed_dv is None else unembed_dv), BTV)

    def __call__(self, tokens_bt, segment_ids_bt=None, positions_bt=None):
        return self.head(scan_blocks(self.blocks, self.embed(tokens_bt)))

    @staticmethod
    def flops_per_token(cfg, n_params: int, seq_len: int) -> float:
        """Training FLOPs per token: 6N for the matmuls, forward + backward (N without a gathered
        embedding table; no attention)."""
        return 6 * matmul_params(cfg, n_params)
