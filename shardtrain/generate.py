"""Text generation with a KV cache on the mesh: greedy, temperature and top-p sampling.

`shardtrain generate SOURCE --prompt TEXT` (SOURCE: an HF model directory, an import-hf
directory, a run directory or a checkpoint step) and `Generator.from_source(...).generate(...)`.
Prompts of a batch are left-padded to one length; each row's rotary positions start at its first
real token and its padding slots are masked out of attention (models/gpt.py `Gpt.decode`). The
prompt is run once (prefill, writing the cache), then one jitted step per new token: the sampled
token goes back in and its keys and values are written at the next cache slot. Parameters and
cache are sharded by the rules like in training (heads over `tensor`). Good enough to see what a
run learned; not a serving system (no continuous batching, no paged cache). The tokenizer and EOS
are the source's, found along its chain (hf/tokenizer.py: the run, checkpoint.init_from, the run's
prepared data); a run on bytes (data.source=text) reads and writes UTF-8 bytes.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from shardtrain import config as config_lib, weights
from shardtrain.data import chat, tokenize
from shardtrain.parallel import mesh as mesh_lib, sharding


def load_tokenizer(files_dir: Path | None) -> tokenize.HfTokenizer | None:
    """The tokenizer of a model directory's tokenizer.json (None if there is none), loaded as
    `shardtrain prepare` loads it; EOS comes from the model's configs (hf/tokenizer.py)."""
    if files_dir is None or not (files_dir / "tokenizer.json").is_file():
        return None
    return tokenize.HfTokenizer(files_dir / "tokenizer.json", require_eos=False)


def tensor_ways(m: config_lib.ModelConfig, n_devices: int) -> int:
    """The most devices (dividing the count) whose number divides every tensor-sharded dimension."""
    dims = (m.n_heads, m.n_kv_heads, m.d_ff, m.vocab_size, *([m.linear_attention.value_heads] if m.linear_attention
                                                             else []))
    return max(t for t in range(1, n_devices + 1) if n_devices % t == 0 and all(x % t == 0 for x in dims))


def sample(logits_bv, key, temperature: float, top_p: float):
    """Greedy at temperature 0; else a draw from softmax(logits / T) restricted to the smallest
    set of tokens whose probability reaches top_p."""
    if temperature == 0:
        return jnp.argmax(logits_bv, axis=-1).astype(jnp.int32)
    logits_bv = logits_bv.astype(jnp.float32) / temperature
    if top_p < 1.0:
        sorted_bv = jnp.sort(logits_bv, axis=-1)[:, ::-1]
        cum_bv = jnp.cumsum(jax.nn.softmax(sorted_bv, axis=-1), axis=-1)
        keep = jnp.sum(cum_bv - jax.nn.softmax(sorted_bv, axis=-1) < top_p, axis=-1, keepdims=True)
        threshold_b1 = jnp.take_along_axis(sorted_bv, keep - 1, axis=-1)
        logits_bv = jnp.where(logits_bv < threshold_b1, -jnp.inf, logits_bv)
    return jax.random.categorical(key, logits_bv, axis=-1).astype(jnp.int32)


