"""Engine core: exact greedy parity with transformers under batching, chunked prefill,
preemption and prefix reuse; seeded sampling independent of the batch; bad input."""
import json
import random

import pytest
import torch
from helpers import make_tiny_checkpoint, run_requests

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.engine import ContextLengthError, Engine

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def target_path(tmp_path_factory):
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("target"), arch="llama", seed=0))


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(0)
    shared = [rng.randrange(256) for _ in range(37)]
    out = [shared + [rng.randrange(256) for _ in range(n)] for n in (1, 5, 20)]   # a shared 37-token prefix
    out += [[rng.randrange(256) for _ in range(n)] for n in (1, 3, 9, 50, 70)]
    return out


@pytest.fixture(scope="module")
def hf_greedy(target_path, prompts):
    """transformers' generate(do_sample=False) on each prompt alone."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target_path, dtype=torch.float32)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    results = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS)
            results.append(out[0, len(p):].tolist())
    return results


def run_engine(engine: Engine, prompts, params) -> tuple[list[list[int]], list]:
    """Drive the engine directly; returns tokens per prompt and every step's scheduler output."""
    schedules = []
    schedule = engine.scheduler.schedule

    def recording_schedule(plans=None):
        out = schedule(plans)
        schedules.append([(s.request.request_id, s.num_new_tokens, s.samples) for s in out.scheduled]
                         + [("preempted", len(out.preempted), None)])
        return out

    engine.scheduler.schedule = recording_schedule
    return run_requests(engine, prompts, params)[0], schedules


GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


def test_greedy_batch_equals_transformers(target_path, prompts, hf_greedy):
    engine = Engine(EngineConfig(model=target_path, dtype="float32"))
    tokens, _ = run_engine(engine, prompts, GREEDY)
    assert tokens == hf_greedy


def test_greedy_under_kv_pressure_with_chunked_prefill_and_preemption(target_path, prompts, hf_greedy):
    # 14 blocks of 4 tokens = 56 slots: the 82-token prompts cannot all be resident at once.
    engine = Engine(EngineConfig(model=target_path, dtype="float32", block_size=4, num_kv_blocks=30,
                                 max_num_batched_tokens=16, max_num_seqs=8))
    tokens, schedules = run_engine(engine, prompts, GREEDY)
    assert tokens == hf_greedy
    chunks = [n for step in schedules for (rid, n, samples) in step if rid != "preempted" and samples is False]
    preemptions = sum(n for step in schedules for (rid, n, _) in step if rid == "preempted")
    assert chunks, "expected chunked prefill"
    assert preemptions > 0, "expected preemption"


def test_prefix_blocks_are_reused(target_path, prompts, hf_greedy):
    engine = Engine(EngineConfig(model=target_path, dtype="float32", block_size=4))
    first, _ = run_engine(engine, prompts[:1], GREEDY)
    # The second request shares 37 prompt tokens: 9 full blocks come from the cache.
    second, schedules = run_engine(engine, prompts[1:2], GREEDY)
    assert first[0] == hf_greedy[0] and second[0] == hf_greedy[1]
    assert schedules[0][0][1] == len(prompts[1]) - 36


def test_the_next_turn_of_a_conversation_computes_only_its_new_tokens(target_path, prompts):
    """A finished request publishes its last full blocks: turn 2 (turn 1's prompt and answer plus
    3 new tokens) prefills only what turn 1 did not compute, and answers as without the cache."""
    params = SamplingParams(max_tokens=11, temperature=0.0, ignore_eos=True)
    engine = Engine(EngineConfig(model=target_path, dtype="float32", block_size=4))
    (answer,), _ = run_engine(engine, prompts[:1], params)   # 38 + 11 tokens, 48 of them computed
    second = prompts[0] + answer + [5, 6, 7]
    (reply,), schedules = run_engine(engine, [second], params)
    assert schedules[0][0][1] == len(second) - 48   # 12 full blocks from the cache, the last one included
    cold = Engine(EngineConfig(model=target_path, dtype="float32", block_size=4, enable_prefix_caching=False))
    assert run_engine(cold, [second], params)[0][0] == reply


