"""Drive a running server with streaming completions, in phases of different traffic, and report.

    python bench/load.py --url http://127.0.0.1:8000 --model specserve-default \
        --phases chat:120,agentic:120 --concurrency 4

Phases (all through /v1/chat/completions, streamed): `chat` sends the Spec-Bench development
questions (first turns), the traffic the default draft was made for; `agentic` sends tool-call
style conversations (JSON calls and observations), the kind of traffic the draft was never
trained on, so acceptance should drop. Prints, per phase, requests, tokens/s, TTFT and the
acceptance the responses reported. Request loops are bounded by the phase durations and talk
only to the given (loopback) URL.
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import time

import httpx

QUESTIONS = os.path.join(os.path.dirname(__file__), "data", "spec_bench", "question_dev.jsonl")


def chat_prompts(rng: random.Random, count: int = 200) -> list[list[dict]]:
    with open(QUESTIONS) as f:
        questions = [json.loads(line)["turns"][0] for line in f if line.strip()]
    return [[{"role": "user", "content": q}] for q in rng.sample(questions, min(count, len(questions)))]


def agentic_prompts(rng: random.Random, count: int = 200) -> list[list[dict]]:
    tools = ["search_flights", "get_weather", "create_ticket", "query_db", "send_email", "book_room"]
    prompts = []
    for _ in range(count):
        call = {"tool": rng.choice(tools), "arguments": {"city": rng.choice(["Oslo", "Lima", "Pune"]),
                                                         "date": f"2026-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}",
                                                         "limit": rng.randint(1, 50)}}
        prompts.append([
            {"role": "system", "content": f"You call tools by answering with one JSON object. Tools: {', '.join(tools)}."},
            {"role": "user", "content": f"please handle request #{rng.randint(1000, 9999)}"},
            {"role": "assistant", "content": json.dumps(call)},
            {"role": "user", "content": "Observation: " + json.dumps({"status": "ok", "items": rng.randint(0, 9)})
                                        + "\nNext tool call?"}])
    return prompts


async def one_request(client: httpx.AsyncClient, url: str, model: str, messages: list[dict], max_tokens: int) -> dict:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}
    start = time.monotonic()
    first = None
    usage = spec = None
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and first is None:
                first = time.monotonic() - start
            usage, spec = chunk.get("usage") or usage, chunk.get("speculative") or spec
    return {"ttft": first or 0.0, "tokens": (usage or {}).get("completion_tokens", 0), "spec": spec or {}}


async def run_phase(url: str, model: str, prompts: list[list[dict]], seconds: float, concurrency: int,
                    max_tokens: int) -> list[dict]:
    deadline = time.monotonic() + seconds
    results: list[dict] = []
    queue = itertools.cycle(prompts)

    async def worker(client):
        while time.monotonic() < deadline:
            results.append(await one_request(client, url, model, next(queue), max_tokens))

    async with httpx.AsyncClient(timeout=300) as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
    return results


def report(name: str, results: list[dict], seconds: float) -> None:
    tokens = sum(r["tokens"] for r in results)
    proposed = sum(r["spec"].get("proposed", 0) for r in results)
    accepted = sum(r["spec"].get("accepted", 0) for r in results)
    ttfts = sorted(r["ttft"] for r in results) or [0.0]
    rate = f"{accepted / proposed:.2f}" if proposed else "n/a"
    print(f"{name:8s} {len(results):4d} requests  {tokens / seconds:7.1f} tok/s  "
          f"TTFT p50 {ttfts[len(ttfts) // 2]:.2f}s  acceptance {rate} ({accepted}/{proposed})", flush=True)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default="specserve-default")
    parser.add_argument("--phases", default="chat:60,agentic:60", help="name:seconds,... (chat | agentic)")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    sources = {"chat": chat_prompts, "agentic": agentic_prompts}
    for phase in args.phases.split(","):
        name, seconds = phase.split(":")
        start = time.monotonic()
        results = asyncio.run(run_phase(args.url, args.model, sources[name](rng), float(seconds),
                                        args.concurrency, args.max_tokens))
        report(name, results, time.monotonic() - start)


if __name__ == "__main__":
    main()
