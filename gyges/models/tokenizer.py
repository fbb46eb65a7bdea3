"""Text in, text out: a byte-level BPE tokenizer (the `tokenizers` package, as HF's fast
tokenizers), a model's chat template (jinja2, sandboxed, as transformers renders it), and
incremental detokenization for streams.

    tok = Tokenizer.from_gguf_metadata(meta)        # tokens, merges, special tokens of a GGUF
    tok = Tokenizer.from_directory("hf_dir")        # tokenizer.json (+ tokenizer_config.json)
    ids = tok.encode("The capital of France is")
    tok.decode(ids); tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    d = tok.detokenizer(); d.add(token) -> the new text, never half a character
"""
from __future__ import annotations

import os
import re
import secrets
import threading
import time

from .checkpoint import CheckpointError
from ..core.checks import show
from .config import read_json
from .gguf_file import meta_value
from ..core.errors import (ArgumentTypeError, Error, FormatError, InvalidArgumentError,
                           LimitError, require)

# GGUF token types (llama.cpp's llama_token_type)
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6

# GPT-2's pre-tokenizer regex and the one of Qwen2 / Llama 3 (letters, 1-3 digit numbers, ...).
GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+"
                r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


# tokenizer.json of the largest published vocabularies is ~20 MB
MAX_TOKENIZER_BYTES = 256 << 20
# What one rendering of a chat template may cost: its time, and the characters of any text or
# list it builds (the output among them), beyond those of the messages it is given.
TEMPLATE_SECONDS = 1.0
TEMPLATE_CHARS = 4 << 20


class ChatTemplateError(FormatError):
    """A model's chat template does not compile, or fails as it renders (not for a refusal the
    template raises itself, which is an InvalidArgumentError about the messages)."""


def _lib():
    return require("tokenizers", "text")


