"""What one mutant's run does, in the child the runner forked (or in the foreground, on replay):
build the mutant, load it, and if it loads: judge the reading against the file (judge.py),
generate a few greedy tokens through gyges.Engine and compare them with the float64 reference
on the loaded config (rope_scaling included), then encode, decode and render the chat template.
Returns the classification as a dict; the runner adds crash, hang and oom from outside."""
import json
import os
import traceback

import numpy as np

import gyges
from . import judge
from .mutant import build

PROMPT = [5, 17, 42, 99, 123, 7, 250, 3, 77, 180, 64, 33, 12, 201, 150, 90, 11, 260, 45, 8,
          130, 61, 222, 19]  # 24 tokens: enough positions for a rope scaling to change tokens
STEPS = 4
NEAR_TIE = 2e-3   # of the best logit's magnitude: f32 sums may pick either of two this close
SANE_WEIGHT = 1e4  # weights beyond this (or not finite: bit flips) are a numerics question


class Silent(Exception):
    """The loaded model disagrees with what the file says."""


def run(corpus, seed, index, workdir, note=None, only=None):
    """Builds and exercises mutant (seed, index); returns its record. note(dict), when given,
    is told what the mutant is before it is loaded."""
    m = build(corpus, seed, index, workdir, only=only)
    record = {"seed": seed, "index": index, "mutator": m.mutator, "detail": m.detail,
              "replay": m.replay}
    if note is not None:
        note(record)
    record.update(exercise(corpus, m, note))
    return record


def exercise(corpus, m, note=None):
    stage = "load"

    def enter(name):
        nonlocal stage
        stage = name
        if note is not None:  # so a child that dies is reported with the stage it died in
            note({"stage": name})
    try:
        enter("load")
        model = gyges.Model.load(m.path)
        enter("judge")
        check_reading(corpus, m, model)
        enter("generate")
        check_generation(model)
        enter("tokenizer")
        check_tokenizer(model)
        return {"class": "ok", "stage": "done"}
    except Silent as e:
        return {"class": "silent", "stage": stage, "error": str(e)[:500]}
    except gyges.Error as e:
        return {"class": "refused", "stage": stage, "error_type": type(e).__name__,
                "error": str(e)[:300]}
    except MemoryError as e:
        return {"class": "oom", "stage": stage, "error_type": type(e).__name__,
                "error": str(e)[:300]}
    except BaseException as e:  # noqa: BLE001 (anything else is the finding)
        tail = traceback.format_exception(type(e), e, e.__traceback__)
        return {"class": "non-gyges", "stage": stage,
                "error_type": f"{type(e).__module__}.{type(e).__name__}",
                "error": str(e)[:300], "traceback": "".join(tail)[-1500:]}


# ---------------------------------------------------------------- the reading

def check_reading(corpus, m, model):
    if m.kind == "hf":
        _check_hf(m.path, model)
    else:
        _check_gguf(corpus, m, model)


def _verdict(verdict, what, got_fields):
    if verdict is None:
        return
    kind, value = verdict
    if kind == "refuse":
        raise Silent(f"loaded although {what}: {value}")
    for field, want in value.items():
        got = got_fields(field)
        if not judge.same(want, got):
            raise Silent(f"{what}: {field} is {got!r} in the loaded config, the file says "
                         f"{want!r}")


def _check_hf(path, model):
    try:
        d = json.load(open(os.path.join(path, "config.json"), encoding="utf-8"))
    except Exception as e:  # noqa: BLE001
        raise Silent(f"loaded although config.json is unreadable ({type(e).__name__})")
    verdict = judge.hf_config(d)
    _verdict(verdict, "config.json", lambda f: getattr(model.config, f))
    kind, tensors = judge.hf_tensors(path, model.config.tie_word_embeddings)
    if kind == "refuse":
        raise Silent(f"loaded although the weights cannot be read as the file says: {tensors}")
    diff = judge.tensors_differ(tensors, model.tensors)
    if diff:
        raise Silent(diff)
    _check_hf_tokenizer(path, model)


