"""The HTTP server end to end: real uvicorn processes driven by the official `openai` client.

Two `specserve serve` subprocesses (one configured by flags, one by a YAML file plus SPECSERVE_*
variables with an API key) serve a tiny random fp32 model whose draft is a noisy copy of it, so
drafts are accepted and rejected, and rollback runs, under every request. Every response's counters
obey the accounting identity (assert_accounting). Tests that must reach into the engine (slow it
down, make it fail, kill its loop) run uvicorn in-process around an engine they hold; so does a
scripted model whose output is known byte for byte (stop strings inside multi-byte characters).
"""
from __future__ import annotations

import asyncio
import json
import re
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import InProcessServer, ServerProcess, sse_events, wait_until_idle

MODEL = "tiny"
ENGINE_FLAGS = ["--dtype", "float32", "--device", "cpu", "--num-kv-blocks", "256", "--max-num-seqs", "64"]
ERROR_KEYS = {"message", "type", "param", "code"}


def spec_config(draft) -> dict:
    return {"method": "draft", "draft": {"model": str(draft)}, "num_speculative_tokens": 4, "adaptive": False}


# ---- fixtures ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def launched(tiny_pair, tmp_path_factory):
    """Both server processes, started together (start-up is mostly imports: overlap them)."""
    target, draft = tiny_pair
    logs = tmp_path_factory.mktemp("server_logs")
    main = ServerProcess(["--model", str(target), "--served-model-name", MODEL, *ENGINE_FLAGS,
                          "--speculative-config", json.dumps(spec_config(draft))], log_path=logs / "main.log")
    config = logs / "auth.yaml"
    config.write_text(f"model: {target}\nserved_model_name: tiny-auth\ndtype: float32\ndevice: cpu\n"
                      f"num_kv_blocks: 64\nspeculative:\n  method: ngram\n  num_speculative_tokens: 3\n")
    auth = ServerProcess(["--config", str(config)], env={"SPECSERVE_API_KEY": "sk-test"},
                         log_path=logs / "auth.log")
    main.start()
    auth.start()
    yield main, auth
    main.stop()
    auth.stop()


@pytest.fixture(scope="module")
def offline(launched, tiny_pair):
    """The offline LLM on the same checkpoint pair: the reference outputs."""
    import torch

    from engine.llm import LLM
    torch.set_num_threads(1)
    target, draft = tiny_pair
    return LLM(str(target), dtype="float32", device="cpu", num_kv_blocks=256, speculative=spec_config(draft))


@pytest.fixture(scope="module")
def server(launched) -> ServerProcess:
    return launched[0].wait_ready()


@pytest.fixture(scope="module")
def auth_server(launched) -> ServerProcess:
    return launched[1].wait_ready()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def greedy(offline, prompt, max_tokens: int) -> str:
    from engine.sampling_params import SamplingParams
    return offline.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0.0))[0].text


def metric_samples(url: str, name: str) -> dict[tuple, float]:
    """{(sample name, sorted labels): value} of one metric family from /metrics."""
    text = httpx.get(url + "/metrics").text
    for family in text_string_to_metric_families(text):
        if family.name == name:
            return {(s.name, tuple(sorted(s.labels.items()))): s.value for s in family.samples}
    return {}


def steps_with_batch_over_one(url: str) -> float:
    samples = metric_samples(url, "specserve:batch_size")
    count = next(v for (n, _), v in samples.items() if n.endswith("_count"))
    le_one = next(v for (n, labels), v in samples.items() if n.endswith("_bucket") and ("le", "1.0") in labels)
    return count - le_one


def finished_count(url: str, reason: str) -> float:
    samples = metric_samples(url, "specserve:request_success")
    return sum(v for (n, labels), v in samples.items() if ("finished_reason", reason) in labels)


def assert_accounting(result) -> dict:
    """usage + discarded tokens = each choice's first token + accepted drafts + one token per target
    pass (engine.outputs.SpecStats); result: an SDK object or a JSON dict with usage and speculative."""
    body = result if isinstance(result, dict) else {"usage": result.usage.model_dump(),
                                                    "speculative": result.model_extra["speculative"],
                                                    "choices": result.choices}
    spec, usage = body["speculative"], body["usage"]
    num_choices = len(body["choices"]) or 1   # a streamed usage chunk has no choices: one per request here
    assert usage["completion_tokens"] + spec["discarded"] == num_choices + spec["accepted"] + spec["target_forwards"], body
    assert spec["accepted"] <= spec["proposed"]
    return spec