def _pre_tokenizer(pre):
    """The pre-tokenizer of a GGUF's tokenizer.ggml.pre (llama.cpp's names for HF's)."""
    t = _lib()
    byte_level = t.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in (None, "default", "gpt2", "gpt-2"):
        return byte_level
    if pre == "smollm":  # HF SmolLM: every digit alone, then GPT-2's byte level
        return t.pre_tokenizers.Sequence([t.pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in ("llama-bpe", "llama3", "qwen2", "smaug-bpe"):
        split = t.pre_tokenizers.Split(t.Regex(LLAMA3_SPLIT), behavior="isolated")
        return t.pre_tokenizers.Sequence(
            [split, t.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    raise CheckpointError(f"tokenizer.ggml.pre {pre!r} is not supported (supported: default, "
                          f"gpt2, smollm, llama-bpe, qwen2)")


class Tokenizer:
    """A byte-level BPE tokenizer and, when the model has one, its chat template."""

    def __init__(self, backend, bos_token_id=None, eos_token_id=None, chat_template=None,
                 add_bos=False, source=None):
        self._tok = backend
        self.source = source  # the file the chat template came from, for messages
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.chat_template = chat_template
        self.add_bos = add_bos
        self._template = None

    # ---- construction ----
    @classmethod
    def from_gguf_metadata(cls, meta, source="the GGUF metadata"):
        """The tokenizer of a GGUF's metadata; CheckpointError naming `source` (the file) and
        the key when a value has the wrong type or the tokens cannot make a tokenizer."""
        try:
            return cls._from_gguf(meta, source)
        except CheckpointError as e:
            raise CheckpointError(f"{source}: {e}") from None

    @classmethod
    def _from_gguf(cls, meta, source):
        t = _lib()
        model = meta_value(meta, "tokenizer.ggml.model", "str", None)
        if model != "gpt2":
            raise CheckpointError(f"tokenizer.ggml.model {model!r} is not supported (byte-level "
                                  f"BPE, 'gpt2', is)")
        if "tokenizer.ggml.tokens" not in meta or "tokenizer.ggml.merges" not in meta:
            raise CheckpointError("the metadata has no tokenizer.ggml.tokens or merges")
        tokens = meta_value(meta, "tokenizer.ggml.tokens", "strs")
        merges = meta_value(meta, "tokenizer.ggml.merges", "strs")
        types = meta_value(meta, "tokenizer.ggml.token_type", "ints", [TOKEN_NORMAL] * len(tokens))
        if not tokens or len(types) != len(tokens):
            raise CheckpointError(f"tokenizer.ggml.tokens has {len(tokens)} tokens and "
                                  f"tokenizer.ggml.token_type {len(types)} types")
        vocab = {token: i for i, token in enumerate(tokens)}
        if len(vocab) != len(tokens):  # a token given twice would shift every id after it
            seen = set()
            twice = next(tok for tok in tokens if tok in seen or seen.add(tok))
            raise CheckpointError(f"tokenizer.ggml.tokens lists {twice!r} twice")
        ids = {}
        for key in ("bos", "eos"):
            ids[key] = meta_value(meta, f"tokenizer.ggml.{key}_token_id", "int", None)
            if ids[key] is not None and not 0 <= ids[key] < len(tokens):
                raise CheckpointError(f"tokenizer.ggml.{key}_token_id {ids[key]} is not one of "
                                      f"the {len(tokens)} tokens")
        pairs = []
        for m in merges:
            left, sep, right = m.partition(" ")
            if not sep:
                raise CheckpointError(f"merge {m!r} is not two tokens separated by a space")
            pairs.append((left, right))
        pre = meta_value(meta, "tokenizer.ggml.pre", "str", None)
        template = meta_value(meta, "tokenizer.chat_template", "str", None)
        add_bos = meta_value(meta, "tokenizer.ggml.add_bos_token", "bool", False)
        try:
            backend = t.Tokenizer(t.models.BPE(vocab=vocab, merges=pairs, fuse_unk=False))
            backend.pre_tokenizer = _pre_tokenizer(pre)
            backend.decoder = t.decoders.ByteLevel()
            specials = [t.AddedToken(tok, special=True, normalized=False)
                        for tok, kind in zip(tokens, types) if kind == TOKEN_CONTROL]
            users = [t.AddedToken(tok, special=False, normalized=False)
                     for tok, kind in zip(tokens, types) if kind == TOKEN_USER_DEFINED]
            backend.add_special_tokens(specials)
            backend.add_tokens(users)
        except CheckpointError:
            raise
        except BaseException as e:  # tokenizers raises a bare Exception, or panics
            _reraise_interrupts(e)
            raise CheckpointError(f"the tokens and merges make no tokenizer: {e}") from None
        return cls(backend, bos_token_id=ids["bos"], eos_token_id=ids["eos"],
                   chat_template=template, add_bos=add_bos, source=source)

    @classmethod
    def from_directory(cls, path, config=None):
        """tokenizer.json of an HF directory, with tokenizer_config.json's chat template (or
        chat_template.jinja's) and BOS/EOS when present; None when the directory has no
        tokenizer.json. CheckpointError naming the file and the field when one is malformed."""
        t = _lib()
        file = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(file):
            return None
        if os.path.getsize(file) > MAX_TOKENIZER_BYTES:
            raise CheckpointError(f"{file}: larger than the {MAX_TOKENIZER_BYTES}-byte limit")
        try:
            backend = t.Tokenizer.from_file(file)
        except BaseException as e:  # tokenizers raises a bare Exception, or panics
            _reraise_interrupts(e)
            raise CheckpointError(f"{file}: {e}") from None
        settings = {}
        settings_file = os.path.join(path, "tokenizer_config.json")
        if os.path.isfile(settings_file):
            settings = read_json(settings_file, "tokenizer settings", CheckpointError)
            if not isinstance(settings, dict):
                raise CheckpointError(f"{settings_file}: must be a JSON object, got "
                                      f"{type(settings).__name__}")

        def field(key, check, expected, default=None):
            value = settings.get(key)
            if value is None:
                return default
            if not check(value):
                raise CheckpointError(f"{settings_file}: {key} must be {expected}, got "
                                      f"{show(value)}")
            return value

        def token_id(key, fallback):
            token = field(key, lambda v: isinstance(v, str) or (
                isinstance(v, dict) and isinstance(v.get("content"), str)),
                "a token or {\"content\": token}")
            if isinstance(token, dict):
                token = token["content"]
            found = backend.token_to_id(token) if token is not None else None
            return fallback if found is None else found

        eos = config.eos_tokens()[0] if config is not None and config.eos_tokens() else None
        bos = config.bos_token_id if config is not None else None
        template = field("chat_template", lambda v: isinstance(v, str) or (
            isinstance(v, list) and all(isinstance(x, dict) and isinstance(x.get("name"), str)
                                        and isinstance(x.get("template"), str) for x in v)),
            "a string or a list of {\"name\", \"template\"}")
        source = settings_file
        if isinstance(template, list):  # named templates: the default one is the chat's
            named = {x["name"]: x["template"] for x in template}
            template = named.get("default")
        template_file = os.path.join(path, "chat_template.jinja")
        if template is None and os.path.isfile(template_file):  # transformers >= 4.43 saves it so
            template, source = _read_text(template_file), template_file
        return cls(backend, bos_token_id=token_id("bos_token", bos),
                   eos_token_id=token_id("eos_token", eos), chat_template=template,
                   add_bos=field("add_bos_token", lambda v: isinstance(v, bool), "true or false",
                                 False),
                   source=source if template is not None else path)

    # ---- text ----
    @property
    def vocab_size(self):
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text, add_special_tokens=None):
        """Token ids of `text`; BOS first when the model asks for it (add_special_tokens None:
        as the model says)."""
        if not isinstance(text, str):
            raise ArgumentTypeError(f"text must be a str, got {type(text).__name__}")
        ids = self._tok.encode(text, add_special_tokens=False).ids
        add = self.add_bos if add_special_tokens is None else add_special_tokens
        if add and self.bos_token_id is not None and (not ids or ids[0] != self.bos_token_id):
            ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids, skip_special_tokens=True):
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id):
        return self._tok.id_to_token(int(token_id))

    def detokenizer(self, prompt_ids=(), skip_special_tokens=True):
        return Detokenizer(self, prompt_ids, skip_special_tokens)

    # ---- chat ----
    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=False):
        """The model's chat template rendered over `messages` ([{"role", "content"}, ...]), as
        transformers renders it (a sandboxed jinja2 environment, trim_blocks, lstrip_blocks)."""
        if self.chat_template is None:
            raise InvalidArgumentError("this model has no chat template")
        if not isinstance(messages, (list, tuple)) or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str)
                and isinstance(m.get("content"), str) for m in messages):
            raise InvalidArgumentError("messages must be a list of {'role': str, 'content': str}")
        if self._template is None:
            self._template = _compile_template(self.chat_template, self._template_name())
        special = lambda i: None if i is None else self.token_text(i)
        text = _render_template(self._template, self._template_name(),
                                sum(len(m["content"]) for m in messages),
                                messages=list(messages),
                                add_generation_prompt=add_generation_prompt,
                                bos_token=special(self.bos_token_id) or "",
                                eos_token=special(self.eos_token_id) or "")
        return self.encode(text, add_special_tokens=False) if tokenize else text


    def _template_name(self):
        return f"the chat template of {self.source or 'the model'}"


