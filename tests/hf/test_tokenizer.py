"""The tokenizer that goes with a run's weights (hf/tokenizer.py): a model trained from scratch on
prepared tokens generates and exports with the tokenizer and EOS of its data, and the export
carries EOS where transformers reads it, through import-hf and back (issue 25)."""

import json
from pathlib import Path

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


def test_the_models_tokenizer_and_the_datas_are_the_same_or_the_run_stops(tmp_path, capsys):
    """Issue 38. An imported BPE model (import-hf records its tokenizer's fingerprint as data.tokenizer,
    in config.yaml and checkpoint meta) refuses in one line, before anything trains, data.source=text
    and data prepared with `bytes`, naming both tokenizers and the fix; data prepared with its own
    tokenizer trains and the run records it; a resumed run and a mixture are held to one tokenizer;
    data.allow_tokenizer_mismatch=true is the way to do it on purpose."""
    from hf_reference import FIXTURES

    from shardtrain import cli
    from shardtrain.checkpoint import listing
    from shardtrain.data import prepare
    imp, text = tmp_path / "imp", str(Path(weights.__file__).parent / "*.py")
    weights.import_hf(str(FIXTURES / "qwen2"), str(imp), say=lambda _: None)
    fp = tokenize.fingerprint_of(FIXTURES / "qwen2")
    assert fp.startswith("320 tokens, sha256 ") and fp == tokenize.fingerprint_of(imp)
    assert config.load(str(imp / "config.yaml")).data.tokenizer == fp
    assert listing.read_meta(imp / "checkpoints" / "0")["config"]["data"]["tokenizer"] == fp
    for spec, out in (("bytes", "bytes"), (str(imp), "own")):
        prepare.prepare([text], prepare.Options(spec, str(tmp_path / out)), workers=1, say=lambda _: None)
    assert json.loads((tmp_path / "own" / "manifest.json").read_text())["tokenizer_fingerprint"] == fp
    train = ["train", str(imp / "config.yaml"), "data.seq_len=16", "train.global_batch_size=8", "train.steps=2",
             "optimizer.warmup_steps=1", "train.compile_cache=false"]
    whose = f"the model of checkpoint.init_from={imp} reads another tokenizer ({fp})"
    for data, says in [(["data.source=text", f"data.path={text}"], f"data.source=text feeds UTF-8 bytes as token "
                                                                    f"ids, but {whose}"),
                       ([f"data.path={tmp_path / 'bytes'}"], f"was made by the tokenizer bytes, but {whose}")]:
        with pytest.raises(SystemExit) as e:
            cli.main([*train, *data, f"run_dir={tmp_path / 'refused'}"])
        err = capsys.readouterr().err
        assert e.value.code == 2 and says in err and f"--tokenizer {imp} " in err, err
        assert len(err.strip().splitlines()) == 1 and not (tmp_path / "refused" / "metrics.jsonl").exists()
    with pytest.raises(SystemExit) as e:
        cli.main([*train, f"data.path={tmp_path / 'own'}", f"run_dir={tmp_path / 'run'}"])
    assert e.value.code == 0 and config.load(str(tmp_path / "run" / "config.yaml")).data.tokenizer == fp

    def check(*overrides):
        cfg = config.load(None, ["data.source=tokens", "model.vocab_size=320", f"run_dir={tmp_path / 'new'}",
                                 *overrides])
        return weights.check_tokenizer(cfg, loader.sources(cfg))
    with pytest.raises(ConfigError, match=r"was made by the tokenizer bytes, but the model of this run's checkpoint "
                                          rf"step 2 reads another tokenizer \({fp}\).*--tokenizer {imp} "):
        check(f"run_dir={tmp_path / 'run'}", f"data.path={tmp_path / 'bytes'}")  # a resume on other data
    with pytest.raises(ConfigError, match="data.mixture: the datasets come from different tokenizers"):
        check(f"data.mixture=[{{path: {tmp_path / 'bytes'}}}, {{path: {tmp_path / 'own'}}}]")
    allowed = check(f"checkpoint.init_from={imp}", f"data.path={tmp_path / 'bytes'}",
                    "data.allow_tokenizer_mismatch=true")
    assert allowed.data.tokenizer == "bytes"