def assert_error(response: httpx.Response, status: int, param=None, code=None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == ERROR_KEYS and error["message"]
    assert error["param"] == param and error["code"] == code, error
    return error




# ---- tokenizer units (no server) -----------------------------------------------------------------

def test_detokenizer_never_splits_multibyte_characters():
    from helpers import make_tokenizer
    from engine.tokenizer import IncrementalDetokenizer

    tokenizer = make_tokenizer()
    text = "héllo €uro 😀 ok"
    ids = tokenizer.encode(text)
    assert len(ids) == len(text.encode())   # one token per byte: characters span tokens
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("prompt: "))
    pieces = [detok.push(t) for t in ids] + [detok.finish()]
    assert "".join(pieces) == text
    assert not any("\ufffd" in piece for piece in pieces)


def test_stop_matcher_holds_possible_prefixes_and_never_leaks():
    from engine.tokenizer import StopStringMatcher

    matcher = StopStringMatcher(["STOP", "xyz"])
    assert matcher.push("abcS") == ("abc", False)
    assert matcher.push("T") == ("", False)
    assert matcher.push("OX") == ("STOX", False)   # not a stop string after all: released
    assert matcher.push("..xy") == ("..", False)
    assert matcher.push("z and more") == ("", True)
    tail = StopStringMatcher(["abc"])
    assert tail.push("xab") == ("x", False)
    assert tail.finish() == "ab"


class CountingRequest:
    """What the bridge reads of an engine request it aborts (to stand in for its final output)."""

    def __init__(self, max_tokens: int, num_prompt_tokens: int):
        from engine.outputs import SpecStats
        self.max_tokens, self.num_prompt_tokens, self.num_output_tokens = max_tokens, num_prompt_tokens, 0
        self.arrival_time = self.first_scheduled_time = self.first_token_time = time.monotonic()
        self.spec_stats = SpecStats()


class CountingEngine:
    """Just enough of Engine for the bridge: each step gives every request one more token."""

    def __init__(self):
        self.requests: dict[str, CountingRequest] = {}
        self.polls = 0
        self.num_steps = 0
        self.last_stats = None

    def add_request(self, request_id, prompt_token_ids, params):
        if not prompt_token_ids:
            raise ValueError("prompt is empty")
        self.requests[request_id] = CountingRequest(params.max_tokens, len(prompt_token_ids))

    def abort_request(self, request_id):
        return self.requests.pop(request_id, None)

    def has_unfinished_requests(self):
        self.polls += 1
        return bool(self.requests)

    def status(self):
        from engine.engine import EngineStatus
        return EngineStatus(len(self.requests), len(self.requests), 0, 0, 0, 0.0, self.num_steps)

    def check_alive(self):
        pass   # nothing of it lives in another process

    def step(self):
        from engine.outputs import RequestOutput
        self.num_steps += 1
        outputs = []
        for request_id, request in list(self.requests.items()):
            request.num_output_tokens += 1
            finished = request.num_output_tokens == request.max_tokens
            outputs.append(RequestOutput(request_id, [request.num_output_tokens], finished,
                                         "length" if finished else None))
            if finished:
                del self.requests[request_id]
        return outputs


def test_async_engine_delivers_between_steps_and_sleeps_when_idle():
    from engine.sampling_params import SamplingParams
    from server.async_engine import AsyncEngine

    async def scenario():
        engine = CountingEngine()
        bridge = AsyncEngine(engine)
        bridge.start()
        queue = asyncio.Queue()
        await bridge.add_requests([([1], [("a", SamplingParams(max_tokens=3)), ("b", SamplingParams(max_tokens=50))])],
                                  queue)   # one prompt, two requests
        a_outputs = []
        while not a_outputs or not a_outputs[-1].finished:
            output = await queue.get()
            if output.request_id == "a":
                a_outputs.append(output)
        assert [o.new_token_ids for o in a_outputs] == [[1], [2], [3]]
        bridge.abort("b")
        with pytest.raises(ValueError, match="empty"):
            await bridge.add_requests([([], [("c", SamplingParams())])], queue)
        await asyncio.sleep(0.05)
        assert not engine.requests   # b aborted between steps
        polls = engine.polls
        await asyncio.sleep(0.3)
        assert engine.polls - polls <= 1, "the idle engine loop should sleep, not poll"
        assert bridge.is_alive
        bridge.stop()

    asyncio.run(asyncio.wait_for(scenario(), 30))