def _reraise_interrupts(e):
    if isinstance(e, (KeyboardInterrupt, SystemExit, GeneratorExit)):
        raise e


def _read_text(file, limit=TEMPLATE_CHARS):
    try:
        with open(file, "rb") as f:
            blob = f.read(limit + 1)
        if len(blob) > limit:
            raise CheckpointError(f"{file}: larger than the {limit}-byte limit")
        return blob.decode("utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{file}: cannot read: {e}") from None


# ---- chat templates: jinja2's sandbox, with a budget of time and size ----

class _Budget:
    """One rendering's limits: checked by the sandbox's hooks (every call, attribute, item,
    operator, filter, loop iteration and piece of output), so a template stops within one
    bounded step of its deadline. A thread-local: renderings on several threads are apart."""
    current = threading.local()

    def __init__(self, name, input_chars):
        self.name = name
        self.deadline = time.monotonic() + TEMPLATE_SECONDS
        self.chars = TEMPLATE_CHARS + 8 * input_chars
        self.ticks = 0

    @classmethod
    def tick(cls):
        budget = getattr(cls.current, "budget", None)
        if budget is None:
            return
        budget.ticks += 1
        if budget.ticks % 64 == 0 and time.monotonic() > budget.deadline:
            raise LimitError(f"{budget.name} ran past its {TEMPLATE_SECONDS} s limit")

    @classmethod
    def size(cls, n, what):
        budget = getattr(cls.current, "budget", None)
        if budget is not None and n > budget.chars:
            raise LimitError(f"{budget.name} builds {what} of {n} characters or items, more "
                             f"than its limit of {budget.chars}")

    @classmethod
    def check(cls, value, what="a value"):
        if isinstance(value, (str, list, tuple, dict, bytes)):
            cls.size(len(value), what)
        return value

    @classmethod
    def check_call(cls, name, args):
        """Before a call: no count past the limit (ljust(10**9)), no field width past it in a
        format string, and for the calls whose result grows with the product of their
        arguments (s.replace("", s), s.join(s), s|indent(10**5)) no product past it: so no one
        call builds more than the limit."""
        cls.tick()
        sized, counts = [], [1]
        for a in args:
            if isinstance(a, (str, list, tuple, dict, bytes)):
                sized.append(len(a))
            if isinstance(a, int) and not isinstance(a, bool):
                cls.size(abs(a), "a count")
                counts.append(abs(a))
            if isinstance(a, str) and ("%" in a or "{" in a):  # widths in a format string
                for digits in re.findall(r"\d{7,}", a[:4096]):
                    cls.size(int(digits), "a field width")
        if name in _WIDENING and sized:
            sized.sort()
            cls.size(sized[-1] * max(sized[-2] if len(sized) > 1 else 1, max(counts)),
                     f"a result of {name}()")

    @classmethod
    def running(cls, name, input_chars):
        """A context in which the current thread works within a new budget."""
        import contextlib

        @contextlib.contextmanager
        def scope():
            outer = getattr(cls.current, "budget", None)
            cls.current.budget = cls(name, input_chars)
            try:
                yield
            finally:
                cls.current.budget = outer
        return scope()


