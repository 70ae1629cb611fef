"""Offline API: LLM(model=...).generate(prompts, SamplingParams(...))."""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from engine.config import EngineConfig
from engine.engine import Engine
from engine.outputs import SpecStats, TokenLogprob
from engine.sampling_params import SamplingParams


@dataclass
class CompletionOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    spec: SpecStats = field(default_factory=SpecStats)


class LLM:
    """Synchronous front end over the engine; the tokenizer lives here, not in the engine."""

    def __init__(self, model: str, dtype: str = "auto", tokenizer: str | None = None,
                 skip_tokenizer_init: bool = False, **engine_options):
        """skip_tokenizer_init: token-id prompts only and no output text (checkpoints without a tokenizer)."""
        from engine.tokenizer import load_tokenizer

        self.engine = Engine(EngineConfig(model=model, dtype=dtype, **engine_options))
        self.tokenizer = None if skip_tokenizer_init else load_tokenizer(tokenizer or model)
        self._ids = itertools.count()

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[CompletionOutput]:
        prompts = _as_prompt_list(prompts)
        params = sampling_params or SamplingParams()
        params = params if isinstance(params, list) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts")
        token_lists = [self._tokenize(p) for p in prompts]
        outputs: dict[str, CompletionOutput] = {}
        for tokens, p in zip(token_lists, params):   # validate all before queueing any
            self.engine.validate_prompt(tokens, p)
        for tokens, p in zip(token_lists, params):
            request_id = f"offline-{next(self._ids)}"
            self.engine.add_request(request_id, tokens, p)
            outputs[request_id] = CompletionOutput(request_id, tokens, logprobs=[] if p.logprobs is not None else None)
        progress = _progress(len(outputs)) if use_tqdm else None
        while self.engine.has_unfinished_requests():
            for delta in self.engine.step():
                out = outputs[delta.request_id]
                out.token_ids.extend(delta.new_token_ids)
                if delta.new_logprobs is not None:
                    out.logprobs.extend(delta.new_logprobs)
                if delta.prompt_logprobs is not None:
                    out.prompt_logprobs = delta.prompt_logprobs
                out.spec = delta.spec
                if delta.finished:
                    if delta.finish_reason == "error":
                        raise RuntimeError(f"request {delta.request_id} failed: {delta.error}")
                    out.finish_reason = delta.finish_reason
                    if self.tokenizer is not None:
                        out.text = self.tokenizer.decode(out.token_ids, skip_special_tokens=True)
                    if progress:
                        progress.update(1)
        if progress:
            progress.close()
        return list(outputs.values())

    def _tokenize(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer: this LLM was created with skip_tokenizer_init")
            return self.tokenizer.encode(prompt)
        return list(prompt)


def _as_prompt_list(prompts) -> list:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]   # a single prompt given as token ids
    return prompts


def _progress(total: int):
    from tqdm import tqdm
    return tqdm(total=total, desc="generate")