def test_seeded_sampling_is_independent_of_the_batch(target_path, prompts):
    params = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.95, top_k=50, seed=1234, ignore_eos=True)
    engine = Engine(EngineConfig(model=target_path, dtype="float32"))
    alone, _ = run_engine(engine, [prompts[4]], params)
    others = [SamplingParams(max_tokens=10, temperature=1.0, seed=s, ignore_eos=True) for s in range(5)]
    batch = prompts[:3] + [prompts[4]] + prompts[5:7]
    mixed, _ = run_engine(engine, batch, others[:3] + [params] + others[3:5])
    assert mixed[3] == alone[0]
    again, _ = run_engine(engine, [prompts[4]], params)
    assert again == alone


def test_offline_llm_api(target_path, prompts, hf_greedy):
    llm = LLM(target_path, dtype="float32")
    outs = llm.generate(prompts[:3], GREEDY)
    assert [o.token_ids for o in outs] == hf_greedy[:3]
    assert all(o.finish_reason == "length" and o.prompt_token_ids == p for o, p in zip(outs, prompts))
    text = llm.generate("hello world", SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))[0]
    assert text.prompt_token_ids == llm.tokenizer.encode("hello world") and len(text.token_ids) == 4
    assert text.text == llm.tokenizer.decode(text.token_ids, skip_special_tokens=True)


def test_stop_token_and_logprobs(target_path, prompts, hf_greedy):
    llm = LLM(target_path, dtype="float32")
    stop_at = hf_greedy[0][4]
    first = hf_greedy[0].index(stop_at)
    out = llm.generate([prompts[0]], SamplingParams(max_tokens=MAX_TOKENS, temperature=0, stop_token_ids=[stop_at],
                                                    logprobs=2, prompt_logprobs=1))[0]
    assert out.token_ids == hf_greedy[0][:first + 1] and out.finish_reason == "stop"
    assert [lp.token_id for lp in out.logprobs] == out.token_ids
    assert all(len(lp.top) == 2 and lp.top[0][0] == lp.token_id for lp in out.logprobs)   # greedy: chosen is top-1
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompts[0])
    assert [lp.token_id for lp in out.prompt_logprobs[1:]] == prompts[0][1:]


def test_bad_input_is_rejected_and_engine_keeps_working(target_path, prompts, hf_greedy, tmp_path):
    engine = Engine(EngineConfig(model=target_path, dtype="float32"))
    with pytest.raises(ValueError, match="prompt is empty"):
        engine.add_request("a", [], GREEDY)
    with pytest.raises(ValueError, match="token id 99999 is outside the vocabulary"):
        engine.add_request("b", [1, 99999], GREEDY)
    with pytest.raises(ValueError, match="max_tokens must be >= 1"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ContextLengthError, match="maximum context length is 512"):
        engine.add_request("c", [1] * 510, GREEDY)
    assert not engine.has_unfinished_requests()
    tokens, _ = run_engine(engine, prompts[:2], GREEDY)
    assert tokens == hf_greedy[:2]


def test_bad_checkpoints_fail_clearly(target_path, tmp_path):
    from safetensors.torch import load_file, save_file

    broken = make_tiny_checkpoint(tmp_path / "broken", arch="llama", seed=0)
    weights = load_file(broken / "model.safetensors")
    name = "model.layers.1.mlp.down_proj.weight"
    del weights[name]
    save_file(weights, broken / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        Engine(EngineConfig(model=str(broken)))

    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        Engine(EngineConfig(model=str(gpt2)))
    with pytest.raises(ValueError, match="not a checkpoint directory"):
        Engine(EngineConfig(model=str(tmp_path / "nowhere")))
