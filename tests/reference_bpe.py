"""A byte-level BPE tokenizer written out plainly (GPT-2's algorithm), the independent reference
gyges.tokenizer (the `tokenizers` package) is tested against. Slow and obviously right:

  1. pre-tokenize: SmolLM's pipeline, every digit on its own, then GPT-2's regex on each part;
  2. map each pre-token's UTF-8 bytes to printable characters (GPT-2's bytes_to_unicode);
  3. merge the adjacent pair of lowest rank until none is in the merge list;
  4. special tokens (whole strings such as <|im_start|>) are split off first and never merged.

Only the ASCII letters, digits and whitespace classes of the regex are written out (Python's re
has no \\p{L}); callers keep the text they compare on ASCII, or compare round trips instead.
"""
import re

# GPT-2's regex with \p{L} = [A-Za-z] and \p{N} = [0-9] (ASCII text only)
_GPT2 = re.compile(r"'s|'t|'re|'ve|'m|'ll|'d| ?[A-Za-z]+| ?[0-9]+| ?[^\sA-Za-z0-9]+|\s+(?!\S)|\s+")


def bytes_to_unicode():
    """GPT-2's reversible map from the 256 bytes to printable characters."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars = keep[:]
    n = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return dict(zip(keep, map(chr, chars)))


class ReferenceBPE:
    def __init__(self, tokens, merges, special_tokens):
        self.vocab = {t: i for i, t in enumerate(tokens)}
        self.ranks = {tuple(m.split(" ", 1)): r for r, m in enumerate(merges)}
        self.byte_char = bytes_to_unicode()
        self.special = sorted(special_tokens, key=len, reverse=True)

    def _merge(self, word):
        parts = list(word)
        while len(parts) > 1:
            pairs = [(self.ranks.get((a, b), None), i) for i, (a, b) in enumerate(zip(parts, parts[1:]))]
            ranked = [(r, i) for r, i in pairs if r is not None]
            if not ranked:
                break
            _, i = min(ranked)
            parts[i:i + 2] = [parts[i] + parts[i + 1]]
        return parts

    def _pretokens(self, text):
        for part in re.split(r"([0-9])", text):  # every digit alone (isolated)
            if part:
                yield from _GPT2.findall(part)

    def encode(self, text):
        if self.special:
            pattern = "(" + "|".join(map(re.escape, self.special)) + ")"
            chunks = re.split(pattern, text)
        else:
            chunks = [text]
        ids = []
        for chunk in chunks:
            if chunk in self.special:
                ids.append(self.vocab[chunk])
                continue
            for pre in self._pretokens(chunk):
                word = "".join(self.byte_char[b] for b in pre.encode("utf-8"))
                ids += [self.vocab[p] for p in self._merge(word)]
        return ids