def test_a_dying_engine_loop_fails_the_commands_it_had_taken():
    """An add queued while the command that kills the loop is applied is failed with
    EngineDeadError (it used to wait forever)."""
    from engine.sampling_params import SamplingParams
    from server.async_engine import AsyncEngine, EngineDeadError
    from server.core_messages import Abort

    class BrokenAbort(CountingEngine):
        def abort_request(self, request_id):
            raise RuntimeError("abort bug")

    async def scenario():
        bridge = AsyncEngine(BrokenAbort())
        bridge.start()
        bridge.core.submit([Abort("x", "abort")])   # kills the loop
        with pytest.raises(EngineDeadError, match="abort bug"):
            await asyncio.wait_for(bridge.add_requests([([1], [("c", SamplingParams())])], asyncio.Queue()), 10)
        assert not bridge.is_alive
        bridge.stop()

    asyncio.run(asyncio.wait_for(scenario(), 30))


def test_every_command_and_message_crosses_a_pipe_unchanged():
    import multiprocessing

    from engine.engine import EngineStatus
    from engine.outputs import RequestOutput
    from engine.sampling_params import SamplingParams
    from server.core_messages import Abort, Aborted, Add, Added, Dead, EngineInfo, Idle, Ready, Stepped, Stop

    status = EngineStatus(1, 1, 0, 7, 8, 0.125, 3)
    output = RequestOutput("a", [5], finished=False)
    info = EngineInfo("tiny", "draft", ("draft",), 64, 272, "float32", "none", "cpu", 8, 16, 4, 1, 123)
    crossing = [Add([1, 2, 3], (("a", SamplingParams(seed=1)), ("b", SamplingParams(seed=2)))), Abort("a", "stop"),
                Stop(), Ready(info), Added((("a", None),)), Stepped([output], None, status), Idle(status),
                Aborted(output, "abort"), Dead("gone")]
    here, there = multiprocessing.Pipe()
    for item in crossing:
        here.send(item)
        assert there.recv() == item


# ---- endpoints -----------------------------------------------------------------------------------

def test_models_health_version_tokenize(server, client, offline):
    start_line = next(line for line in server.log().splitlines() if "url=http://" in line)
    for part in (f"served as '{MODEL}'", "dtype=float32", "device=cpu", "kv_blocks=256", "speculative=draft",
                 f"url={server.url}/v1"):
        assert part in start_line
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    health = httpx.get(server.url + "/health").json()
    assert health["status"] == "ok" and health["kv_blocks_total"] == 256
    assert httpx.get(server.url + "/version").json()["version"]
    tokens = httpx.post(server.url + "/tokenize", json={"prompt": "héllo"}).json()
    assert tokens["tokens"] == offline.tokenizer.encode("héllo") and tokens["count"] == len(tokens["tokens"])
    assert httpx.post(server.url + "/detokenize", json={"tokens": tokens["tokens"]}).json()["prompt"] == "héllo"


def test_completions_greedy_equal_offline_llm(client, offline):
    prompts = ["Hello, world", "The quick brown fox"]
    expected = [greedy(offline, p, 24) for p in prompts]
    single = client.completions.create(model=MODEL, prompt=prompts[0], max_tokens=24, temperature=0)
    assert single.choices[0].text == expected[0]
    assert single.usage.prompt_tokens == len(offline.tokenizer.encode(prompts[0]))
    assert single.usage.total_tokens == single.usage.prompt_tokens + single.usage.completion_tokens
    assert assert_accounting(single)["target_forwards"] > 0

    batch = client.completions.create(model=MODEL, prompt=prompts, max_tokens=24, temperature=0)
    assert [c.index for c in batch.choices] == [0, 1]
    assert [c.text for c in batch.choices] == expected
    spec = assert_accounting(batch)
    assert 0 < spec["accepted"] < spec["proposed"]   # the noisy draft: rejections and rollbacks happened

    ids = [offline.tokenizer.encode(p) for p in prompts]
    by_ids = client.completions.create(model=MODEL, prompt=ids[1], max_tokens=24, temperature=0)
    assert by_ids.choices[0].text == expected[1]
    by_id_lists = client.completions.create(model=MODEL, prompt=ids, max_tokens=24, temperature=0)
    assert [c.text for c in by_id_lists.choices] == expected