def _check_hf_tokenizer(path, model):
    if not os.path.isfile(os.path.join(path, "tokenizer.json")) or model.tokenizer is None:
        return
    settings_file = os.path.join(path, "tokenizer_config.json")
    if not os.path.isfile(settings_file):
        return
    try:
        settings = json.load(open(settings_file, encoding="utf-8"))
    except Exception as e:  # noqa: BLE001
        raise Silent(f"loaded although tokenizer_config.json is unreadable ({type(e).__name__})")
    if not isinstance(settings, dict):
        raise Silent("loaded although tokenizer_config.json is not an object")
    tok = model.tokenizer
    if settings.get("add_bos_token") is not None:  # null reads as absent
        v = settings["add_bos_token"]
        if not isinstance(v, bool):
            raise Silent(f"loaded although add_bos_token = {v!r} is not a bool")
        if tok.add_bos is not v:
            raise Silent(f"add_bos is {tok.add_bos!r}, the file says {v!r}")
    if "chat_template" in settings:
        v = settings["chat_template"]
        if isinstance(v, str) or v is None:
            if tok.chat_template != v:
                raise Silent("the chat template differs from the file's")
        elif not isinstance(v, list):
            raise Silent(f"loaded although chat_template = {v!r:.60} is not a string")


def _check_gguf(corpus, m, model):
    import gguf
    reader = gguf.GGUFReader(m.path)  # it loaded, so the reference reader reads it too
    meta = {}
    for key, field in reader.fields.items():
        if not key.startswith("GGUF."):
            meta[key] = (int(field.types[0]), field.contents())
    names = {t.name for t in reader.tensors}
    rows = {t.name: int(t.shape[-1]) for t in reader.tensors}.get("token_embd.weight", 0)
    # GGUF floats are float32: the loader's decimal and the file's float32 must round alike
    as_f32 = lambda v: float(np.float32(v)) if isinstance(v, float) else v  # noqa: E731
    _verdict(judge.gguf_config(meta, names, rows), "the GGUF metadata",
             lambda f: as_f32(getattr(model.config, f)))
    if "rope_freqs.weight" in names:
        freqs = next(t for t in reader.tensors if t.name == "rope_freqs.weight").data
        if not np.all(np.asarray(freqs) == 1):
            raise Silent("loaded although rope_freqs.weight (per-frequency rope factors, as "
                         "Llama 3.1 GGUFs carry) is not all ones and is not applied")
    if m.tensors_intact:
        diff = judge.tensors_differ(corpus.tensors, model.tensors)
        if diff:
            raise Silent(diff)
    tok = model.tokenizer
    if tok is not None:
        t = meta.get("tokenizer.chat_template")
        if t is not None and (t[0] != 8 or tok.chat_template != t[1]):
            raise Silent(f"chat template: loaded {tok.chat_template!r:.40}, file {t[1]!r:.40}")
        b = meta.get("tokenizer.ggml.add_bos_token")
        if b is not None and (b[0] != 7 or tok.add_bos is not b[1]):
            raise Silent(f"add_bos is {tok.add_bos!r}, the file says {b[1]!r} (type {b[0]})")


# ---------------------------------------------------------------- the engine

def reference_greedy(config, tensors, prompt, n):
    """(tokens, gaps) of the float64 reference; gaps: the best two logits' distance, relative."""
    from tests.reference_model import ReferenceModel
    return ReferenceModel(config, tensors).greedy_with_gaps(prompt, n)


def check_generation(model):
    c = model.config
    prompt = [t % c.vocab_size for t in PROMPT]
    params = gyges.SamplingParams(max_tokens=STEPS, ignore_eos=True)
    with gyges.Engine(model, memory="64MiB", threads=1) as e:
        out = e.generate([prompt], params)[0]
    if not all(np.isfinite(t).all() and np.abs(t).max(initial=0) < SANE_WEIGHT
               for t in model.tensors.values()):
        return
    want, gaps = reference_greedy(c, model.tensors, prompt, STEPS)
    if out.finish_reason == "error":
        raise Silent(f"the engine's logits were not numbers ({out.error}) where the "
                     f"reference's are")
    for got, expect, gap in zip(out.output_tokens, want, gaps):
        if got != expect:
            if gap < NEAR_TIE:
                return
            raise Silent(f"engine tokens {out.output_tokens} != reference {want} "
                         f"(rope_scaling {c.rope_scaling})")


def check_tokenizer(model):
    tok = model.tokenizer
    if tok is None:
        return
    ids = tok.encode("Hello world, the capital of France is Paris. é 🙂")
    tok.decode(ids)
    if tok.chat_template is not None:
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
    with gyges.Engine(model, memory="64MiB", threads=1) as e:
        e.generate("Hello world", gyges.SamplingParams(max_tokens=2))
