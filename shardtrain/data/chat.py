"""Chat data: conversations rendered through the tokenizer's chat template, with a loss mask
that keeps only the assistant's tokens (`shardtrain prepare --chat`).

Input: JSONL, one conversation a line: {"messages": [{"role": "user", "content": "..."}, ...]}
(roles: system, user, assistant, tool; content a string). The template is the model
directory's, as transformers finds it: chat_template.jinja, else tokenizer_config.json's
`chat_template` (a string, or the entry named `default`), else chat_template.json.

Rendering is jinja2 in a sandbox set up as transformers' `apply_chat_template` sets it up
(ImmutableSandboxedEnvironment, trim_blocks, lstrip_blocks, loopcontrols, `tojson`,
`raise_exception`, `strftime_now`, `tools` / `documents` None, the tokenizer's special tokens as
variables), so a template renders the same text here as there, without torch or transformers. Two
differences: `eos_token` / `bos_token` are known even without a tokenizer_config.json (from the
model's configs, a prepare manifest, or the tokenizer's EOS: `special_tokens`), and printing an
undefined variable is an error naming it, where transformers prints nothing. The assistant's characters:
- the template's `{% generation %}...{% endgeneration %}` blocks where it has them (what
  transformers' return_assistant_tokens_mask reads);
- else for the i-th message, an assistant's, the characters between rendering messages[:i] with
  add_generation_prompt=true and rendering messages[:i+1]: its content and whatever the template
  closes a turn with (an end-of-turn token), not the header that opens it. A template that does
  not render a conversation's prefixes as prefixes of the whole (one that drops earlier turns'
  reasoning, say) is refused: add `{% generation %}` blocks to it.
The text is tokenized once (no special tokens added: the template writes BOS itself); a token
is an assistant token when its characters overlap an assistant span.
"""

from __future__ import annotations

import json
import re
import signal
import threading
from datetime import datetime
from pathlib import Path

import numpy as np

from shardtrain.config import ConfigError
from shardtrain.data import storage, tokenize

ROLES = ("system", "user", "assistant", "tool")
FIELD = "messages"
GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
RENDER_SECONDS = 10
"""Time limit of one conversation's rendering (all its prefixes included): a template past it is an error."""
OUTPUT_CHARS = 8 * 2 ** 20
"""Limit of one rendering's text, and of any string or count a template asks for ('x' * n, center(n), ...)."""


class RenderLimit(Exception):
    """A chat template ran past RENDER_SECONDS or asked for more than OUTPUT_CHARS."""


def find_template(tokenizer_dir: Path) -> tuple[str, str]:
    """(template text, where it came from) of a tokenizer directory; ConfigError when there is none."""
    jinja = tokenizer_dir / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(), str(jinja)
    for name in ("tokenizer_config.json", "chat_template.json"):
        path = tokenizer_dir / name
        if path.is_file():
            template = json.loads(path.read_text()).get("chat_template")
            if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
                template = {t.get("name"): t.get("template") for t in template}.get("default")
            if isinstance(template, str):
                return template, f"{path}:chat_template"
    raise ConfigError(f"--chat: {tokenizer_dir} has no chat template (chat_template.jinja, or chat_template in "
                      "tokenizer_config.json); use a chat model's tokenizer files, or add a template there")


def special_tokens(tokenizer_dir: Path, tokenizer=None) -> dict[str, str]:
    """bos_token, eos_token, ... (the variables templates read): tokenizer_config.json's, then the
    BOS / EOS ids that generation_config.json, hf_config.json, config.json or manifest.json name (as
    tokens of `tokenizer`), then the tokenizer's own EOS (what `prepare` ends documents with)."""
    out = {}
    for key, value in storage.json_object(tokenizer_dir / "tokenizer_config.json").items():
        value = value.get("content") if isinstance(value, dict) else value
        if key.endswith("_token") and isinstance(value, str):
            out[key] = value
    if tokenizer is None:
        return out
    configs = [storage.json_object(tokenizer_dir / name) for name in tokenize.ID_FILES]
    named = {"bos_token": [c.get("bos_token_id") for c in configs],
             "eos_token": [c.get(k) for c in configs for k in ("eos_token_id", "eos_id")] + [tokenizer.eos_id]}
    for key, ids in named.items():
        token = next((t for t in (_token(tokenizer, i) for i in ids) if t is not None), None)
        if token is not None:
            out.setdefault(key, token)
    return out


def _token(tokenizer, token_id) -> str | None:
    token_id = token_id[0] if isinstance(token_id, list) and token_id else token_id
    return tokenizer.id_to_token(token_id) if isinstance(token_id, int) else None