def test_completions_n_uses_seed_plus_index(client):
    args = dict(model=MODEL, prompt="Once upon", max_tokens=12, temperature=1.0)
    both = client.completions.create(n=2, seed=123, **args)
    assert [c.index for c in both.choices] == [0, 1]
    one = [client.completions.create(seed=seed, **args).choices[0].text for seed in (123, 124)]
    assert [c.text for c in both.choices] == one
    assert both.usage.completion_tokens == 24
    assert assert_accounting(both)["proposed"] > 0


def test_sampling_parameters_reach_the_engine(client, offline):
    """temperature and seed change the text through HTTP: a server that dropped them would fail here."""
    args = dict(model=MODEL, prompt="Once upon", max_tokens=16)
    texts = {seed: client.completions.create(temperature=1.0, seed=seed, **args).choices[0].text
             for seed in range(4)}
    assert len(set(texts.values())) >= 3   # different seeds, different samples
    assert client.completions.create(temperature=1.0, seed=2, **args).choices[0].text == texts[2]
    assert greedy(offline, "Once upon", 16) not in texts.values()   # sampled, not greedy
    cold = {client.completions.create(temperature=0, seed=seed, **args).choices[0].text for seed in range(3)}
    assert cold == {greedy(offline, "Once upon", 16)}   # temperature 0 is greedy, whatever the seed
    chat = [client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=12,
                                           temperature=1.0, seed=seed).choices[0].message.content for seed in (1, 2)]
    assert chat[0] != chat[1]


def test_completions_logprobs_echo_for_scoring(client, offline):
    from engine.sampling_params import SamplingParams

    prompt = "Score this text"
    prompt_ids = offline.tokenizer.encode(prompt)
    # lm-eval's loglikelihood request
    result = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, logprobs=1, echo=True,
                                       temperature=0)
    choice = result.choices[0]
    lp = choice.logprobs
    assert choice.text.startswith(prompt)
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == \
        len(prompt_ids) + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    reference = offline.generate([prompt], SamplingParams(max_tokens=1, temperature=0, logprobs=1,
                                                          prompt_logprobs=1))[0]
    for got, want in zip(lp.token_logprobs[1:-1], reference.prompt_logprobs[1:]):
        assert got == pytest.approx(want.logprob, abs=1e-4)
    assert lp.token_logprobs[-1] == pytest.approx(reference.logprobs[0].logprob, abs=1e-4)
    assert max(lp.top_logprobs[-1], key=lp.top_logprobs[-1].get) == lp.tokens[-1]   # greedy: the best token
    assert all(isinstance(t, dict) and t for t in lp.top_logprobs[1:])

    # max_tokens 0 with echo: score the prompt only
    scored = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, logprobs=1, echo=True)
    assert scored.choices[0].text == prompt and scored.usage.completion_tokens == 0
    assert scored.choices[0].logprobs.token_logprobs[1:] == pytest.approx(lp.token_logprobs[1:-1], abs=1e-5)


def test_completions_stream_equals_non_stream(client):
    args = dict(model=MODEL, prompt="Stream me", max_tokens=30, temperature=0.8, seed=11, logprobs=2)
    full = client.completions.create(**args)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **args))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    tokens = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert text == full.choices[0].text
    assert tokens == full.choices[0].logprobs.tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage == full.usage
    assert assert_accounting(full) == chunks[-1].model_extra["speculative"]