@dataclasses.dataclass
class Generator:
    cfg: config_lib.RunConfig
    model: nnx.Module
    """The model with its parameters, sharded over `mesh`."""
    mesh: jax.sharding.Mesh
    tokenizer: object = None
    eos: tuple[int, ...] = ()
    files_dir: Path | None = None
    """The directory of the tokenizer files (chat template included)."""
    searched: tuple[Path, ...] = ()
    """Where the tokenizer was looked for."""

    @classmethod
    def from_source(cls, path: str | Path, overrides: Sequence[str] = ()) -> Generator:
        """Loads a model from an HF directory, import-hf directory, run directory or checkpoint step.
        `overrides` are config KEY=VALUEs (mesh.*, rules.*); by default heads are split over as
        many devices as divide them (tensor parallelism), everything else replicated; the prompts
        are not split (rules.batch=null), so mesh.fsdp > 1 shards only the weights."""
        source = weights.find(path, what="generate")
        n = jax.device_count()
        mesh_overrides = [f"mesh.tensor={tensor_ways(source.model, n)}", "mesh.data=1", "rules.batch=null"]
        cfg = config_lib.load(None, ["run_dir=/tmp/shardtrain-generate", "train.global_batch_size=1",
                                     *mesh_overrides, *overrides])
        cfg = dataclasses.replace(cfg, model=source.model)
        sizes = cfg.mesh.sizes().values()  # a mesh of fewer devices than present uses the first ones
        mesh = mesh_lib.make_mesh(cfg.mesh, jax.devices()[:math.prod(sizes)] if min(sizes) > 0 else None)
        layout = sharding.param_layout(cfg, mesh)  # no train step: only the parameters' layout
        found = source.tokenizer()
        return cls(cfg, nnx.merge(layout.graphdef, source.params(layout.params)), mesh, found.load(),
                   found.eos_ids, found.dir, tuple(source.dirs))

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise config_lib.ConfigError(f"generate: no tokenizer.json in {', '.join(map(str, self.searched))} (the "
                                         "weights, checkpoint.init_from, the run's data.path); copy the tokenizer.json "
                                         "the data was prepared with into the first")
        return self.tokenizer.encode(text, add_special_tokens=True)  # BOS where the tokenizer adds one

    def encode_chat(self, text: str) -> list[int]:
        """`text` as a user turn through the model's chat template, the assistant's turn opened (the
        template writes BOS and the turn markers: no special tokens are added)."""
        if self.files_dir is None:
            raise config_lib.ConfigError(f"generate --chat: no tokenizer.json (with a chat template) in "
                                         f"{', '.join(map(str, self.searched))}")
        template = chat.ChatTemplate(self.files_dir, self.tokenizer)
        return self.tokenizer.encode(template.prompt([{"role": "user", "content": text}]))

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids) if self.tokenizer else ""

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int = 32, *, temperature: float = 0.0,
                 top_p: float = 1.0, seed: int = 0, stop_at_eos: bool = True,
                 on_tokens: Callable[[np.ndarray], None] | None = None) -> list[list[int]]:
        """New token ids for each prompt (token ids), up to and including an EOS. `on_tokens`
        receives each step's (B,) tokens as they come (for streaming)."""
        if not prompts or any(len(p) == 0 for p in prompts):
            raise config_lib.ConfigError("generate: every prompt needs at least one token")
        m = self.cfg.model
        b, p = len(prompts), max(len(x) for x in prompts)
        first_b = np.array([p - len(x) for x in prompts], np.int32)
        tokens_bp = np.zeros((b, p), np.int32)
        for row, x in enumerate(prompts):
            tokens_bp[row, first_b[row]:] = x
        positions_bp = np.maximum(np.arange(p)[None, :] - first_b[:, None], 0).astype(np.int32)
        layout = type(self.model).cache_layout(m, b, p + max_new_tokens)
        cache_specs = tuple((k, shape, NamedSharding(self.mesh, sharding.spec_for(
            names, self.cfg.rules, self.mesh, shape=shape, what=f"KV cache {shape}")))
            for k, (shape, names) in layout.items())
        dtype = jnp.dtype(self.cfg.train.compute_dtype)
        graphdef, params = nnx.split(self.model)
        static = dict(graphdef=graphdef, cache_specs=cache_specs, dtype=dtype, temperature=temperature, top_p=top_p)
        prefill = functools.partial(_prefill, **static)
        next_token = functools.partial(_next_token, graphdef=graphdef, temperature=temperature, top_p=top_p)
        keys = jax.random.split(jax.random.key(seed), max_new_tokens)
        with jax.set_mesh(self.mesh):
            token_b, cache = prefill(params, tokens_bp, positions_bp, first_b, keys[0])
            out = [[] for _ in range(b)]
            done = np.zeros(b, bool)
            lengths = np.array([len(x) for x in prompts], np.int32)
            for n in range(max_new_tokens):
                host_b = np.asarray(token_b)
                for row in np.flatnonzero(~done):
                    out[row].append(int(host_b[row]))
                if on_tokens is not None:
                    on_tokens(np.where(done, -1, host_b))
                if stop_at_eos:
                    done |= np.isin(host_b, self.eos)
                if done.all() or n == max_new_tokens - 1:
                    break
                token_b, cache = next_token(params, cache, token_b, p + n, lengths + n, first_b, keys[n + 1])
        return out


@functools.partial(jax.jit, static_argnames=("graphdef", "cache_specs", "dtype", "temperature", "top_p"))
def _prefill(params, tokens_bp, positions_bp, first_b, key, *, graphdef, cache_specs, dtype, temperature, top_p):
    """Runs the prompts through the model, filling a fresh cache ((name, shape, sharding) each of
    `cache_specs`); samples the first new token."""
    cache = {k: jax.lax.with_sharding_constraint(jnp.zeros(shape, dtype), where) for k, shape, where in cache_specs}
    logits_btv, cache = nnx.merge(graphdef, params).decode(tokens_bp, cache, 0, positions_bp, first_b)
    return sample(logits_btv[:, -1], key, temperature, top_p), cache


@functools.partial(jax.jit, static_argnames=("graphdef", "temperature", "top_p"), donate_argnums=1)
def _next_token(params, cache, token_b, slot, position_b, first_b, key, *, graphdef, temperature, top_p):
    """One decoding step: the last token in at cache slot `slot`, the next token out."""
    logits_btv, cache = nnx.merge(graphdef, params).decode(token_b[:, None], cache, slot, position_b[:, None], first_b)
    return sample(logits_btv[:, 0], key, temperature, top_p), cache
