"""Soak: 1,000 mixed requests against a real `specserve serve` process (engine core in its own
process, a noisy draft model speculating, so rejection and rollback run all the time).

The mix, drawn from a fixed seed: completions and chat completions, streamed and not, n up to 4,
prompt lists and token-id prompts (with a shared prefix, so the prefix cache hits), random
temperature / top_p / top_k / min_p / penalties / seed / max_tokens, stop strings and stop token
ids, logprobs, echo, per-request speculation settings; 32 requests in flight at a time. One request
in ten is abandoned by its client: a stream closed after its first few events, or a non-streaming
request whose short timeout closes the connection (while it waits, or mid-generation).

What must hold:
- nothing is lost or hung: every request comes back within REQUEST_TIMEOUT;
- every request not abandoned is a 200 with a well-formed body: one choice per prompt x n, in
  order, each finished by "stop" or "length"; usage adds up (prompt tokens as tokenized, completion
  tokens within max_tokens, equal to the logprobs' token count where asked, and obeying the
  speculation accounting identity); no stop string in the text; streams end with [DONE];
- afterwards the engine is empty (/health: no request, every KV block free; /metrics: 0 running,
  0 waiting, KV usage 0), no engine request failed, and the API process's bridge holds nothing
  either (its watchdog, set short here, turns /health into 503 "engine_stalled" while it believes a
  request is in flight);
- the RSS of the server process and its children (the engine core) grows less than
  RSS_GROWTH_BOUND between the end of a warm-up and the end of the run.

Caches that fill slowly would look like a leak here, so they are kept small or measured apart:
- oneDNN (the packed CPU linears) keeps a primitive of ~0.56 MiB per weight shape and row count,
  in caches bounded by engine.models.cpu_linear (256 entries each; at oneDNN's default of 1,024 the
  engine grew by ~700 MiB over ~1,500 requests of this mix). The server here caps them at 16
  (ONEDNN_CACHES), so that they are full within the warm-up and growth after it is ours;
  tests/test_cpu_linear.py checks the default bound;
- the test tokenizer's BPE cache (10,000 words; its byte-level pre-tokenizer makes a whole prompt one
  word) keeps every distinct prompt: the API process grows ~4 KB per request (flat when they repeat).
Run with -s to see the figures (time per phase, RSS, aborts, preemptions).
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import time
from dataclasses import dataclass, field

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import ServerProcess, wait_until_idle

pytestmark = pytest.mark.slow   # a soak: minutes of mixed traffic

MODEL = "tiny"
SEED = 15
NUM_REQUESTS = 1000
PHASES = (100, 450, 450)      # warm-up, then two halves: RSS is read after each, the server idle
CONCURRENCY = 32
ABORT_FRACTION = 0.1
REQUEST_TIMEOUT = 60.0        # seconds: a request still unanswered then counts as hung
WATCHDOG_TIMEOUT = 2.0
RSS_GROWTH_BOUND = 32 << 20   # bytes, server + engine process, from after warm-up to the end (seen: < 16)
ONEDNN_CACHES = {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "16", "LRU_CACHE_CAPACITY": "16"}   # see above
FINISH_REASONS = {"stop", "length"}
MAX_CONTEXT = 400             # prompt + max_tokens of every request (the tiny model's context is 512)

WORDS = ("the a of to and speculative draft token verify cache block batch queue stream model server request "
         "answer question why how when rollback accept reject sample seed prefix é € ß 😀 日本").split()
SHARED_PREFIX = "You are a helpful assistant; answer briefly and well. "   # > 3 blocks of 16 byte tokens
STOP_CHARS = "etaoin srhl.,!?\n"


# ---- the mix -----------------------------------------------------------------------------------

@dataclass
class Spec:
    """One request, and what its answer must look like."""
    index: int
    path: str
    body: dict
    num_choices: int
    prompt_tokens: int
    max_tokens: int
    stops: list[str]
    echo: list[str]                      # per choice: the text echo puts in front of it ("" without echo)
    abort: tuple | None = None           # ("events", k): close the stream after k events; ("timeout", s)
    outcome: str = ""
    errors: list[str] = field(default_factory=list)


def words(rng: random.Random, lo: int, hi: int) -> str:
    text = " ".join(rng.choices(WORDS, k=rng.randint(lo, hi)))
    return SHARED_PREFIX + text if rng.random() < 0.3 else text


def sampling(rng: random.Random, body: dict, abort: bool) -> list[str]:
    """Random sampling fields into body; returns the stop strings."""
    r = rng.random()
    if r < 0.2:
        body["temperature"] = 0.0
    elif r < 0.9:
        body["temperature"] = round(rng.uniform(0.3, 1.5), 3)
    if rng.random() < 0.4:
        body["top_p"] = round(rng.uniform(0.3, 1.0), 3)
    if rng.random() < 0.3:
        body["top_k"] = rng.choice([-1, 0, 1, 5, 20, 100])
    if rng.random() < 0.3:
        body["min_p"] = round(rng.uniform(0.0, 0.3), 3)
    if rng.random() < 0.5:
        body["seed"] = rng.randrange(2**31)
    if rng.random() < 0.1:
        body.update(presence_penalty=round(rng.uniform(-1, 1), 2), frequency_penalty=round(rng.uniform(-1, 1), 2))
    if rng.random() < 0.1:
        body["repetition_penalty"] = round(rng.uniform(0.8, 1.3), 2)
    if rng.random() < 0.15:
        body["speculative"] = rng.choice([{"num_speculative_tokens": rng.randint(0, 4)}, {"method": "none"},
                                          {"method": "draft", "num_speculative_tokens": rng.randint(1, 4)}])
    if abort:   # abandoned requests run long enough to be cut off mid-generation
        body["ignore_eos"] = True
        return []
    if rng.random() < 0.2:
        body["ignore_eos"] = True
    if rng.random() < 0.1:
        body["stop_token_ids"] = rng.sample(range(256), rng.randint(1, 4))
    stops: list[str] = []
    if rng.random() < 0.4:
        stops = rng.sample(STOP_CHARS, rng.randint(1, 8)) + (["the", "é"] if rng.random() < 0.3 else [])
        body["stop"] = stops[0] if len(stops) == 1 and rng.random() < 0.5 else stops
    return stops


def make_spec(rng: random.Random, index: int, tokenizer) -> Spec:
    from engine.tokenizer import render_chat
    abort = None
    if rng.random() < ABORT_FRACTION:
        abort = ("events", rng.randint(1, 3)) if rng.random() < 0.5 else ("timeout", rng.uniform(0.02, 0.5))
    stream = abort is not None and abort[0] == "events" or (abort is None and rng.random() < 0.5)
    body: dict = {"model": MODEL, "stream": stream}
    stops = sampling(rng, body, abort is not None)
    n = rng.randint(2, 4) if rng.random() < 0.25 else 1
    if n > 1 or rng.random() < 0.5:
        body["n"] = n
    max_tokens = rng.randint(32, 128) if abort else rng.randint(1, 24)
    if stream and rng.random() < 0.5:
        body["stream_options"] = {"include_usage": True}
    if rng.random() < 0.55:
        kind = rng.random()
        if kind < 0.6:
            prompts = [words(rng, 1, 20)]
        elif kind < 0.8:
            prompts = [words(rng, 1, 12) for _ in range(rng.randint(2, 3))]
        else:
            prompts = [[rng.randrange(256) for _ in range(rng.randint(3, 40))] for _ in range(rng.randint(1, 3))]
        body["prompt"] = prompts[0] if len(prompts) == 1 and rng.random() < 0.7 else prompts
        ids = [p if isinstance(p, list) else tokenizer.encode(p) for p in prompts]
        assert max(map(len, ids)) + max_tokens <= MAX_CONTEXT
        body["max_tokens"] = max_tokens
        echo = not abort and rng.random() < 0.1
        if echo:
            body["echo"] = True
        if rng.random() < 0.25:
            body["logprobs"] = rng.randint(0, 5)
        echoes = [(p if isinstance(p, str) else tokenizer.decode(p)) if echo else "" for p in prompts for _ in range(n)]
        return Spec(index, "/v1/completions", body, len(prompts) * n, sum(map(len, ids)), max_tokens, stops,
                    echoes, abort)
    messages = [{"role": "system", "content": SHARED_PREFIX}] if rng.random() < 0.4 else []
    for turn in range(rng.choice([1, 1, 2, 3])):
        if turn:
            messages.append({"role": "assistant", "content": words(rng, 1, 6)})
        messages.append({"role": "user", "content": words(rng, 1, 10)})
    while len(render_chat(tokenizer, messages)) + max_tokens > MAX_CONTEXT and len(messages) > 1:
        messages = messages[1:]   # oldest first
    body["messages"] = messages
    body["max_completion_tokens" if rng.random() < 0.5 else "max_tokens"] = max_tokens
    if rng.random() < 0.25:
        body["logprobs"] = True
        if rng.random() < 0.7:
            body["top_logprobs"] = rng.randint(0, 5)
    return Spec(index, "/v1/chat/completions", body, n, len(render_chat(tokenizer, messages)), max_tokens, stops,
                [""] * n, abort)


# ---- what an answer must look like ---------------------------------------------------------------

def check_choice(spec: Spec, index: int, text: str, finish_reason, num_tokens: int | None) -> None:
    assert finish_reason in FINISH_REASONS, f"choice {index}: finish_reason {finish_reason!r}"
    assert text.startswith(spec.echo[index]), f"choice {index}: no echo of the prompt"
    generated = text[len(spec.echo[index]):]
    found = [s for s in spec.stops if s in generated]
    assert not found, f"choice {index}: stop strings {found} in {generated!r}"
    if num_tokens is not None:   # known from logprobs
        assert 1 <= num_tokens <= spec.max_tokens, f"choice {index}: {num_tokens} tokens"
        assert finish_reason == "stop" or num_tokens == spec.max_tokens, f"choice {index}: length at {num_tokens}"


def logprobs_asked(spec: Spec) -> bool:
    value = spec.body.get("logprobs")
    return value is not None and value is not False   # logprobs 0 asks for the chosen token's


def num_logprob_tokens(spec: Spec, logprobs, index: int) -> int | None:
    """Tokens of a choice, as its logprobs count them (None when none were asked)."""
    asked = logprobs_asked(spec)
    assert (logprobs is not None) == asked, f"choice {index}: logprobs {logprobs!r}"
    if not asked:
        return None
    if spec.path == "/v1/chat/completions":
        return len(logprobs["content"])
    tokens = logprobs["tokens"]
    assert len(tokens) == len(logprobs["token_logprobs"]) == len(logprobs["top_logprobs"]) == len(logprobs["text_offset"])
    return None if spec.body.get("echo") else len(tokens)   # with echo, the prompt's tokens come first


def check_usage(spec: Spec, usage: dict, speculative: dict, counted: list[int | None]) -> None:
    assert usage["prompt_tokens"] == spec.prompt_tokens, usage
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"], usage
    assert spec.num_choices <= usage["completion_tokens"] <= spec.num_choices * spec.max_tokens, usage
    if all(c is not None for c in counted):
        assert usage["completion_tokens"] == sum(counted), (usage, counted)
    # usage + discarded = each choice's first token + accepted drafts + one token per target pass
    assert (usage["completion_tokens"] + speculative["discarded"] ==
            spec.num_choices + speculative["accepted"] + speculative["target_forwards"]), (usage, speculative)
    assert speculative["accepted"] <= speculative["proposed"], speculative


def check_body(spec: Spec, body: dict) -> None:
    chat = spec.path == "/v1/chat/completions"
    assert body["object"] == ("chat.completion" if chat else "text_completion"), body["object"]
    assert [c["index"] for c in body["choices"]] == list(range(spec.num_choices)), body["choices"]
    counted = []
    for c in body["choices"]:
        if chat:
            assert c["message"]["role"] == "assistant"
        text = c["message"]["content"] if chat else c["text"]
        counted.append(num_logprob_tokens(spec, c["logprobs"], c["index"]))
        check_choice(spec, c["index"], text, c["finish_reason"], counted[-1])
    check_usage(spec, body["usage"], body["speculative"], counted)


def check_stream(spec: Spec, events: list) -> None:
    chat = spec.path == "/v1/chat/completions"
    assert events and events[-1] == "[DONE]", events[-3:]
    chunks = events[:-1]
    assert "[DONE]" not in chunks and not any("error" in c for c in chunks), [c for c in chunks if "error" in c]
    include_usage = bool(spec.body.get("stream_options", {}).get("include_usage"))
    if include_usage:
        last = chunks.pop()
        assert last["choices"] == [] and last["usage"], last
    texts = [""] * spec.num_choices
    finish = [None] * spec.num_choices
    tokens = [0] * spec.num_choices
    started: set[int] = set()
    for chunk in chunks:
        assert chunk["object"] == ("chat.completion.chunk" if chat else "text_completion")
        assert chunk.get("usage", "absent") == (None if include_usage else "absent"), chunk
        (c,) = chunk["choices"]
        i = c["index"]
        assert finish[i] is None, f"choice {i}: a chunk after its finish_reason"
        if chat and i not in started:
            assert c["delta"].get("role") == "assistant", f"choice {i}: its first chunk names no role"
        started.add(i)
        texts[i] += (c["delta"].get("content") or "") if chat else c["text"]
        finish[i] = c["finish_reason"]
        if c["logprobs"] is not None:
            tokens[i] += len(c["logprobs"]["content"]) if chat else len(c["logprobs"]["tokens"])
    counted = [tokens[i] if logprobs_asked(spec) and not spec.body.get("echo") else None
               for i in range(spec.num_choices)]
    for i in range(spec.num_choices):
        check_choice(spec, i, texts[i], finish[i], counted[i])
    if include_usage:
        check_usage(spec, last["usage"], last["speculative"], counted)


async def run_one(http: httpx.AsyncClient, url: str, spec: Spec) -> None:
    """Send one request, abandon it if so drawn, and check what came back; sets spec.outcome."""
    if spec.abort and spec.abort[0] == "timeout":
        try:
            response = await http.post(url + spec.path, json=spec.body, timeout=spec.abort[1])
        except httpx.TimeoutException:
            spec.outcome = "aborted"
            return
        assert response.status_code == 200, response.text
        check_body(spec, response.json())
    elif spec.body["stream"]:
        async with http.stream("POST", url + spec.path, json=spec.body) as response:
            assert response.status_code == 200, await response.aread()
            events = []
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    data = line[len("data: "):]
                    events.append(data if data == "[DONE]" else json.loads(data))
                    if spec.abort and len(events) >= spec.abort[1] and data != "[DONE]":
                        spec.outcome = "aborted"
                        return   # leaving the block closes the connection mid-stream
        check_stream(spec, events)
    else:
        response = await http.post(url + spec.path, json=spec.body)
        assert response.status_code == 200, response.text
        check_body(spec, response.json())
    spec.outcome = "ok"


async def run_phase(url: str, specs: list[Spec]) -> None:
    gate = asyncio.Semaphore(CONCURRENCY)

    async def guarded(spec: Spec) -> None:
        async with gate:
            try:
                await asyncio.wait_for(run_one(http, url, spec), REQUEST_TIMEOUT)
            except asyncio.TimeoutError:
                spec.outcome = "hung"
            except Exception as exc:  # noqa: BLE001 - collected, reported together below
                spec.outcome = "failed"
                spec.errors.append(f"{type(exc).__name__}: {str(exc)[:600]}")

    limits = httpx.Limits(max_connections=CONCURRENCY * 2, max_keepalive_connections=CONCURRENCY)
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT, limits=limits) as http:
        await asyncio.gather(*(guarded(spec) for spec in specs))


# ---- the server's side ------------------------------------------------------------------------

def process_tree_rss(root: int) -> dict[int, int]:
    """{pid: VmRSS in bytes} of root and all its descendants (read from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    rss, todo = {}, [root]
    while todo:
        pid = todo.pop()
        todo.extend(children.get(pid, []))
        try:
            with open(f"/proc/{pid}/status") as f:
                line = next(x for x in f if x.startswith("VmRSS:"))
            rss[pid] = int(line.split()[1]) * 1024
        except (OSError, StopIteration):
            pass
    return rss


def metrics(url: str) -> dict[tuple, float]:
    """{(sample name, frozenset of labels but model_name): value} of every specserve sample."""
    out = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for s in family.samples:
            labels = frozenset((k, v) for k, v in s.labels.items() if k != "model_name")
            out[(s.name, labels)] = s.value
    return out


def mib(num_bytes: float) -> str:
    return f"{num_bytes / 2**20:.1f} MiB"


# ---- the soak -----------------------------------------------------------------------------------

def test_soak_mixed_requests_lose_nothing_and_leak_nothing(tiny_pair, tmp_path):
    from engine.tokenizer import load_tokenizer
    target, draft = tiny_pair
    tokenizer = load_tokenizer(str(target))
    rng = random.Random(SEED)
    specs = [make_spec(rng, i, tokenizer) for i in range(NUM_REQUESTS)]
    speculative = {"method": "draft", "draft": {"model": str(draft)}, "num_speculative_tokens": 4, "adaptive": False}
    server = ServerProcess(["--model", str(target), "--served-model-name", MODEL, "--dtype", "float32",
                            "--device", "cpu", "--num-kv-blocks", "128", "--max-num-seqs", "32",
                            "--speculative-config", json.dumps(speculative),
                            "--watchdog-timeout", str(WATCHDOG_TIMEOUT), "--log-level", "warning"],
                           env=ONEDNN_CACHES, log_path=tmp_path / "server.log")
    started = time.monotonic()
    server.start()
    try:
        server.wait_ready()
        ready = time.monotonic()
        engine_pid = httpx.get(server.url + "/health").json()["engine_pid"]
        figures, rss, begin = [], [], 0
        for size in PHASES:
            t0 = time.monotonic()
            asyncio.run(run_phase(server.url, specs[begin:begin + size]))
            begin += size
            health = wait_until_idle(server.url, timeout=15)
            tree = process_tree_rss(server.process.pid)
            assert engine_pid in tree and server.process.pid in tree, (engine_pid, tree)
            rss.append((tree[server.process.pid], tree[engine_pid], sum(tree.values())))
            figures.append(f"{begin:5d} requests  {time.monotonic() - t0:5.1f} s   RSS api {mib(rss[-1][0])}, "
                           f"engine {mib(rss[-1][1])}, tree of {len(tree)} {mib(rss[-1][2])}")
        outcomes = {o: sum(s.outcome == o for s in specs) for o in ("ok", "aborted", "failed", "hung", "")}
        bad = [s for s in specs if s.outcome not in ("ok", "aborted")]
        after = metrics(server.url)
        time.sleep(WATCHDOG_TIMEOUT + 0.5)   # a request the bridge still believed in flight shows now
        late_health = httpx.get(server.url + "/health")
        growth = rss[-1][2] - rss[0][2]
        finished = {reason: after.get(("specserve:request_success_total", frozenset({("finished_reason", reason)})), 0)
                    for reason in ("stop", "length", "abort", "error")}
        print(f"\nsoak: server ready in {ready - started:.1f} s, {NUM_REQUESTS} requests in "
              f"{time.monotonic() - ready:.1f} s; outcomes {outcomes}; engine requests finished {finished}; "
              f"preemptions {after.get(('specserve:num_preemptions_total', frozenset()), 0):.0f}; "
              f"RSS growth after warm-up {mib(growth)} (bound {mib(RSS_GROWTH_BOUND)})")
        print("\n".join(figures))
    finally:
        server.stop()

    assert not bad, f"{len(bad)} requests lost, hung or malformed, e.g. " + "\n".join(
        f"#{s.index} {s.outcome} {s.errors} {json.dumps(s.body)[:400]}" for s in bad[:5]) + server.log()[-3000:]
    assert outcomes["aborted"] >= NUM_REQUESTS * ABORT_FRACTION / 2, outcomes
    assert health["kv_blocks_free"] == health["kv_blocks_total"] and health["num_requests"] == 0, health
    for gauge in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert after[(f"specserve:{gauge}", frozenset())] == 0, (gauge, after[(f"specserve:{gauge}", frozenset())])
    assert finished["error"] == 0, finished
    completed_choices = sum(s.num_choices for s in specs if s.outcome == "ok")
    assert completed_choices <= sum(finished.values()) <= sum(s.num_choices for s in specs), (finished, completed_choices)
    assert late_health.status_code == 200, late_health.text
    assert growth < RSS_GROWTH_BOUND, f"RSS grew by {mib(growth)} after warm-up:\n" + "\n".join(figures)