def test_chat_non_streaming_and_streaming(server, client, offline):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Tell me a story"}]
    args = dict(model=MODEL, messages=messages, max_tokens=20, temperature=0.9, seed=5)
    full = client.chat.completions.create(**args)
    assert full.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **args))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[0].finish_reason
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage == full.usage
    assert usage_chunk.model_extra["speculative"]["proposed"] > 0
    assert assert_accounting(full) == usage_chunk.model_extra["speculative"]
    assert all(c.usage is None for c in chunks[:-1])

    prompt_ids = httpx.post(server.url + "/tokenize", json={"messages": messages}).json()["tokens"]
    greedy_chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0)
    assert greedy_chat.choices[0].message.content == greedy(offline, prompt_ids, 20)
    assert greedy_chat.usage.prompt_tokens == len(prompt_ids)

    with_logprobs = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, temperature=0,
                                                   logprobs=True, top_logprobs=3)
    content = with_logprobs.choices[0].logprobs.content
    assert len(content) == with_logprobs.usage.completion_tokens
    assert all(len(item.top_logprobs) == 3 and item.logprob <= 0 for item in content)


def test_structured_outputs_over_http(client):
    """response_format (OpenAI's JSON forms, streamed or not) and structured_outputs (vLLM's extension)
    on both endpoints, sampled, with the draft at work: the output always matches."""
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},
              "required": ["ok", "n"], "additionalProperties": False}
    messages = [{"role": "user", "content": "Answer in JSON"}]
    response_format = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}
    for seed in range(3):
        full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, temperature=1.0,
                                              seed=seed, response_format=response_format)
        value = json.loads(full.choices[0].message.content)
        assert set(value) == {"ok", "n"} and value["n"] in (1, 2, 3) and full.choices[0].finish_reason == "stop"
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, temperature=0,
                                                 stream=True, response_format=response_format))
    assert set(json.loads("".join(c.choices[0].delta.content or "" for c in chunks if c.choices))) == {"ok", "n"}
    anything = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, temperature=0,
                                              response_format={"type": "json_object"}).choices[0]
    assert anything.message.content.startswith("{")   # a random model may not close it within 40 tokens
    if anything.finish_reason == "stop":
        assert isinstance(json.loads(anything.message.content), dict)
    choices = ["red", "green", "blue"]
    completion = client.completions.create(model=MODEL, prompt="Pick a colour:", max_tokens=10, temperature=1.0,
                                           n=4, seed=1, extra_body={"structured_outputs": {"choice": choices}})
    assert all(c.text in choices for c in completion.choices)
    regex = client.completions.create(model=MODEL, prompt="A code:", max_tokens=10, temperature=0.8,
                                      extra_body={"structured_outputs": {"regex": "[A-F]{2}[0-9]{3}"}})
    assert re.fullmatch("[A-F]{2}[0-9]{3}", regex.choices[0].text)


def test_stop_strings_across_token_boundaries(server, client, offline):
    prompt = "Stop strings"
    base = greedy(offline, prompt, 48)
    # A 3-character stop string from the middle of the output: 3+ byte tokens in this tokenizer.
    start = next(i for i in range(6, len(base) - 3) if "\ufffd" not in base[i:i + 3]
                 and base.index(base[i:i + 3]) == i)
    stop = base[start:start + 3]
    args = dict(model=MODEL, prompt=prompt, max_tokens=48, temperature=0, stop=[stop, "never-there"])
    stopped = client.completions.create(**args)
    assert stopped.choices[0].text == base[:start]
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.usage.completion_tokens < 48
    assert_accounting(stopped)
    chunks = list(client.completions.create(stream=True, **args))
    assert "".join(c.choices[0].text for c in chunks) == base[:start]
    assert chunks[-1].choices[0].finish_reason == "stop"
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=30,
                                          temperature=0, stop="\ufffd")
    assert "\ufffd" not in chat.choices[0].message.content
    wait_until_idle(server.url)   # the stopped requests were aborted in the engine


def test_concurrent_streams_are_batched_and_independent(server, offline):
    prompts = [f"Request number {i}: " + "abc" * (i % 5) for i in range(32)]
    expected = [greedy(offline, p, 24) for p in prompts]
    batched_before = steps_with_batch_over_one(server.url)

    async def one(client: openai.AsyncOpenAI, prompt: str) -> str:
        stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0,
                                                 stream=True)
        return "".join([chunk.choices[0].text async for chunk in stream])

    async def all_of_them() -> list[str]:
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                                      timeout=120) as client:
            return await asyncio.gather(*(one(client, p) for p in prompts))

    assert asyncio.run(all_of_them()) == expected
    assert steps_with_batch_over_one(server.url) > batched_before
    wait_until_idle(server.url)


