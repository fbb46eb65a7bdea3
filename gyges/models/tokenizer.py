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

from .checkpoint import CheckpointError
from .config import read_json
from .gguf_file import meta_value
from ..core.errors import ArgumentTypeError, InvalidArgumentError, require

# GGUF token types (llama.cpp's llama_token_type)
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6

# GPT-2's pre-tokenizer regex and the one of Qwen2 / Llama 3 (letters, 1-3 digit numbers, ...).
GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+"
                r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


# tokenizer.json of the largest published vocabularies is ~20 MB
MAX_TOKENIZER_BYTES = 256 << 20
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
                                      f"{_short(value)}")
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
            from jinja2.sandbox import ImmutableSandboxedEnvironment
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

            def raise_exception(message):
                raise InvalidArgumentError(f"the chat template refused the messages: {message}")
            env.globals["raise_exception"] = raise_exception
            self._template = env.from_string(self.chat_template)
        special = lambda i: None if i is None else self.token_text(i)
        text = self._template.render(messages=list(messages),
                                     add_generation_prompt=add_generation_prompt,
                                     bos_token=special(self.bos_token_id) or "",
                                     eos_token=special(self.eos_token_id) or "")
        return self.encode(text, add_special_tokens=False) if tokenize else text



def _short(value):
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _reraise_interrupts(e):
    if isinstance(e, (KeyboardInterrupt, SystemExit, GeneratorExit)):
        raise e


def _read_text(file, limit=16 << 20):
    try:
        with open(file, "rb") as f:
            blob = f.read(limit + 1)
        if len(blob) > limit:
            raise CheckpointError(f"{file}: larger than the {limit}-byte limit")
        return blob.decode("utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{file}: cannot read: {e}") from None


def tokenize_prompt(prompt, tokenizer):
    """(token ids, text) of a prompt: a string is encoded when there is a tokenizer; anything else
    passes as it is, with no text (the token-id checks then name what is wrong)."""
    if isinstance(prompt, str) and tokenizer is not None:
        return tokenizer.encode(prompt), prompt
    return prompt, None


def chat_prompts(tokenizer, messages):
    """Token ids of one conversation ([{"role", "content"}, ...]) or of each of a list of them,
    rendered with the model's chat template, the assistant's turn opened."""
    if tokenizer is None:
        raise InvalidArgumentError("this model has no tokenizer, so no chat template")
    chats = [messages] if messages and isinstance(messages[0], dict) else list(messages)
    return [tokenizer.apply_chat_template(m, tokenize=True) for m in chats]


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
