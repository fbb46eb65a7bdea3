"""gyges.LLM: vLLM's offline API over a gyges Host, so that a script ports by changing its import.

    from gyges import LLM, SamplingParams          # was: from vllm import LLM, SamplingParams
    llm = LLM(model="smollm2-135m-instruct", tensor_parallel_size=3, max_model_len=2048, seed=0)
    outputs = llm.generate(["The capital of France is"], SamplingParams(max_tokens=16, n=2))
    outputs[0].outputs[1].text, outputs[0].outputs[1].token_ids
    llm.chat([{"role": "user", "content": "What is the capital of France?"}])
    llm.host.transform(workers=(0, 1, 2), tp=1)     # what vLLM cannot: reshape it live

vLLM's engine arguments map onto the Host (ENGINE_ARGS says how; NOTED_ARGS are accepted and
have nothing to do here; anything else is refused by name before the model loads). Outputs are
vLLM's RequestOutput / CompletionOutput shapes; SamplingParams is gyges' (its defaults beside
vLLM's are in its docstring). The host is a TP group of tensor_parallel_size workers (a pipeline
of pipeline_parallel_size stages); `llm.host` is the gyges.Host, for everything else.
"""
import dataclasses
import inspect
import logging
import os
from dataclasses import dataclass, field

from ..core import checks
from ..core.errors import ArgumentTypeError, InvalidArgumentError
from ..models.model import Model, load_tokenizer
from ..models.tokenizer import chat_prompts, tokenize_prompt
from ..runtime.engine import SamplingParams, check_params
from ..runtime.host import Host
from ..runtime.worker import model_memory

log = logging.getLogger(__name__)

# vLLM's dtype spellings -> gyges' weight dtypes ("auto": fp32, the CPU kernels' own precision)
DTYPES = {"auto": "f32", "float32": "f32", "float": "f32", "f32": "f32",
          "bfloat16": "bf16", "bf16": "bf16", "float16": "f16", "half": "f16", "f16": "f16"}
# vLLM engine argument -> the Host argument it becomes
ENGINE_ARGS = {"max_num_seqs": "max_running", "max_num_batched_tokens": "max_batch_tokens",
               "block_size": "block_size"}
# vLLM arguments accepted with a note: each is about something gyges does not have (CUDA graphs,
# remote code, swap space, HF revisions) or does anyway (chunked prefill), so it changes nothing.
NOTED_ARGS = {"enforce_eager", "trust_remote_code", "swap_space", "cpu_offload_gb",
              "tokenizer_mode", "revision", "tokenizer_revision", "code_revision",
              "download_dir", "load_format", "disable_custom_all_reduce",
              "max_seq_len_to_capture", "disable_log_stats", "enable_prefix_caching",
              "enable_chunked_prefill", "compilation_config", "hf_token", "task",
              "kv_cache_dtype", "skip_tokenizer_init", "disable_async_output_proc",
              "distributed_executor_backend", "quantization"}
# Noted only at these values; another value asks for something gyges would not do.
NOTED_ONLY_AT = {"quantization": (None,), "kv_cache_dtype": ("auto",),
                 "skip_tokenizer_init": (False,), "task": ("auto", "generate")}
HOST_ARGS = set(inspect.signature(Host.__init__).parameters) - {"self", "model", "workers"}


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list
    cumulative_logprob: float | None
    logprobs: list | None
    finish_reason: str | None
    stop_reason: object = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list
    prompt_logprobs: list | None
    outputs: list
    finished: bool
    metrics: object = None
    request: object = field(default=None, repr=False)  # the gyges.Request of the first sample


def _completion(index, request):
    return CompletionOutput(index, request.text if request.text is not None else "",
                            list(request.output_tokens), request.cumulative_logprob,
                            request.logprobs, request.finish_reason,
                            request.stop_reason)


def request_output(samples, params):
    """One RequestOutput of a prompt's samples (gyges.Requests, as params.sample_params() made
    them): all n of them in order, or with best_of the n of highest cumulative log-probability."""
    samples = [samples[i] for i in
               params.chosen_samples([r.cumulative_logprob for r in samples])]
    first = samples[0]
    return RequestOutput(str(first.id), first.prompt_text, list(first.prompt),
                         first.prompt_logprobs,
                         [_completion(i, r) for i, r in enumerate(samples)],
                         all(r.finished for r in samples), first.metrics, first)


