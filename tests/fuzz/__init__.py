"""The model-file fuzz harness: seeded, structure-aware mutants of the files gyges loads, each
loaded in a forked child under a time and an address-space limit, and classified.

    python -m tests.fuzz run --seeds 1,2,3 --mutants 300       # a campaign, table + JSON
    python -m tests.fuzz replay --seed 1 --index 17            # one mutant, in the foreground
    python -m tests.fuzz probe                                 # the harness's own self-checks

One concept a file:
  values.py      the odd values a field is swapped for (types, huge ints, NaN, garbage)
  corpus.py      the valid originals: a tiny model as an HF directory (config.json,
                 model.safetensors, tokenizer.json, tokenizer_config.json), sharded, and as GGUF
  gguf_layout.py where each key, value and tensor info sits in a GGUF file (for raw edits)
  hf_mutators.py the mutators of HF checkpoint directories
  gguf_mutators.py the mutators of GGUF files
  mutant.py      (seed, index) -> the mutant: which mutator, what it did, what a right load holds
  judge.py       what the file says, read independently of the loaders: the config and tensors a
                 load must produce, to catch a silent misread
  child.py       what runs in the child: build, load, judge, generate, tokenize -> a class
  runner.py      the fork-server: one parent, a forked child per mutant (RLIMIT_AS, a wall
                 limit), results over a pipe; crash, hang and oom seen from outside
  probes.py      children that fail on purpose, one per class: the harness's own tests
  campaign.py    a run over seeds, the foreground replay, the probe run
  report.py      the table and the JSON, findings grouped by cause with a replay command each

Classes: ok; refused (a gyges.Error: class and message); non-gyges (any other exception: type
and traceback tail); crash (a fatal signal: which, and the Python frame it hit); hang (past the
wall limit: killed); oom (MemoryError, or SIGKILL the runner did not send); silent (it loaded,
but the loaded model disagrees with the file, or the engine with the float64 reference on the
loaded config); harness (the harness itself failed). Must be zero: silent, non-gyges, crash,
hang, harness.

Nothing here imports numpy or gyges at import time: the fork-server's entry points pin the math
libraries to one thread first, so the parent has no threads when it forks.
"""