# Calls whose result can be as large as the product of their arguments' sizes.
_WIDENING = frozenset(["replace", "join", "indent", "center", "ljust", "rjust", "zfill",
                       "expandtabs", "format", "format_map", "wordwrap", "map", "sum"])


def _bounded_iter(value):
    for item in value:
        _Budget.tick()
        yield item


def _bounded_filter(f):
    import functools

    @functools.wraps(f)  # keeps jinja's pass_context and the like
    def wrapper(*args, **kwargs):
        _Budget.check_call(f.__name__.removeprefix("do_"), [*args, *kwargs.values()])
        return _Budget.check(f(*args, **kwargs), "a filter's result")
    return wrapper


def _template_environment():
    from jinja2 import nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Environment(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset(["*", "**", "+", "%", "//"])

        def call_binop(self, context, operator, left, right):
            if operator == "*":
                for seq, n in ((left, right), (right, left)):
                    if isinstance(seq, (str, list, tuple)) and isinstance(n, int):
                        _Budget.size(len(seq) * max(n, 0), "a repetition")
            elif operator == "**" and isinstance(right, int) and abs(right) > 4096:
                _Budget.size(abs(right), "an exponent")
            elif operator == "%":
                _Budget.check_call("format", [left, right])
            _Budget.tick()
            return _Budget.check(super().call_binop(context, operator, left, right),
                                 "an operator's result")

        def call(__self, __context, __obj, *args, **kwargs):
            # a method's object counts as an argument (the sandbox wraps str.format)
            method = getattr(__obj, "__wrapped__", __obj)
            _Budget.check_call(getattr(__obj, "__name__", ""),
                               [getattr(method, "__self__", None), *args, *kwargs.values()])
            return _Budget.check(super().call(__context, __obj, *args, **kwargs),
                                 "a call's result")

        def getattr(self, obj, attribute):
            _Budget.tick()
            return super().getattr(obj, attribute)

        def getitem(self, obj, argument):
            _Budget.tick()
            return super().getitem(obj, argument)

        def _parse(self, source, name, filename):
            # Every loop iterates through _bounded_iter, every ~ concatenation is measured.
            template = super()._parse(source, name, filename)
            for loop in template.find_all(nodes.For):
                loop.iter = nodes.Filter(loop.iter, "gy_bounded_iter", [], [], None, None,
                                         lineno=loop.lineno)
            for concat in template.find_all(nodes.Concat):
                concat.nodes = [nodes.Filter(n, "gy_sized", [], [], None, None, lineno=n.lineno)
                                for n in concat.nodes]
            template.set_environment(self)
            return template

    env = Environment(trim_blocks=True, lstrip_blocks=True)
    env.filters = {name: _bounded_filter(f) for name, f in env.filters.items()}
    env.filters["gy_bounded_iter"] = _bounded_iter
    env.filters["gy_sized"] = lambda v: _Budget.check(v, "a concatenation")

    def raise_exception(message):
        raise InvalidArgumentError(f"the chat template refused the messages: {message}")
    env.globals["raise_exception"] = raise_exception
    return env


def _compile_template(source, name):
    """A jinja2 Template of a chat template, or ChatTemplateError naming it."""
    if not isinstance(source, str):
        raise ChatTemplateError(f"{name} is not a string: {type(source).__name__}")
    try:
        with _Budget.running(name, 0):  # jinja folds constants as it compiles: that is work too
            return _template_environment().from_string(source)
    except Error:
        raise
    except Exception as e:  # TemplateSyntaxError, and what a hostile source makes jinja raise
        raise ChatTemplateError(f"{name} does not compile: {type(e).__name__}: {e}") from None


def _render_template(template, name, input_chars, **variables):
    """The text of a template rendered within its budget: LimitError past it, ChatTemplateError
    when it fails (jinja2's errors and Python's), the template's own refusals as they are."""
    with _Budget.running(name, input_chars):
        return _render(template, name, **variables)


def _render(template, name, **variables):
    try:
        pieces, n = [], 0
        for piece in template.generate(**variables):
            n += len(piece)
            _Budget.size(n, "an output")
            _Budget.tick()
            pieces.append(piece)
        return "".join(pieces)
    except Exception as e:
        if isinstance(e, Error):
            raise
        raise ChatTemplateError(f"{name} failed: {type(e).__name__}: {_short_text(e)}") from None


def _short_text(e):
    text = str(e)
    return text if len(text) <= 200 else text[:197] + "..."


def _plain_backend(tokenizer):
    """A copy of the tokenizer's backend that reads special tokens' text as plain text (made once;
    a copy, so that no other encode ever sees the switch)."""
    plain = getattr(tokenizer, "_plain_backend", None)
    if plain is None:
        plain = _lib().Tokenizer.from_str(tokenizer._tok.to_str())
        plain.encode_special_tokens = True
        tokenizer._plain_backend = plain
    return plain


def encode_chat(tokenizer, messages, add_generation_prompt=True):
    """Token ids of a conversation rendered with the model's chat template, where only the
    template's own text makes special tokens: every message's content is encoded as plain text,
    so a user who types "<|im_start|>system" sends those characters, not the control token.

    The template is rendered a second time with a unique placeholder for each content; the text
    around the placeholders is the template's. Its special tokens are found in that text alone,
    and each run of text between two of them (template text and contents together) is encoded
    with special tokens read as text. When no content holds a special token this gives exactly
    the ids of encoding the whole rendered text, since the tokenizer cuts a text at its special
    tokens first and encodes the pieces between them independently. A template that changes a
    content (trims it, ...) leaves no placeholder verbatim: then the whole text is encoded as
    before when no content holds a special token's text, and the conversation is refused
    otherwise (InvalidArgumentError)."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt)
    contents = [m["content"] for m in messages]
    nonce = secrets.token_hex(8)
    marks = {f"\x00{nonce}:{i}\x00": c for i, c in enumerate(contents)}
    marked = tokenizer.apply_chat_template(
        [{**m, "content": k} for m, k in zip(messages, marks)], add_generation_prompt)
    parts = re.split("(" + "|".join(map(re.escape, marks)) + ")", marked) if marks else [marked]
    # parts alternate: template text, placeholder, template text, ...
    if "".join(marks.get(p, p) if i % 2 else p for i, p in enumerate(parts)) != text:
        specials = [a.content for a in tokenizer._tok.get_added_tokens_decoder().values()
                    if a.special]
        held = next((s for c in contents for s in specials if s in c), None)
        if held is not None:
            raise InvalidArgumentError(f"a message holds the special token {held!r}, and this "
                                       f"model's chat template changes message contents, so it "
                                       f"cannot be kept as plain text")
        return tokenizer.encode(text, add_special_tokens=False)
    special_ids = {i for i, a in tokenizer._tok.get_added_tokens_decoder().items() if a.special}
    runs, pending = [], []  # runs: special token ids and plain strings, in order
    for i, part in enumerate(parts):
        if i % 2:
            pending.append(marks[part])
            continue
        encoding = tokenizer._tok.encode(part, add_special_tokens=False)
        at = 0
        for token, (begin, end) in zip(encoding.ids, encoding.offsets):
            if token in special_ids:
                pending.append(part[at:begin])
                runs += ["".join(pending), token]
                pending, at = [], end
        pending.append(part[at:])
    runs.append("".join(pending))
    plain = _plain_backend(tokenizer)
    ids = []
    for run in runs:
        if isinstance(run, int):
            ids.append(run)
        elif run:
            ids += plain.encode(run, add_special_tokens=False).ids
    return ids


def tokenize_prompt(prompt, tokenizer):
    """(token ids, text) of a prompt: a string is encoded when there is a tokenizer; anything else
    passes as it is, with no text (the token-id checks then name what is wrong)."""
    if isinstance(prompt, str) and tokenizer is not None:
        return tokenizer.encode(prompt), prompt
    return prompt, None


def chat_prompts(tokenizer, messages):
    """Token ids of one conversation ([{"role", "content"}, ...]) or of each of a list of them,
    rendered with the model's chat template, the assistant's turn opened. The messages' contents
    never make special tokens (encode_chat)."""
    if tokenizer is None:
        raise InvalidArgumentError("this model has no tokenizer, so no chat template")
    chats = [messages] if messages and isinstance(messages[0], dict) else list(messages)
    return [encode_chat(tokenizer, m) for m in chats]


class Detokenizer:
    """Text of a growing list of tokens, piece by piece. A byte-level token may hold part of a
    UTF-8 character; a piece is given only once its characters are whole (vLLM's method: decode
    a short window of tokens before and after the new one and give the difference)."""

    def __init__(self, tokenizer, prompt_ids=(), skip_special_tokens=True):
        self._tok = tokenizer
        self.skip = skip_special_tokens
        self.ids = list(prompt_ids)[-6:]  # context for the first pieces (a leading space)
        self.prefix = 0                   # ids[prefix:read] decoded to text already given
        self.read = len(self.ids)
        self.text = ""

    def add(self, token_id):
        """Appends a token; returns the text it completes ("" while a character is partial)."""
        self.ids.append(int(token_id))
        before = self._tok.decode(self.ids[self.prefix:self.read], self.skip)
        after = self._tok.decode(self.ids[self.prefix:], self.skip)
        if len(after) > len(before) and not after.endswith("\ufffd"):
            piece = after[len(before):]
            self.prefix, self.read = self.read, len(self.ids)
            self.text += piece
            return piece
        return ""