def test_client_disconnect_mid_stream_frees_blocks(server):
    aborted_before = finished_count(server.url, "abort")
    body = {"model": MODEL, "prompt": "long one", "max_tokens": 480, "ignore_eos": True, "temperature": 0,
            "stream": True}
    with httpx.Client(timeout=30) as http, http.stream("POST", server.url + "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
    health = wait_until_idle(server.url)
    assert health["kv_blocks_free"] == health["kv_blocks_total"] == 256
    assert finished_count(server.url, "abort") == aborted_before + 1
    assert metric_samples(server.url, "specserve:kv_cache_usage_perc")[
        ("specserve:kv_cache_usage_perc", (("model_name", MODEL),))] == 0


@pytest.mark.parametrize("path, body, status, param, code", [
    ("/v1/completions", {"prompt": "a", "temperature": -1}, 400, "temperature", None),
    ("/v1/completions", {"prompt": "a", "top_p": 0}, 400, "top_p", None),
    ("/v1/completions", {"prompt": "a", "max_tokens": "many"}, 400, "max_tokens", None),
    ("/v1/completions", {"prompt": "a", "max_tokens": 0}, 400, "max_tokens", None),
    ("/v1/completions", {"prompt": "a", "n": 0}, 400, "n", None),
    ("/v1/completions", {"prompt": "a", "logprobs": 50}, 400, "logprobs", None),
    ("/v1/completions", {"prompt": "a", "seed": 2**70}, 400, "seed", None),
    ("/v1/completions", {"prompt": "a", "stop_token_ids": [-3]}, 400, "stop_token_ids", None),
    ("/v1/completions", {"max_tokens": 1}, 400, "prompt", None),
    ("/v1/completions", {"prompt": []}, 400, "prompt", None),
    ("/v1/completions", {"prompt": [1, 99999]}, 400, "prompt", None),
    ("/v1/completions", {"prompt": "a", "max_tokens": 100000}, 400, "prompt", "context_length_exceeded"),
    ("/v1/completions", {"prompt": "a", "model": "gpt-9"}, 404, "model", "model_not_found"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages", None),
    ("/v1/chat/completions", {"messages": [{"content": "no role"}]}, 400, "messages", None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "top_logprobs": 2}, 400,
     "top_logprobs", None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a" * 600}]}, 400, "messages",
     "context_length_exceeded"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "max_completion_tokens": -1}, 400,
     "max_completion_tokens", None),
])
def test_error_responses(server, path, body, status, param, code):
    assert_error(httpx.post(server.url + path, json=body), status, param, code)


def test_malformed_json_and_unknown_fields(server):
    headers = {"content-type": "application/json"}
    assert_error(httpx.post(server.url + "/v1/completions", content=b"{not json", headers=headers), 400)
    infinite = httpx.post(server.url + "/v1/completions", content=b'{"prompt": "a", "temperature": Infinity}',
                          headers=headers)
    assert_error(infinite, 400, "temperature")
    ok = httpx.post(server.url + "/v1/completions", json={"prompt": "a", "max_tokens": 2, "frobnicate": 1,
                                                           "extra": {"x": [1]}})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
    assert_error(httpx.get(server.url + "/v1/nothing-here"), 404)


def test_auth(auth_server):
    url = auth_server.url
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sk-test"}):
        error = assert_error(httpx.post(url + "/v1/completions", json={"prompt": "a"}, headers=headers), 401,
                             code="invalid_api_key")
        assert error["type"] == "authentication_error"
        assert_error(httpx.get(url + "/v1/models", headers=headers), 401, code="invalid_api_key")
    assert httpx.get(url + "/health").status_code == 200
    assert httpx.get(url + "/metrics").status_code == 200
    client = openai.OpenAI(base_url=url + "/v1", api_key="sk-test", max_retries=0)
    assert [m.id for m in client.models.list().data] == ["tiny-auth"]   # from the YAML file
    result = client.completions.create(model="tiny-auth", prompt="hi", max_tokens=4)
    assert result.usage.completion_tokens == 4
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="nope", max_retries=0).models.list()
    assert 'method="ngram"' in httpx.get(url + "/metrics").text


