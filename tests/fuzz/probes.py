"""Children that fail on purpose, one of each class, so the harness is shown able to see every
failure it claims to catch: probe i of PROBES is run as (seed=-1, index=i)."""
import os
import shutil
import signal

import gyges
from . import child
from .mutant import Mutant

PROBES = ("ok", "refused", "crash", "abort", "hang", "non-gyges", "oom", "silent-config",
          "silent-tensor", "silent-tokens")
EXPECTED = {"ok": "ok", "refused": "refused", "crash": "crash", "abort": "crash",
            "hang": "hang", "non-gyges": "non-gyges", "oom": "oom", "silent-config": "silent",
            "silent-tensor": "silent", "silent-tokens": "silent"}


def run(corpus, index, workdir):
    name = PROBES[index]
    path = os.path.join(workdir, "model")
    shutil.copytree(corpus.hf_dir(), path)
    m = Mutant(-1, index, f"probe.{name}", "hf", name, path, False)
    load = gyges.Model.load
    if name == "refused":
        os.remove(os.path.join(path, "config.json"))
    elif name == "crash":
        os.kill(os.getpid(), signal.SIGSEGV)
    elif name == "abort":
        os.abort()
    elif name == "hang":
        while True:
            pass
    elif name == "non-gyges":
        def broken(p, dtype="f32"):
            return {}["a key the loader forgot"]
        gyges.Model.load = broken
    elif name == "oom":
        gyges.Model.load = lambda p, dtype="f32": bytearray(64 << 30)
    elif name == "silent-config":  # a loader that coerces a field
        gyges.Model.load = lambda p, dtype="f32": _changed(load(p), config=True)
    elif name == "silent-tensor":  # a loader that misreads one weight
        gyges.Model.load = lambda p, dtype="f32": _changed(load(p), tensor=True)
    elif name == "silent-tokens":  # an engine that ignores rope_scaling the config asks for
        import json
        cfg = json.load(open(os.path.join(path, "config.json")))
        cfg["rope_scaling"] = {"rope_type": "linear", "factor": 8.0}
        json.dump(cfg, open(os.path.join(path, "config.json"), "w"))
        engine = gyges.Engine

        def unscaled(model, **kw):
            import dataclasses
            plain = gyges.Model(dataclasses.replace(model.config, rope_scaling=None),
                                model.tensors, model.tokenizer)
            return engine(plain, **kw)
        gyges.Engine = unscaled
    try:
        record = child.exercise(corpus, m)
    finally:
        gyges.Model.load = load
    return {"seed": -1, "index": index, "mutator": m.mutator, "detail": name, **record}


def _changed(model, config=False, tensor=False):
    if config:
        model.config = model.config.replace(rms_norm_eps=model.config.rms_norm_eps * 10)
    if tensor:
        model.tensors["model.norm.weight"] = model.tensors["model.norm.weight"] * 2
    return model