def _environment():
    import jinja2
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """`{% generation %}...{% endgeneration %}`: records the character span of what it renders."""

        tags = {"generation"}

        def __init__(self, environment):
            super().__init__(environment)
            environment.extend(generation_spans=None, rendered_blocks=None)

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_span"), [], [], body).set_lineno(lineno)

        def _span(self, caller):
            text = caller()
            env = self.environment
            if env.generation_spans is not None:
                start = sum(len(b) for b in env.rendered_blocks)
                env.generation_spans.append((start, start + len(text)))
            return text

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    class Unprintable(jinja2.Undefined):
        """An undefined variable is false and empty in tests and loops, as in transformers, but an
        error when printed (transformers prints nothing: a `{{ eos_token }}` it lacks vanishes)."""

        __str__ = jinja2.Undefined._fail_with_undefined_error

    class Bounded(ImmutableSandboxedEnvironment):
        """The sandbox with bounded operations: `*`, `**`, `%` and calls (filters included) whose
        numbers or format widths ask for more than OUTPUT_CHARS are refused before they allocate."""

        intercepted_binops = frozenset(["*", "**", "%"])

        def call_binop(self, context, operator, left, right):
            if operator == "**" and isinstance(right, int) and isinstance(left, int) and abs(left) > 1 \
                    and right * abs(left).bit_length() > 8 * OUTPUT_CHARS:
                raise RenderLimit(f"{left} ** {right} has more than {8 * OUTPUT_CHARS} bits")
            if operator == "*":
                seq, n = (left, right) if isinstance(right, int) else (right, left)
                if isinstance(n, int) and hasattr(seq, "__len__") and len(seq) * n > OUTPUT_CHARS:
                    raise RenderLimit(f"a sequence of {len(seq)} x {n} items")
            if operator == "%" and isinstance(left, str):
                _check_numbers([left])
            return super().call_binop(context, operator, left, right)

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja's signature)
            target = getattr(__obj, "__wrapped__", __obj)
            if getattr(target, "__name__", "") in ("format", "format_map"):
                _check_numbers([getattr(target, "__self__", "")])
            _check_numbers([*args, *kwargs.values()])
            return super().call(__context, __obj, *args, **kwargs)

    env = Bounded(trim_blocks=True, lstrip_blocks=True, undefined=Unprintable,
                  extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters = {name: _bounded(f) for name, f in env.filters.items()}
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda f: datetime.now().strftime(f))
    return env


def _check_numbers(values) -> None:
    """RenderLimit when an int, or a width in a format string, exceeds OUTPUT_CHARS."""
    for v in values:
        big = v if isinstance(v, int) and not isinstance(v, bool) else \
            max(map(int, re.findall(r"\d{8,}", v)), default=0) if isinstance(v, str) else 0
        if abs(big) > OUTPUT_CHARS:
            raise RenderLimit(f"a count or width of {str(big)[:40]}")


def _bounded(f):
    """A jinja filter that refuses numbers past OUTPUT_CHARS (indent, center, wordwrap, ...)."""
    import functools

    @functools.wraps(f)  # keeps jinja's pass_context / pass_environment marks
    def filter_(*args, **kwargs):
        _check_numbers([a for a in (*args, *kwargs.values()) if isinstance(a, int)])
        return f(*args, **kwargs)
    return filter_


class Deadline:
    """RENDER_SECONDS for what runs inside it (SIGALRM, so in the main thread only; elsewhere
    OUTPUT_CHARS and the bounded operations still hold)."""

    def __enter__(self):
        self.armed = threading.current_thread() is threading.main_thread()
        if self.armed:
            self.previous = signal.signal(signal.SIGALRM, self._expired)
            signal.setitimer(signal.ITIMER_REAL, RENDER_SECONDS)

    def __exit__(self, *_):
        if self.armed:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, self.previous)

    @staticmethod
    def _expired(*_):
        raise RenderLimit(f"rendering took more than {RENDER_SECONDS} s")