def _prompt(p, index):
    """A string, a list of token ids, or vLLM's {"prompt": ...} / {"prompt_token_ids": ...}."""
    if isinstance(p, dict):
        extra = set(p) - {"prompt", "prompt_token_ids"}
        if extra:
            raise InvalidArgumentError(f"prompts[{index}] has {sorted(extra)}: gyges takes "
                                       f"'prompt' or 'prompt_token_ids'")
        if ("prompt" in p) == ("prompt_token_ids" in p):
            raise InvalidArgumentError(f"prompts[{index}] needs one of 'prompt' and "
                                       f"'prompt_token_ids', got {sorted(p)}")
        return p.get("prompt", p.get("prompt_token_ids"))
    return p


def _layout(tp, pp, layers):
    """tensor_parallel_size x pipeline_parallel_size workers as a Host layout."""
    if pp == 1:
        return f"TP{tp}"
    if pp > layers:
        raise InvalidArgumentError(f"pipeline_parallel_size={pp} is more stages than the "
                                   f"model's {layers} layers")
    sizes = [layers // pp + (s < layers % pp) for s in range(pp)]
    return f"PP[{','.join(map(str, sizes))}]"


def _device_memory(backend, workers):
    """What gpu_memory_utilization is a fraction of: a GPU's memory, or on the CPU backend this
    machine's memory shared among the workers."""
    if backend == "cuda":
        from .. import _C
        return _C.cuda_device_memory(0)
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // workers


class LLM:
    def __init__(self, model, tokenizer=None, tensor_parallel_size=1, pipeline_parallel_size=1,
                 dtype="auto", seed=0, gpu_memory_utilization=None, max_model_len=None,
                 **engine_args):
        """model: a packaged name, a GGUF file, an HF directory or a gyges.Model. Every argument
        is checked before the model loads; gpu_memory_utilization=None (gyges' default, vLLM's
        is 0.9) sizes each worker for the whole model and the KV of 8192 tokens."""
        checks.integer("tensor_parallel_size", tensor_parallel_size, lo=1)
        checks.integer("pipeline_parallel_size", pipeline_parallel_size, lo=1)
        if pipeline_parallel_size > 1 and tensor_parallel_size > 1:
            raise InvalidArgumentError(
                f"tensor_parallel_size={tensor_parallel_size} with pipeline_parallel_size="
                f"{pipeline_parallel_size}: a gyges pipeline's stages are TP1 workers")
        if dtype not in DTYPES:
            raise InvalidArgumentError(f"dtype={dtype!r}: expected one of {', '.join(DTYPES)}")
        if seed is not None:
            checks.integer("seed", seed, lo=0, hi=2**64 - 1)
        if gpu_memory_utilization is not None:
            checks.number("gpu_memory_utilization", gpu_memory_utilization, lo=0, hi=1,
                          lo_open=True)
        if max_model_len is not None:
            checks.integer("max_model_len", max_model_len, lo=2)
        host_args = self._host_args(engine_args)
        if not isinstance(model, (Model, str, os.PathLike)):
            raise ArgumentTypeError(f"model must be a name, a path or a gyges.Model, got "
                                    f"{type(model).__name__}")
        if tokenizer is not None and not isinstance(tokenizer, (str, os.PathLike)):
            raise ArgumentTypeError(f"tokenizer must be a name or a path, got "
                                    f"{type(tokenizer).__name__}")
        self.model = model if isinstance(model, Model) else Model.load(model, dtype=DTYPES[dtype])
        if tokenizer is not None:
            self.model.tokenizer = load_tokenizer(tokenizer)
        config = self.model.config
        if max_model_len is not None and max_model_len > config.max_position_embeddings:
            raise InvalidArgumentError(f"max_model_len={max_model_len} is over the model's "
                                       f"context of {config.max_position_embeddings} tokens")
        self.max_model_len = max_model_len or config.max_position_embeddings
        workers = tensor_parallel_size * pipeline_parallel_size
        layout = _layout(tensor_parallel_size, pipeline_parallel_size, config.num_hidden_layers)
        if gpu_memory_utilization is not None and "memory_per_worker" not in host_args:
            budget = int(gpu_memory_utilization *
                         _device_memory(host_args.get("backend", "cpu"), workers))
            need = model_memory(self.model, host_args.get("backend", "cpu"), kv_tokens=0)
            if budget < need:
                raise InvalidArgumentError(
                    f"gpu_memory_utilization={gpu_memory_utilization} gives each worker "
                    f"{budget / 2**20:.0f} MiB, less than the model's {need / 2**20:.0f} MiB")
            host_args["memory_per_worker"] = budget
        if isinstance(model, Model) and dtype != "auto":
            host_args.setdefault("weight_dtype", DTYPES[dtype])
        self.host = Host(self.model, workers=workers, layout=host_args.pop("layout", layout),
                         seed=seed, **host_args)
        log.info("LLM %s on %s", self.model.name or "model", self.host.layout())

    @staticmethod
    def _host_args(engine_args):
        """vLLM's engine arguments as Host arguments; unknown names are refused, all at once."""
        unknown = sorted(set(engine_args) - set(ENGINE_ARGS) - NOTED_ARGS - HOST_ARGS)
        if unknown:
            raise InvalidArgumentError(f"LLM() got arguments gyges does not know: "
                                       f"{', '.join(unknown)}")
        host_args = {}
        for name, value in engine_args.items():
            if name in NOTED_ARGS:
                if name in NOTED_ONLY_AT and value not in NOTED_ONLY_AT[name]:
                    raise InvalidArgumentError(f"{name}={value!r}: gyges supports only "
                                               f"{NOTED_ONLY_AT[name]}")
                log.info("LLM: %s=%r has no effect in gyges", name, value)
            else:
                host_args[ENGINE_ARGS.get(name, name)] = value
        return host_args

    def get_tokenizer(self):
        return self.model.tokenizer

    def _params(self, tokens, params):
        """vLLM's length rule: max_tokens (None: all the room) is cut to what max_model_len leaves."""
        room = self.max_model_len - len(tokens)
        if room < 1:
            raise InvalidArgumentError(f"a prompt of {len(tokens)} tokens leaves no room under "
                                       f"max_model_len={self.max_model_len}")
        if params.max_tokens is None or params.max_tokens > room:
            params = dataclasses.replace(params, max_tokens=room,
                                         min_tokens=min(params.min_tokens, room))
        return params

    def generate(self, prompts, sampling_params=None, use_tqdm=True):
        """prompts: a string, a list of token ids, vLLM's {"prompt": ...} or
        {"prompt_token_ids": ...}, or a list of them; sampling_params: one for all or one per
        prompt. Returns a RequestOutput per prompt, in order; use_tqdm shows a progress bar."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, (list, tuple)) and prompts
                                                and all(isinstance(t, int) for t in prompts)):
            prompts = [prompts]
        prompts = [_prompt(p, i) for i, p in enumerate(prompts)]
        if isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != len(prompts):
                raise InvalidArgumentError(f"{len(sampling_params)} sampling_params for "
                                           f"{len(prompts)} prompts")
            params = [check_params(p) for p in sampling_params]
        else:
            params = [check_params(sampling_params)] * len(prompts)
        tokenizer = getattr(self.model, "tokenizer", None)
        # every prompt is checked before any is queued, so that a bad one queues nothing
        tokens = [tokenize_prompt(p, tokenizer)[0] for p in prompts]
        params = [self._params(t, p) for t, p in zip(tokens, params)]
        samples = []
        try:
            for p, sp in zip(prompts, params):
                samples.append([self.host.submit(p, s) for s in sp.sample_params()])
        except BaseException:
            for r in (r for group in samples for r in group):
                self.host.abort(r)
            raise
        self._run([r for group in samples for r in group], use_tqdm)
        return [request_output(group, sp) for group, sp in zip(samples, params)]

    def _run(self, requests, use_tqdm):
        if not use_tqdm:
            self.host.run()
            return
        from tqdm import tqdm
        with tqdm(total=len(requests), desc="Processed prompts", unit="req",
                  dynamic_ncols=True) as bar:
            def advance():
                done = sum(r.finished for r in requests)
                bar.update(done - bar.n)
            self.host.run(on_step=advance)
            advance()

    def chat(self, messages, sampling_params=None, use_tqdm=True):
        """One conversation ([{"role", "content"}, ...]) or a list of them, through the model's
        chat template with the assistant's turn opened."""
        prompts = [{"prompt_token_ids": p} for p in chat_prompts(self.model.tokenizer, messages)]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def close(self):
        self.host.close()

    def __repr__(self):
        return f"LLM({self.model.name or self.model!r}, {self.host!r})"

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
