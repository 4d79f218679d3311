"""Chat data (`shardtrain prepare --chat`): the loss mask marks exactly the assistant's tokens
(with and without `{% generation %}` in the template), the train step's loss is the mean over
those tokens of each conversation run alone (2x2x2 with gradient accumulation and one device),
and malformed input exits 2 naming FILE:LINE."""

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from tokenizers import Tokenizer, decoders, models as tok_models, pre_tokenizers, processors, trainers

import models
from shardtrain import cli, generate, step
from shardtrain.config import ConfigError
from shardtrain.data import chat, prepare, token_shards, tokenize
from shardtrain.parallel import mesh as mesh_lib, sharding

SPECIAL = ["<eos>", "<bos>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
PLAIN = ("{{ bos_token }}{% for m in messages %}<|{{ m.role }}|>{{ m.content }}<|end|>{% endfor %}"
         "{% if add_generation_prompt %}<|assistant|>{% endif %}")
TRACKED = ("{{ bos_token }}{% for m in messages %}<|{{ m.role }}|>{% if m.role == 'assistant' %}"
           "{% generation %}{{ m.content }}<|end|>{% endgeneration %}{% else %}{{ m.content }}<|end|>{% endif %}"
           "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
WORDS = "the cat sat on a mat and then it ran off to see what the dog was doing in the garden".split()


def conversation(i: int) -> list[dict]:
    def words(n, k):
        return " ".join(WORDS[(i * 5 + k * 3 + j) % len(WORDS)] for j in range(n))
    turns = [{"role": "system", "content": words(3, 9)}] if i % 3 == 0 else []
    for k in range(1 + i % 2):
        turns += [{"role": "user", "content": words(2 + (i + k) % 4, k)},
                  {"role": "assistant", "content": words(1 + (i * 3 + k) % 5, k + 1)}]
    return turns


CONVERSATIONS = [conversation(i) for i in range(24)]


def tokenizer_dir(root, template):
    d = root / ("tracked" if "{% generation %}" in template else "plain")
    d.mkdir()
    tok = Tokenizer(tok_models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([" ".join(WORDS)] * 4, trainers.BpeTrainer(
        vocab_size=300, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.post_processor = processors.TemplateProcessing(  # Llama's: BOS before every encoded text
        single="<bos> $A", special_tokens=[("<bos>", tok.token_to_id("<bos>"))])
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<bos>", "eos_token": "<eos>", "chat_template": template}))
    return d


@pytest.fixture(scope="module")
def chat_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat")
    (root / "chat.jsonl").write_text("\n".join(json.dumps({"messages": c}) for c in CONVERSATIONS) + "\n")
    dirs = {}
    for template in (PLAIN, TRACKED):
        tok_dir = tokenizer_dir(root, template)
        out = root / f"ds-{tok_dir.name}"
        prepare.prepare([str(root / "chat.jsonl")], prepare.Options(str(tok_dir), str(out), chat=True), workers=1,
                        say=lambda _: None)
        dirs[tok_dir.name] = (tok_dir, out)
    return root, dirs


def expected(tok, messages):
    """Token ids of a conversation and its mask, built piece by piece: special tokens split the
    text, so each content is tokenized on its own; the assistant's content and its <|end|> count."""
    def ids(text):
        return tok.tok.encode(text, add_special_tokens=False).ids
    out, mask = ids("<bos>"), [0]
    for m in messages:
        role, body, end = ids(f"<|{m['role']}|>"), ids(m["content"]), ids("<|end|>")
        counted = int(m["role"] == "assistant")
        out += role + body + end
        mask += [0] * len(role) + [counted] * (len(body) + len(end))
    return out + [tok.eos_id], mask + [0]


@pytest.mark.parametrize("kind", ["plain", "tracked"])
def test_mask_marks_exactly_the_assistant_tokens(chat_data, kind):
    tok_dir, out = chat_data[1][kind]
    tok = tokenize.load(str(tok_dir))
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["loss_mask"] is True
    split = token_shards.TokenSplit(str(out), "train")
    tokens, docs, _ = split.read(0, len(split), 1 << 20)
    mask = split.read_mask(0, len(split))
    want = [expected(tok, c) for c in CONVERSATIONS]
    assert tokens.tolist() == sum((w[0] for w in want), [])
    assert mask.tolist() == sum((w[1] for w in want), [])
    assert mask.sum() > 0 and (mask == 0).sum() > mask.sum() / 2
    window = token_shards.PackedWindows(split, 16, 320)[1]
    assert window["loss_mask"].tolist() == mask[16:32].tolist()


def test_one_tokenizer_loader_special_tokens_by_switch(chat_data):
    """prepare encodes without the post-processor's BOS (the template writes it: one BOS per
    conversation, checked above); generate loads the same class and encodes prompts with it."""
    tok_dir = chat_data[1]["plain"][0]
    gen_tok = generate.load_tokenizer(tok_dir)
    assert isinstance(gen_tok, tokenize.HfTokenizer)
    bos, plain = gen_tok.token_to_id("<bos>"), gen_tok.encode("the cat sat")
    assert plain and bos not in plain and gen_tok.encode("the cat sat", add_special_tokens=True) == [bos, *plain]
    assert tokenize.load(str(tok_dir)).encode_batch(["the cat sat"])[0].tolist() == plain


def packed_batch(tok, rows: int, width: int):
    """Whole conversations (tokens + EOS, as prepare writes them) packed into rows, the last one
    of a row cut at its end; with segment ids, positions and the loss mask; and the pieces."""
    pieces, batch = [], {k: np.zeros((rows, width), np.int32) for k in step.PACKED_FIELDS}
    convs = iter(CONVERSATIONS * 4)
    for r in range(rows):
        at, seg = 0, 0
        while at < width:
            ids, mask = expected(tok, next(convs))
            n = min(len(ids), width - at)
            for key, value in [("tokens", ids[:n]), ("segment_ids", [seg] * n), ("positions", range(n)),
                               ("loss_mask", mask[:n])]:
                batch[key][r, at:at + n] = value
            pieces.append((np.array(ids[:n]), np.array(mask[:n])))
            at, seg = at + n, seg + 1
    return batch, pieces


@pytest.mark.slow
def test_train_step_loss_is_the_mean_over_assistant_tokens_sharded_and_one_device(chat_data, cfg_factory):
    tok = tokenize.load(str(chat_data[1]["plain"][0]))
    small = ["data.source=tokens", "data.path=unused", "model.vocab_size=320", "data.seq_len=23",
             "model.d_model=32", "model.n_heads=4", "model.n_kv_heads=2", "model.n_layers=2", "model.d_ff=64",
             "train.global_batch_size=8", "optimizer.warmup_steps=0"]
    batch, pieces = packed_batch(tok, 8, 24)
    cfg = cfg_factory(*small)
    params = jax.device_get(nnx.to_pure_dict(nnx.split(models.get("gpt")(cfg.model, rngs=nnx.Rngs(0)))[1]))
    # the train step on 2x2x2 with two micro-batches: its loss metric
    cfg = cfg_factory(*small, "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", "train.grad_accum_steps=2")
    prog = step.build(cfg, mesh_lib.make_mesh(cfg.mesh))
    state = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype, device=x.sharding), prog.abstract_state)
    state["params"] = jax.device_put(params, prog.state_shardings["params"])
    sharded = float(prog.step(state, prog.device_batch(batch))[1]["loss"])

    model = nnx.merge(nnx.split(sharding.abstract_model(cfg))[0], params)  # unsharded, on one device
    # each conversation alone in its own row, right-padded (causal: padding never reaches earlier
    # positions); the loss counts the positions whose target is an assistant token
    ids_nt, mask_nt = np.zeros((len(pieces), 24), np.int32), np.zeros((len(pieces), 24), np.int32)
    for i, (ids, mask) in enumerate(pieces):
        ids_nt[i, :len(ids)], mask_nt[i, :len(ids)] = ids, mask
    logits_ntv = jax.jit(lambda t: model(t))(jnp.asarray(ids_nt[:, :-1]))
    ce_nt = optax.softmax_cross_entropy_with_integer_labels(logits_ntv, jnp.asarray(ids_nt[:, 1:]))
    want = float((ce_nt * mask_nt[:, 1:]).sum() / mask_nt[:, 1:].sum())
    assert abs(sharded - want) < 1e-5 * want, (sharded, want)
    valid_nt = np.arange(23)[None, :] < np.array([len(p[0]) - 1 for p in pieces])[:, None]
    assert abs(float((ce_nt * valid_nt).sum() / valid_nt.sum()) - want) > 1e-3  # the mask matters here


def test_renders_as_transformers_apply_chat_template(chat_data):
    """The text (ChatML, the Qwen2 fixture's template) and the {% generation %} mask are what
    transformers' apply_chat_template makes of the same conversations."""
    transformers = pytest.importorskip("transformers")
    fixture = Path(__file__).parent.parent / "fixtures"
    rows = [json.loads(line)["messages"] for line in (fixture / "chat.jsonl").read_text().splitlines()]
    ours, theirs = chat.ChatTemplate(fixture / "hf" / "qwen2"), transformers.AutoTokenizer.from_pretrained(
        fixture / "hf" / "qwen2")
    for messages in rows:
        assert ours.render(messages, "x")[0] == theirs.apply_chat_template(messages, tokenize=False)
    gen = generate.Generator(None, None, None, generate.load_tokenizer(fixture / "hf" / "qwen2"),
                             files_dir=fixture / "hf" / "qwen2")  # generate --chat's prompt ids
    asked = [{"role": "user", "content": "Reverse a list."}]
    assert gen.encode_chat("Reverse a list.") == list(theirs.apply_chat_template(
        asked, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"])
    tok_dir = chat_data[1]["tracked"][0]
    ours, theirs = chat.ChatTemplate(tok_dir), transformers.AutoTokenizer.from_pretrained(tok_dir)
    tok = tokenize.load(str(tok_dir))
    for messages in CONVERSATIONS[:6]:
        ids, mask = chat.encode(tok, *map(list, zip(ours.render(messages, "x"))))[0]
        out = theirs.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        assert ids.tolist() == list(out["input_ids"]) and mask.tolist() == list(out["assistant_masks"])


def run_cli(capsys, *argv):
    with pytest.raises(SystemExit) as e:
        cli.main(list(argv))
    return e.value.code, capsys.readouterr().err


@pytest.mark.parametrize("lines, message", [
    (['{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}',
      '{"text": "no messages"}'], "bad.jsonl:2: no 'messages' list (has: text)"),
    (['', '{"messages": [{"role": "user", "content": "hi"}, {"role": "bot", "content": "yo"}]}'],
     "bad.jsonl:2: message 1 has role 'bot'; known roles: system, user, assistant, tool"),
    (['{"messages": [{"role": "user", "content": "hi"}]}'], "bad.jsonl:1: no assistant message"),
    (['{"messages": [{"role": "user", "content": ["hi"]}, {"role": "assistant", "content": "yo"}]}'],
     "bad.jsonl:1: message 0 (user) has no string 'content'"),
])
def test_bad_conversations_exit_2_naming_file_and_line(capsys, tmp_path, chat_data, lines, message):
    (tmp_path / "bad.jsonl").write_text("\n".join(lines) + "\n")
    code, err = run_cli(capsys, "prepare", str(tmp_path / "bad.jsonl"), "--tokenizer",
                        str(chat_data[1]["plain"][0]), "--out", str(tmp_path / "out"), "--chat")
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err


def test_chat_needs_a_template_and_jsonl(capsys, tmp_path, chat_data):
    root, dirs = chat_data
    bare = tmp_path / "bare"
    bare.mkdir()
    (root / "notes.txt").write_text("plain text is no conversation")
    (bare / "tokenizer.json").write_text((dirs["plain"][0] / "tokenizer.json").read_text())
    for tok_arg, data, message in [
            (bare, root / "chat.jsonl", f"--chat: {bare} has no chat template"),
            (dirs["plain"][0], root / "notes.txt", "--chat reads JSONL files"),
            ("bytes", root / "chat.jsonl", "--chat needs a Hugging Face tokenizer directory")]:
        code, err = run_cli(capsys, "prepare", str(data), "--tokenizer", str(tok_arg), "--out",
                            str(tmp_path / "out"), "--chat")
        assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
    messages = CONVERSATIONS[1]
    broken = chat.ChatTemplate(dirs["plain"][0])  # a template that rewrites earlier turns
    broken.template = broken.env.from_string(
        "{% for m in messages %}{{ m.content if loop.last else m.role }}|{% endfor %}"
        "{% if add_generation_prompt %}A:{% endif %}")
    with pytest.raises(ConfigError, match="x.jsonl:7: the chat template does not render the conversation up"):
        broken.render(messages, "x.jsonl:7")


def test_eos_token_is_known_without_tokenizer_config_and_an_undefined_variable_exits_2(capsys, tmp_path, chat_data):
    """A directory with only tokenizer.json and a template (a base model's, issue 25): `{{ eos_token }}`
    renders the EOS prepare ends documents with, where transformers would print nothing; a variable
    nothing defines (here bos_token, or a typo) exits 2 naming it instead of rendering empty."""
    root, dirs = chat_data
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "tokenizer.json").write_text((dirs["plain"][0] / "tokenizer.json").read_text())
    turn = ("{% for m in messages %}{{ m.role }}: {{ m.content }}{% if m.role == 'assistant' %}{{ eos_token }}"
            "{% endif %}\n")
    (bare / "chat_template.jinja").write_text(turn + "{% endfor %}")
    text, spans = chat.ChatTemplate(bare, tokenize.load(str(bare))).render(CONVERSATIONS[1], "x")
    assert text.count("<eos>") == sum(m["role"] == "assistant" for m in CONVERSATIONS[1]) == 2
    assert all(text[lo:hi].endswith("<eos>") for lo, hi in spans)  # the EOS is an assistant token
    for variable in ("bos_token", "nosuchvariable"):
        (bare / "chat_template.jinja").write_text(f"{{{{ {variable} }}}}" + turn + "{% endfor %}")
        code, err = run_cli(capsys, "prepare", str(root / "chat.jsonl"), "--tokenizer", str(bare), "--out",
                            str(tmp_path / "out"), "--chat")
        assert code == 2 and f"'{variable}' is undefined" in err and len(err.strip().splitlines()) == 1, err


def test_example_template_turns_a_base_model_into_a_chat_model(tmp_path, chat_data):
    """examples/chat_template.jinja (README): BOS once, each reply and its EOS are the assistant's tokens."""
    d = tmp_path / "base"
    d.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (d / name).write_text((chat_data[1]["plain"][0] / name).read_text())
    (d / "chat_template.jinja").write_text((Path(__file__).parents[2] / "examples" / "chat_template.jinja").read_text())
    template = chat.ChatTemplate(d, tokenize.load(str(d)))
    text, spans = template.render(CONVERSATIONS[1], "x")
    replies = [m["content"] for m in CONVERSATIONS[1] if m["role"] == "assistant"]
    assert text.startswith("<bos>User: ") and [text[lo:hi] for lo, hi in spans] == [f" {r}<eos>\n" for r in replies]
    assert template.prompt(CONVERSATIONS[1][:1]).endswith("\nAssistant:")


@pytest.mark.parametrize("template, limit", [
    ("{% for m in messages %}{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
     "{{ m['content'] }}{% endfor %}", "rendering took more than 1 s"),
    ("{{ 'x' * 10**10 }}", "a sequence of 1 x 10000000000 items"),
    ("{{ 'x'.center(10**10) }}", "a count or width of 10000000000"),
    ("{{ 'x' | indent(10**10) }}", "a count or width of 10000000000"),
    ("{{ '%10000000000s' % 1 }}", "a count or width of 10000000000"),
    ("{{ '{:>10000000000}'.format(1) }}", "a count or width of 10000000000"),
    ("{{ 7 ** (10**9) }}", "7 ** 1000000000 has more than"),
    ("{% for i in range(100000) %}{{ 'abcdefghij' * 100 }}{% endfor %}", "the text grew past 8388608 characters"),
])
def test_a_runaway_template_is_one_line_naming_it_and_the_limit(capsys, tmp_path, chat_data, monkeypatch,
                                                               template, limit):
    """A template renders a conversation under chat.RENDER_SECONDS (here 1 s) and OUTPUT_CHARS, and
    the bounded sandbox refuses a string or number past OUTPUT_CHARS before allocating it."""
    monkeypatch.setattr(chat, "RENDER_SECONDS", 1)
    root, dirs = chat_data
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "tokenizer.json").write_text((dirs["plain"][0] / "tokenizer.json").read_text())
    (bad / "chat_template.jinja").write_text(template)
    code, err = run_cli(capsys, "prepare", str(root / "chat.jsonl"), "--tokenizer", str(bad), "--out",
                        str(tmp_path / "out"), "--chat", "--workers", "1")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"chat.jsonl:1: the chat template ({bad / 'chat_template.jinja'}) went past its limits ({limit}" in err, err
