"""The tokenizer that goes with a run's weights (hf/tokenizer.py): a model trained from scratch on
prepared tokens generates and exports with the tokenizer and EOS of its data, and the export
carries EOS where transformers reads it, through import-hf and back (issue 25)."""

import json

import jax
import jax.numpy as jnp
import pytest

from shardtrain import config, generate, weights
from shardtrain.config import ConfigError
from shardtrain.data import loader, tokenize
from shardtrain.hf import tokenizer as hf_tokenizer


@pytest.fixture(scope="module")
def scratch_run(prepared, tmp_path_factory):
    """A Llama "trained from scratch" on the prepared tokens, saved as step 0 of its run; its weights
    are zeros, so its logits are all equal and greedy decoding picks id 0, the tokenizer's EOS."""
    run = tmp_path_factory.mktemp("scratch")
    cfg = config.load(None, [f"run_dir={run}", "model.name=llama", "model.vocab_size=320", "model.d_model=32",
                             "model.n_layers=1", "model.d_ff=64", "data.source=tokens", f"data.path={prepared}",
                             "data.seq_len=15", "train.global_batch_size=8"])
    layout = weights.fsdp_layout(cfg)
    weights.save_params(cfg, layout, jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype, device=a.sharding),
                                                  layout.params))
    return run


def test_generate_of_a_scratch_run_uses_its_datas_tokenizer_and_stops_at_eos(scratch_run, prepared, tok_path):
    gen = generate.Generator.from_source(scratch_run)  # it used to say "no tokenizer.json beside these weights"
    eos = json.loads((prepared / "manifest.json").read_text())["eos_id"]
    assert gen.files_dir == prepared and gen.eos == (eos,) == (0,)
    ids = gen.encode("document 7: w1 w2")
    assert ids == tokenize.load(str(tok_path)).encode("document 7: w1 w2")
    assert gen.generate([ids], 4) == [[0]]  # the zero model emits EOS at every step: it stopped at the first
    with pytest.raises(ConfigError, match="'.*/checkpoints/7' does not exist; committed steps there: 0"):
        weights.find(scratch_run / "checkpoints" / "7", what="export-hf")


def test_export_of_a_scratch_run_carries_tokenizer_and_eos_through_transformers_and_import(
        scratch_run, prepared, tmp_path):
    transformers = pytest.importorskip("transformers")
    said = []
    weights.export_hf(str(scratch_run), str(tmp_path / "hf"), say=said.append)
    eos = json.loads((prepared / "manifest.json").read_text())["eos_id"]
    assert "tokenizer from" in said[0] and len(said) == 1, said
    assert not (tmp_path / "hf" / "model.safetensors.index.json").exists()  # one file: no index (README)
    for name in ("config.json", "generation_config.json"):
        assert json.loads((tmp_path / "hf" / name).read_text())["eos_token_id"] == eos
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert theirs.eos_token == "<|endoftext|>" and theirs.eos_token_id == eos
    assert transformers.GenerationConfig.from_pretrained(tmp_path / "hf").eos_token_id == eos
    assert theirs("document 7: w1 w2")["input_ids"] == tokenize.load(str(prepared)).encode("document 7: w1 w2")
    weights.import_hf(str(tmp_path / "hf"), str(tmp_path / "imp"), say=said.append)
    assert "EOS '<|endoftext|>' (id 0)" in said[-1] and "shardtrain prepare INPUT... --tokenizer" in said[-1]
    assert hf_tokenizer.find([tmp_path / "imp"], {}).eos_ids == (eos,)
    imported = config.load(str(tmp_path / "imp" / "config.yaml"))  # trains on nothing until data.path is set
    with pytest.raises(ConfigError, match="PREPARED_DATA_DIR is a placeholder to fill in"):
        loader.sources(imported)


@pytest.mark.parametrize("source, tokenizer, message", [
    ("text", tokenize.ByteTokenizer, "no tokenizer written: the model reads UTF-8 bytes as ids"),
    ("synthetic", type(None), "no tokenizer found in the run dir, checkpoint.init_from or the run's data.path"),
])
def test_a_run_without_tokenizer_files_says_so(tmp_path, source, tokenizer, message):
    found = hf_tokenizer.find([tmp_path], {"data": {"source": source}})
    assert isinstance(found.load(), tokenizer) and found.eos_ids == ()
    assert hf_tokenizer.write(tmp_path, found).startswith(message)
