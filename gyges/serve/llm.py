"""gyges.LLM: vLLM's offline API over a gyges Host, so that a script ports by changing its import.

    from gyges import LLM, SamplingParams          # was: from vllm import LLM, SamplingParams
    llm = LLM(model="smollm2-135m-instruct", tensor_parallel_size=3)
    outputs = llm.generate(["The capital of France is"], SamplingParams(max_tokens=16))
    outputs[0].outputs[0].text, outputs[0].outputs[0].token_ids
    llm.chat([{"role": "user", "content": "What is the capital of France?"}])
    llm.host.transform(workers=(0, 1, 2), tp=1)     # what vLLM cannot: reshape it live

Outputs are vLLM's RequestOutput / CompletionOutput shapes; SamplingParams is gyges' (its
defaults beside vLLM's are in its docstring). The host is a TP group of tensor_parallel_size
workers; `llm.host` is the gyges.Host, for everything else.
"""
import logging
from dataclasses import dataclass, field

from ..core import checks
from ..runtime.engine import SamplingParams, check_params
from ..core.errors import ArgumentTypeError, InvalidArgumentError
from ..runtime.host import Host
from ..models.model import Model
from ..models.tokenizer import chat_prompts
from ..core.units import parse_size

log = logging.getLogger(__name__)


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list
    finish_reason: str | None
    stop_reason: object = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list
    outputs: list
    finished: bool
    metrics: object = None
    request: object = field(default=None, repr=False)  # the gyges.Request behind it


def _output(request):
    done = CompletionOutput(0, request.text if request.text is not None else "",
                            list(request.output_tokens), request.finish_reason,
                            request.stop_reason)
    return RequestOutput(str(request.id), request.prompt_text, list(request.prompt), [done],
                         request.finished, request.metrics, request)


class LLM:
    def __init__(self, model, tensor_parallel_size=1, dtype="f32", memory_per_worker=None,
                 page_size="256KiB", kv_memory="256MiB", **host_args):
        checks.integer("tensor_parallel_size", tensor_parallel_size, lo=1)
        if dtype == "auto":
            dtype = "f32"
        if isinstance(model, Model):
            self.model = model
        elif isinstance(model, str):
            self.model = Model.load(model, dtype=dtype)
        else:
            raise ArgumentTypeError(f"model must be a name, a path or a gyges.Model, got "
                                    f"{type(model).__name__}")
        if memory_per_worker is None:  # the whole model (workers start with all of it) + KV
            c = self.model.config
            weights = c.weight_bytes({"f32": 4, "bf16": 2, "f16": 2}[self.model.weight_dtype])
            memory_per_worker = int(weights * 1.1) + parse_size(kv_memory, "kv_memory")
        self.host = Host(self.model, workers=tensor_parallel_size,
                         layout=f"TP{tensor_parallel_size}", memory_per_worker=memory_per_worker,
                         page_size=page_size, **host_args)
        log.info("LLM %s on %s", self.model.name or "model", self.host.layout())

    def get_tokenizer(self):
        return self.model.tokenizer

    def generate(self, prompts, sampling_params=None, use_tqdm=False):
        """prompts: a string, a list of strings, or {"prompt_token_ids": [...]} dicts;
        sampling_params: one for all or one per prompt. Returns RequestOutputs in order."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = [p["prompt_token_ids"] if isinstance(p, dict) else p for p in prompts]
        if isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != len(prompts):
                raise InvalidArgumentError(f"{len(sampling_params)} sampling_params for "
                                           f"{len(prompts)} prompts")
            params = [check_params(p) for p in sampling_params]
        else:
            params = [check_params(sampling_params)] * len(prompts)
        requests = [self.host.submit(p, sp) for p, sp in zip(prompts, params)]
        self.host.run()
        return [_output(r) for r in requests]

    def chat(self, messages, sampling_params=None, use_tqdm=False):
        """One conversation ([{"role", "content"}, ...]) or a list of them, through the model's
        chat template with the assistant's turn opened."""
        prompts = [{"prompt_token_ids": p} for p in chat_prompts(self.model.tokenizer, messages)]
        return self.generate(prompts, sampling_params)

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
