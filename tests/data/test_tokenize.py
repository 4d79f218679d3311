"""sentencepiece and tiktoken vocabularies converted to `tokenizers`: the same ids as the
libraries' own encoders, through `prepare` and back from the dataset's tokenizer.json."""

import base64
import json

import numpy as np
import pytest
import sentencepiece as spm
import tiktoken
from tiktoken import _educational as tiktoken_train

from shardtrain.config import ConfigError
from shardtrain.data import prepare, token_shards, tokenize

RNG = np.random.default_rng(0)
WORDS = ["".join(RNG.choice(list("abcdefghijklmnopqrstuvwxyzäé"), RNG.integers(1, 9))) for _ in range(300)]
TEXT = [f"Document {i}: " + " ".join(RNG.choice(WORDS, 12)) + f", {i * 37}." for i in range(200)]
SAMPLES = ["Hello world", "  leading, and  double  spaces ", "line one\nline two\n\n", "ünïcödé ☃ 日本語 🙂",
           "▁already escaped", "tabs\tand\r\nreturns", "", "w12 word3 w4", "it's they'll 12345 x"]


@pytest.fixture(scope="module", params=["bpe", "unigram"])
def sentencepiece_model(request, tmp_path_factory):
    prefix = tmp_path_factory.mktemp("spm") / request.param
    spm.SentencePieceTrainer.train(sentence_iterator=iter(TEXT), model_prefix=str(prefix), vocab_size=400,
                                   model_type=request.param, byte_fallback=request.param == "bpe",
                                   hard_vocab_limit=False, minloglevel=2)
    return prefix.with_suffix(".model")


def test_sentencepiece_model_encodes_like_sentencepiece_through_prepare(sentencepiece_model, tmp_path):
    sp = spm.SentencePieceProcessor(model_file=str(sentencepiece_model))
    tok = tokenize.load(str(sentencepiece_model))
    assert tok.vocab_size == sp.vocab_size() and tok.eos_id == sp.eos_id()
    docs = SAMPLES + TEXT[:10]
    assert [ids.tolist() for ids in tok.encode_batch(docs)] == [sp.encode(d) for d in docs]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    (tmp_path / "vocab").mkdir()
    (tmp_path / "vocab" / "tokenizer.model").write_bytes(sentencepiece_model.read_bytes())
    out = tmp_path / "ds"
    prepare.prepare([str(tmp_path / "in.jsonl")], prepare.Options(str(tmp_path / "vocab"), str(out)),
                    say=lambda _: None)
    split = token_shards.TokenSplit(str(out), "train")
    tokens, doc_ids, _ = split.read(0, len(split), tok.vocab_size)
    got = [t.tolist() for t in np.split(tokens, np.flatnonzero(np.diff(doc_ids)) + 1)]
    assert got == [sp.encode(d) + [sp.eos_id()] for d in docs]
    saved = tokenize.load(str(out / "tokenizer.json"))  # what training and generation read
    assert [ids.tolist() for ids in saved.encode_batch(docs)] == [sp.encode(d) for d in docs]
    assert saved.decode(sp.encode(TEXT[0])) == sp.decode(sp.encode(TEXT[0])) == TEXT[0]


def test_tiktoken_file_encodes_like_tiktoken(tmp_path):
    ranks = tiktoken_train.bpe_train(" ".join(TEXT), 300, tokenize.TIKTOKEN_PATTERN, visualise=None)
    path = tmp_path / "tokenizer.model"  # Llama 3's name for its tiktoken file
    path.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in ranks.items()))
    enc = tiktoken.Encoding("tiny", pat_str=tokenize.TIKTOKEN_PATTERN, mergeable_ranks=ranks,
                            special_tokens={"<|endoftext|>": len(ranks)})
    tok = tokenize.load(str(path))
    assert tok.vocab_size == enc.n_vocab == 301 and tok.eos_id == enc.eot_token == 300
    docs = SAMPLES + TEXT[:10]
    assert [ids.tolist() for ids in tok.encode_batch(docs)] == [enc.encode_ordinary(d) for d in docs]
    assert tok.decode(enc.encode_ordinary(SAMPLES[3])) == SAMPLES[3]
    assert tokenize.load(str(path), "<|eot|>").eos_id == 300


def test_vocabularies_that_do_not_convert_are_one_line_errors(tmp_path):
    (tmp_path / "bad.model").write_bytes(b"\x00\xffnot a model")
    (tmp_path / "bad.tiktoken").write_text("aGk= 0\nnot base64!! 1\n")
    with pytest.raises(ConfigError, match="bad.model: not a sentencepiece model"):
        tokenize.load(str(tmp_path / "bad.model"))
    with pytest.raises(ConfigError, match="bad.tiktoken:2: not a tiktoken line"):
        tokenize.load(str(tmp_path / "bad.tiktoken"))
    with pytest.raises(ConfigError, match="a sentencepiece tokenizer.model, a tiktoken file"):
        tokenize.load(str(tmp_path / "none.model"))