class ChatTemplate:
    """A tokenizer directory's chat template, rendering conversations with their assistant spans."""

    def __init__(self, tokenizer_dir: Path, tokenizer=None):
        import jinja2
        self.source, self.where = find_template(tokenizer_dir)
        self.tokenizer_dir = tokenizer_dir
        self.variables = {"tools": None, "documents": None, **special_tokens(tokenizer_dir, tokenizer)}
        self.env = _environment()
        try:
            self.template = self.env.from_string(self.source)
        except jinja2.TemplateSyntaxError as e:
            raise ConfigError(f"{self.where}: the chat template does not parse ({e.message}, template line "
                              f"{e.lineno})") from None
        self.tracked = bool(GENERATION_TAG.search(self.source))

    def _render(self, messages: list, add_generation_prompt: bool, spans: list | None = None) -> str:
        self.env.generation_spans, self.env.rendered_blocks = spans, []
        size = 0
        try:
            for block in self.template.generate(messages=messages, add_generation_prompt=add_generation_prompt,
                                                **self.variables):
                self.env.rendered_blocks.append(block)
                size += len(block)
                if size > OUTPUT_CHARS:
                    raise RenderLimit(f"the text grew past {OUTPUT_CHARS} characters")
            return "".join(self.env.rendered_blocks)
        finally:
            self.env.generation_spans = self.env.rendered_blocks = None

    def prompt(self, messages: list, where: str = "generate --chat") -> str:
        """The text that asks the model for the next assistant turn (add_generation_prompt)."""
        import jinja2
        try:
            with Deadline():
                return self._render(messages, True)
        except (jinja2.TemplateError, RenderLimit) as e:
            raise self.error(e, where) from None

    def error(self, e, where: str) -> ConfigError:
        import jinja2
        if isinstance(e, RenderLimit):
            return ConfigError(f"{where}: the chat template ({self.where}) went past its limits ({e}; a conversation "
                               f"may take {RENDER_SECONDS} s and {OUTPUT_CHARS} characters): fix the template")
        if isinstance(e, jinja2.UndefinedError):
            known = ", ".join(["messages", "add_generation_prompt", *sorted(self.variables)])
            return ConfigError(f"{where}: the chat template ({self.where}) prints a variable that is undefined here "
                               f"({e}); define it in {self.tokenizer_dir / 'tokenizer_config.json'} or take it out "
                               f"of the template (known: {known})")
        return ConfigError(f"{where}: the chat template failed: {e}")

    def render(self, messages: list, where: str) -> tuple[str, list[tuple[int, int]]]:
        """(text, character spans of the assistant's turns) of one conversation."""
        import jinja2
        try:
            with Deadline():
                return self._render_spans(messages, where)
        except (jinja2.TemplateError, RenderLimit) as e:
            raise self.error(e, where) from None

    def _render_spans(self, messages: list, where: str) -> tuple[str, list[tuple[int, int]]]:
        if self.tracked:
            spans: list[tuple[int, int]] = []
            return self._render(messages, False, spans), spans
        text = self._render(messages, False)
        spans = []
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before = self._render(messages[:i], True)
            through = self._render(messages[:i + 1], False)
            if not (through.startswith(before) and text.startswith(through)):
                raise ConfigError(f"{where}: the chat template does not render the conversation up to message "
                                  f"{i} as a prefix of the whole, so its assistant tokens are unknown; add "
                                  "{% generation %} blocks around the assistant's turns to the template")
            spans.append((len(before), len(through)))
        return text, spans


def check_messages(row, where: str) -> list[dict]:
    """The `messages` of one JSONL row; ConfigError naming `where` (FILE:LINE) when malformed."""
    messages = row.get(FIELD) if isinstance(row, dict) else None
    if not isinstance(messages, list) or not messages:
        have = ", ".join(row) if isinstance(row, dict) else type(row).__name__
        raise ConfigError(f"{where}: no '{FIELD}' list (has: {have}); each line must be "
                          '{"messages": [{"role": "user", "content": "..."}, ...]}')
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            role = m.get("role") if isinstance(m, dict) else m
            raise ConfigError(f"{where}: message {i} has role {role!r}; known roles: {', '.join(ROLES)}")
        if not isinstance(m.get("content"), str):
            raise ConfigError(f"{where}: message {i} ({m['role']}) has no string 'content'")
    if not any(m["role"] == "assistant" for m in messages):
        raise ConfigError(f"{where}: no assistant message, so nothing to train on; drop the line or add a reply")
    return messages


def assistant_mask(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> np.ndarray:
    """uint8 per token: 1 when the token's characters overlap an assistant span."""
    if not offsets:
        return np.zeros(0, np.uint8)
    start, end = np.asarray(offsets, np.int64).T
    mask = np.zeros(len(start), bool)
    for lo, hi in spans:
        mask |= (start < hi) & (end > lo)
    return mask.astype(np.uint8)


def encode(tokenizer, texts: list[str], spans: list[list[tuple[int, int]]]) -> list[tuple[np.ndarray, np.ndarray]]:
    """(token ids uint32, assistant mask uint8) of rendered conversations (a tokenize.HfTokenizer)."""
    encodings = tokenizer.tok.encode_batch(texts, add_special_tokens=False)
    return [(np.asarray(e.ids, np.uint32), assistant_mask(e.offsets, s)) for e, s in zip(encodings, spans)]