# ---- in-process servers: failures and disconnects the engine is made to show -----------------------

@pytest.fixture
def make_server(tiny_pair):
    """An app around an engine the test holds, served by uvicorn in a thread."""
    import torch

    from engine.config import EngineConfig
    from engine.engine import Engine
    from server.api import create_app
    from server.metrics import Metrics
    from engine.tokenizer import load_tokenizer
    torch.set_num_threads(1)
    target, draft = tiny_pair

    def make(tokenizer=None, api_key=None):
        engine = Engine(EngineConfig(model=str(target), dtype="float32", device="cpu", num_kv_blocks=64,
                                     max_num_seqs=8, speculative=spec_config(draft)))
        app = create_app(engine, tokenizer or load_tokenizer(str(target)), MODEL, api_key,
                         Metrics(MODEL, engine.method))
        return engine, InProcessServer(app)
    return make


def slow_down(monkeypatch, engine, seconds: float = 0.02) -> None:
    step = engine.step

    def slow_step():
        time.sleep(seconds)
        return step()
    monkeypatch.setattr(engine, "step", slow_step)


def test_disconnects_abort_and_free_blocks(make_server, monkeypatch):
    engine, server = make_server()
    slow_down(monkeypatch, engine)   # 480 tokens now take seconds: the client surely leaves first
    body = {"model": MODEL, "prompt": "long one", "max_tokens": 480, "ignore_eos": True}
    with server:
        with httpx.Client(timeout=30) as http, http.stream("POST", server.url + "/v1/completions",
                                                           json={**body, "stream": True}) as r:
            assert next(line for line in r.iter_lines() if line.startswith("data: "))
        wait_until_idle(server.url, timeout=2)
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(server.url + "/v1/completions", json=body, timeout=0.5)
        wait_until_idle(server.url, timeout=2)
        assert finished_count(server.url, "abort") == 2
        assert engine.pool.num_free_blocks == engine.pool.num_blocks and not engine.has_unfinished_requests()


def test_engine_failure_of_one_request_is_a_500(make_server, monkeypatch):
    engine, server = make_server()
    poison = 7
    propose = engine.spec.router.propose

    def failing_propose(scheduled, plan):
        if any(s.request.token_ids[0] == poison and s.request.num_output_tokens >= 2 for s in scheduled):
            raise RuntimeError("injected failure")
        return propose(scheduled, plan)
    monkeypatch.setattr(engine.spec.router, "propose", failing_propose)
    body = {"model": MODEL, "prompt": [poison, 65, 66], "max_tokens": 40, "ignore_eos": True, "temperature": 0}
    with server:
        error = assert_error(httpx.post(server.url + "/v1/completions", json=body), 500, code="engine_error")
        assert error["type"] == "server_error" and "see the server log" in error["message"]
        assert "injected failure" not in error["message"]   # the engine's text stays in the log
        with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}) as r:
            assert r.status_code == 200
            events = sse_events(r)
        assert events[0]["choices"][0]["text"] and set(events[-2]["error"]) == ERROR_KEYS and events[-1] == "[DONE]"
        ok = httpx.post(server.url + "/v1/completions", json={**body, "prompt": [8, 65, 66]})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 40
        assert httpx.get(server.url + "/health").status_code == 200


def test_dead_engine_loop_is_503(make_server, monkeypatch):
    engine, server = make_server()

    def broken_step():
        raise RuntimeError("engine loop bug")
    monkeypatch.setattr(engine, "step", broken_step)
    with server:
        assert_error(httpx.post(server.url + "/v1/completions", json={"prompt": "a"}), 503, code="engine_dead")
        assert_error(httpx.get(server.url + "/health"), 503, code="engine_dead")
        error = assert_error(httpx.post(server.url + "/v1/chat/completions",
                                        json={"messages": [{"role": "user", "content": "a"}]}), 503,
                             code="engine_dead")
        assert "engine loop bug" in error["message"]


