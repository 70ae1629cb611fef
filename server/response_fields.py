"""The pieces every response is built from: ids, timestamps, usage, specserve's speculation counters,
logprobs in OpenAI's completions and chat shapes, and the SSE framing of streamed chunks. Responses are
plain dicts: they are written once and never validated.
"""
from __future__ import annotations

import json
import math
import time
import uuid
from typing import Any

from engine.outputs import SpecStats, TokenLogprob

LOGPROB_FLOOR = -9999.0   # JSON has no -inf: a token the warped distribution excludes gets this


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def speculative(stats: list[SpecStats], discarded: int = 0) -> dict[str, Any]:
    """specserve's own counters, summed over the choices; never inside OpenAI's objects. `discarded`:
    tokens generated but not returned (after a stop string). Per choice with at least one token,
    completion tokens + discarded = 1 + accepted + target_forwards (see engine.outputs.SpecStats).

    How speculation ran: `methods` {proposer: decode passes} ("none": passes that verified no draft)
    and `k` {"<drafts verified>": decode passes} (JSON keys are strings; ascending k). Both count
    decode passes only: their totals are equal, and at most target_forwards (which also counts the
    recomputation pass after a preemption)."""
    methods: dict[str, int] = {}
    ks: dict[int, int] = {}
    for s in stats:
        for method, n in s.passes_by_method.items():
            methods[method] = methods.get(method, 0) + n
        for k, n in s.passes_by_k.items():
            ks[k] = ks.get(k, 0) + n
    return {"proposed": sum(s.proposed for s in stats), "accepted": sum(s.accepted for s in stats),
            "target_forwards": sum(s.target_forwards for s in stats), "discarded": discarded,
            "methods": dict(sorted(methods.items())), "k": {str(k): ks[k] for k in sorted(ks)}}


def sse(payload: dict[str, Any] | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n"


def finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else LOGPROB_FLOOR


def completion_logprobs(entries: list[TokenLogprob | None], token_ids: list[int], token_str, text_offset: int
                        ) -> tuple[dict[str, list], int]:
    """OpenAI's legacy completions shape; entry None (a prompt's first token) has no logprob.

    The top_logprobs dicts also hold the chosen token (as vLLM does), so a client can always
    compare the chosen token with the best one. Returns the object and the next text offset."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token_id, entry in zip(token_ids, entries):
        text = token_str(token_id)
        out["tokens"].append(text)
        out["text_offset"].append(text_offset)
        text_offset += len(text)
        if entry is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        out["token_logprobs"].append(finite(entry.logprob))
        top: dict[str, float] = {}
        for token_id, logprob in entry.top:   # best first: ids that decode to the same text keep the best
            top.setdefault(token_str(token_id), finite(logprob))
        top.setdefault(text, finite(entry.logprob))
        out["top_logprobs"].append(top)
    return out, text_offset


def chat_logprobs(entries: list[TokenLogprob], token_str) -> dict[str, list]:
    """OpenAI's chat shape: {"content": [{token, logprob, bytes, top_logprobs: [...]}]}."""
    def item(token_id: int, logprob: float) -> dict[str, Any]:
        text = token_str(token_id)
        return {"token": text, "logprob": finite(logprob), "bytes": list(text.encode("utf-8"))}

    return {"content": [{**item(e.token_id, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]}
                        for e in entries]}
