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

import json
import os
import re
import secrets

from .checkpoint import CheckpointError
from ..core.errors import ArgumentTypeError, InvalidArgumentError, require

# GGUF token types (llama.cpp's llama_token_type)
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6

# GPT-2's pre-tokenizer regex and the one of Qwen2 / Llama 3 (letters, 1-3 digit numbers, ...).
GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+"
                r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


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
                 add_bos=False):
        self._tok = backend
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.chat_template = chat_template
        self.add_bos = add_bos
        self._template = None

    # ---- construction ----
    @classmethod
    def from_gguf_metadata(cls, meta):
        t = _lib()
        model = meta.get("tokenizer.ggml.model")
        if model != "gpt2":
            raise CheckpointError(f"tokenizer.ggml.model {model!r} is not supported (byte-level "
                                  f"BPE, 'gpt2', is)")
        tokens = meta.get("tokenizer.ggml.tokens")
        merges = meta.get("tokenizer.ggml.merges")
        if not tokens or merges is None:
            raise CheckpointError("the metadata has no tokenizer.ggml.tokens or merges")
        types = meta.get("tokenizer.ggml.token_type") or [TOKEN_NORMAL] * len(tokens)
        vocab = {token: i for i, token in enumerate(tokens)}
        pairs = []
        for m in merges:
            left, sep, right = m.partition(" ")
            if not sep:
                raise CheckpointError(f"merge {m!r} is not two tokens separated by a space")
            pairs.append((left, right))
        backend = t.Tokenizer(t.models.BPE(vocab=vocab, merges=pairs, fuse_unk=False))
        backend.pre_tokenizer = _pre_tokenizer(meta.get("tokenizer.ggml.pre"))
        backend.decoder = t.decoders.ByteLevel()
        specials = [t.AddedToken(tok, special=True, normalized=False)
                    for tok, kind in zip(tokens, types) if kind == TOKEN_CONTROL]
        users = [t.AddedToken(tok, special=False, normalized=False)
                 for tok, kind in zip(tokens, types) if kind == TOKEN_USER_DEFINED]
        backend.add_special_tokens(specials)
        backend.add_tokens(users)
        return cls(backend, bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
                   eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
                   chat_template=meta.get("tokenizer.chat_template"),
                   add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", False)))

    @classmethod
    def from_directory(cls, path, config=None):
        """tokenizer.json of an HF directory, with tokenizer_config.json's chat template and
        BOS/EOS when present; None when the directory has no tokenizer.json."""
        t = _lib()
        file = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(file):
            return None
        try:
            backend = t.Tokenizer.from_file(file)
        except Exception as e:  # tokenizers raises a bare Exception on a malformed file
            raise CheckpointError(f"{file}: {e}") from None
        settings = {}
        settings_file = os.path.join(path, "tokenizer_config.json")
        if os.path.isfile(settings_file):
            with open(settings_file, encoding="utf-8") as f:
                settings = json.load(f)

        def token_id(key, fallback):
            token = settings.get(key)
            if isinstance(token, dict):
                token = token.get("content")
            found = backend.token_to_id(token) if isinstance(token, str) else None
            return fallback if found is None else found

        eos = config.eos_tokens()[0] if config is not None and config.eos_tokens() else None
        bos = config.bos_token_id if config is not None else None
        return cls(backend, bos_token_id=token_id("bos_token", bos),
                   eos_token_id=token_id("eos_token", eos),
                   chat_template=settings.get("chat_template"),
                   add_bos=bool(settings.get("add_bos_token", False)))

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
