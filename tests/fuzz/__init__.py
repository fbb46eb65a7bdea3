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
  child.py       what runs in the child: build, limit, load, generate, judge -> a classification
  runner.py      the fork-server: one parent, a forked child per mutant, results over a pipe
  report.py      the table and the JSON

Nothing here imports numpy or gyges at import time: the fork-server's entry points pin the math
libraries to one thread first, so the parent has no threads when it forks.
"""