def test_chat_without_template_is_a_clear_400(make_server, tiny_pair):
    from engine.tokenizer import load_tokenizer
    tokenizer = load_tokenizer(str(tiny_pair[0]))
    tokenizer.chat_template = None
    _, server = make_server(tokenizer=tokenizer)
    with server:
        error = assert_error(httpx.post(server.url + "/v1/chat/completions",
                                        json={"messages": [{"role": "user", "content": "a"}]}), 400, "messages")
        assert "chat template" in error["message"]
        assert httpx.post(server.url + "/v1/completions", json={"prompt": "a", "max_tokens": 2}).status_code == 200


# ---- a scripted model: stop strings inside multi-byte characters, EOS inside accepted runs ---------

SCRIPT = "x€yé😀z"   # 12 byte tokens (the tiny tokenizer has one per byte), then EOS


@pytest.fixture(scope="module")
def scripted_server(tmp_path_factory):
    """The scripted model drafting for itself (gamma 4, every draft accepted), served in-process."""
    import torch

    from engine.config import EngineConfig
    from engine.engine import Engine
    from helpers import make_scripted_checkpoint
    from server.api import create_app
    from server.metrics import Metrics
    from engine.tokenizer import load_tokenizer
    torch.set_num_threads(1)
    path = str(make_scripted_checkpoint(tmp_path_factory.mktemp("scripted") / "model", SCRIPT))
    engine = Engine(EngineConfig(model=path, dtype="float32", device="cpu", num_kv_blocks=64, max_num_seqs=8,
                                 speculative={"method": "draft", "draft": {"model": path}, "num_speculative_tokens": 4,
                                              "adaptive": False}))
    with InProcessServer(create_app(engine, load_tokenizer(path), MODEL, None, Metrics(MODEL, engine.method))) as s:
        yield s


@pytest.mark.parametrize("stop, text, num_tokens", [
    (None, SCRIPT, 13),              # EOS is draft 2 of the third run: the output ends there
    (["€"], "x", 4),                 # 3 bytes, the last one inside the first verified run
    (["é😀"], "x€y", 11),            # 6 bytes over two runs
    (["yé", "😁"], "x€", 7),         # 😁 shares three bytes with 😀: held back, then released
    (["é😁", "€z"], SCRIPT, 13),     # near misses: everything comes out
])
def test_stop_strings_split_inside_multibyte_characters(scripted_server, stop, text, num_tokens):
    body = {"model": MODEL, "prompt": "Q: ", "max_tokens": 30, "temperature": 0, "stop": stop}
    full = httpx.post(scripted_server.url + "/v1/completions", json=body).json()
    assert full["choices"][0]["text"] == text and full["choices"][0]["finish_reason"] == "stop"
    assert full["usage"]["completion_tokens"] == num_tokens   # up to the end of the stop string
    spec = assert_accounting(full)
    if num_tokens not in (1, 6, 11, 13):   # the stop string ends inside a pass's run: the rest is discarded
        assert spec["discarded"] > 0       # (at a run's end, the engine may or may not run one more pass)
    with httpx.stream("POST", scripted_server.url + "/v1/completions", json={**body, "stream": True}) as r:
        events = sse_events(r)
    pieces = [e["choices"][0]["text"] for e in events[:-1]]
    assert "".join(pieces) == text and not any("\ufffd" in p for p in pieces)
    assert events[-2]["choices"][0]["finish_reason"] == "stop" and events[-1] == "[DONE]"
    wait_until_idle(scripted_server.url)


def test_eos_inside_an_accepted_run_over_http(scripted_server):
    """13 tokens: the prefill's, then runs of 5, 5 and 2 (EOS is the third pass's own token; the draft
    stops after drafting EOS, so that pass verified 2 drafts, not 4)."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "go"}], "max_tokens": 30, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", scripted_server.url + "/v1/chat/completions", json=body) as r:
        events = sse_events(r)
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-1] if e["choices"]) == SCRIPT
    assert events[-2]["usage"]["completion_tokens"] == 13
    assert events[-2]["speculative"] == {"proposed": 10, "accepted": 9, "target_forwards": 3, "discarded": 0,
                                         "methods": {"draft": 3}, "k": {"2": 1, "4": 2}}
