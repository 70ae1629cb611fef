"""Tensor parallelism (engine/models/parallel.py): a TP=2 gloo group on CPU computes the logits
TP=1 does, for prefill and decode passes of a ragged flat batch."""
from __future__ import annotations


import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from engine.models import load_model
from engine.models.parallel import TensorParallel
from conftest import free_port
from helpers import make_tiny_checkpoint
from test_models import BLOCK_TABLES, new_kv_caches, random_tokens, run_pass

CPU = torch.device("cpu")
TOL = 1e-4
CASES = {
    "llama": dict(arch="llama"),
    # a vocabulary that does not split evenly, tied embeddings, every bias
    "llama_tied_odd_vocab": dict(arch="llama", vocab_size=271, tie_word_embeddings=True, attention_bias=True,
                                 mlp_bias=True),
    "qwen3_one_kv_head": dict(arch="qwen3", num_kv_heads=1, head_dim=32, attention_bias=True),  # replicated
    "mistral_window": dict(arch="mistral", sliding_window=8),
    # Gemma: soft-capping, (1 + w) norms, local and global layers; Gemma 3's q/k norms over a replicated KV head
    "gemma2": dict(arch="gemma2", num_layers=3, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                   sliding_window=4, query_pre_attn_scalar=24, attn_logit_softcapping=1.5, final_logit_softcapping=4.0),
    "gemma3_one_kv_head": dict(arch="gemma3", num_kv_heads=1, layer_types=["sliding_attention", "full_attention"],
                               sliding_window=4, query_pre_attn_scalar=16),
    # mixtures of experts (8 experts, top-2): each expert's intermediate split; Qwen3-MoE's layer 1 dense
    "qwen3_moe": dict(arch="qwen3_moe", num_layers=3, mlp_only_layers=[1], norm_topk_prob=True, initializer_range=0.1),
    "mixtral": dict(arch="mixtral", initializer_range=0.1),
}


def spawn_group(fn, world_size: int, *args) -> None:
    """Run fn(rank, world_size, port, *args) in world_size spawned processes joined in one gloo group."""
    mp.spawn(_member, args=(fn, world_size, free_port(), args), nprocs=world_size, join=True)


def _member(rank, fn, world_size, port, args):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()


def passes(model) -> list[torch.Tensor]:
    """Logits of a ragged prefill of two sequences, then four decode passes of both."""
    kv = new_kv_caches(model)
    a, b = random_tokens(11, seed=1), random_tokens(6, seed=2)
    out = run_pass(model, kv, [(a[:7], 0, BLOCK_TABLES[0]), (b[:2], 0, BLOCK_TABLES[1])])
    for step in range(4):
        out += run_pass(model, kv, [(a[7 + step:8 + step], 7 + step, BLOCK_TABLES[0]),
                                    (b[2 + step:3 + step], 2 + step, BLOCK_TABLES[1])])
    return out


def _sharded_passes(rank, world_size, paths, out_dir):
    tp = TensorParallel(rank, world_size)
    for name, path in paths.items():
        logits = passes(load_model(path, torch.float32, CPU, tensor_parallel=tp))
        if rank == 0:
            torch.save(logits, f"{out_dir}/{name}.pt")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return {name: str(make_tiny_checkpoint(tmp_path_factory.mktemp(name), seed=3, **case))
            for name, case in CASES.items()}


@pytest.fixture(scope="module")
def tp2_logits(checkpoints, tmp_path_factory):
    """Every case's logits at TP=2, from one spawned group."""
    out_dir = tmp_path_factory.mktemp("tp2")
    spawn_group(_sharded_passes, 2, checkpoints, str(out_dir))
    return {name: torch.load(out_dir / f"{name}.pt") for name in CASES}


@pytest.mark.parametrize("case", list(CASES))
def test_tp2_logits_equal_tp1(case, checkpoints, tp2_logits):
    expected = passes(load_model(checkpoints[case], torch.float32, CPU))
    got = tp2_logits[case]
    assert [g.shape for g in got] == [e.shape for e in expected]
    err = max((g - e).abs().max().item() for g, e in zip(got, expected))
    assert err < TOL, f"max abs logit error {err:.3g}"


def test_shard_shapes(checkpoints):
    """Rank 1 of 2 holds half the query heads and intermediate, the one KV head replicated, half the
    (padded) vocabulary: no process group is needed to load."""
    model = load_model(checkpoints["qwen3_one_kv_head"], torch.float32, CPU, tensor_parallel=TensorParallel(1, 2))
    attention = model.model.layers[0].self_attn
    assert (attention.num_heads, attention.num_kv_heads, model.num_kv_heads) == (2, 1, 1)
    assert model.model.layers[0].mlp.intermediate == 64
    assert model.lm_head.weight.shape == (136, 64) and model.vocab_size == 272
    full = load_model(checkpoints["qwen3_one_kv_head"], torch.float32, CPU)
    assert torch.equal(attention.qkv_proj.weight[64:96], full.model.layers[0].self_attn.qkv_proj.weight[128:160])
    assert torch.equal(model.lm_head.weight, full.lm_head.weight[136:])


def test_unshardable_configs_are_refused(tmp_path):
    path = make_tiny_checkpoint(tmp_path / "m", num_heads=4, num_kv_heads=2)
    with pytest.raises(ValueError, match="divide"):
        load_model(str(path), torch.float32, CPU, tensor_parallel=TensorParallel(0, 3))
    phi = make_tiny_checkpoint(tmp_path / "phi", arch="phi3")
    with pytest.raises(ValueError, match="tensor parallelism supports"):
        load_model(str(phi), torch.float32, CPU, tensor_parallel=TensorParallel(0, 2))
    # an MoE checkpoint whose experts are fused 3-D tensors: a rank would read slices of every expert at once
    from test_models import copy_checkpoint
    from test_moe import fuse_experts
    moe = make_tiny_checkpoint(tmp_path / "moe", arch="qwen3_moe", num_layers=2)
    fused = copy_checkpoint(moe, tmp_path / "fused", lambda t: fuse_experts(t, 2, "mlp"))
    with pytest.raises(ValueError, match="per-expert"):
        load_model(str(fused), torch.float32, CPU, tensor_parallel=TensorParallel(0, 2))


# ---- the engine over a TP=2 group: rank 0 runs the Engine, its worker is a subprocess ------------

PROMPTS = [[72, 101, 108, 108, 111], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5], [7]]
ENGINE = dict(dtype="float32", num_kv_blocks=64, max_num_seqs=4, quantization="none")


def greedy(model: str, **options) -> list[list[int]]:
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams

    llm = LLM(model, skip_tokenizer_init=True, **ENGINE, **options)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    return [out.token_ids[len(prompt):] for out, prompt in zip(llm.generate(PROMPTS, params), PROMPTS)]


def _greedy_in_process(model, options, out_file):
    torch.set_num_threads(1)
    torch.save(greedy(model, **options), out_file)


def greedy_spawned(model: str, out_file, **options) -> list[list[int]]:
    """greedy() in a fresh spawned process (rank 0 of its own group, which exits with it)."""
    process = mp.get_context("spawn").Process(target=_greedy_in_process, args=(model, options, str(out_file)))
    process.start()
    process.join(120)
    assert process.exitcode == 0, f"the engine process exited with {process.exitcode}"
    return torch.load(out_file)


@pytest.fixture(scope="module")
def engine_target(checkpoints):
    return checkpoints["qwen3_one_kv_head"]


@pytest.fixture(scope="module")
def plain_greedy(engine_target):
    return greedy(engine_target)


def test_engine_greedy_tp2_equals_tp1(engine_target, plain_greedy, tmp_path):
    assert greedy_spawned(engine_target, tmp_path / "out.pt", tensor_parallel_size=2) == plain_greedy


@pytest.mark.slow
@pytest.mark.parametrize("case", ["llama", "mistral_window", "gemma3_one_kv_head", "qwen3_moe"])
def test_engine_greedy_tp2_equals_tp1_on_other_families(case, checkpoints, tmp_path):
    """The same on Llama (KV heads split), Mistral and Gemma 3 (windows shorter than the longest prompt) and
    Qwen3-MoE (experts split)."""
    assert greedy_spawned(checkpoints[case], tmp_path / "out.pt", tensor_parallel_size=2) == greedy(checkpoints[case])


@pytest.mark.slow
def test_engine_speculative_tp2_equals_plain_greedy(engine_target, checkpoints, plain_greedy, tmp_path):
    """A draft model (unsharded, on rank 0) and n-gram drafts; verification passes on the sharded target."""
    from helpers import make_noisy_copy

    draft = make_noisy_copy(engine_target, tmp_path / "draft", noise=0.3)
    spec = dict(method="auto", model=str(draft), proposers=["draft", "ngram"], num_speculative_tokens=3,
                adaptive=False)
    assert greedy_spawned(engine_target, tmp_path / "out.pt", tensor_parallel_size=2, speculative=spec) == plain_greedy


def test_tensor_parallel_size_is_validated(engine_target):
    from engine.config import EngineConfig

    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="tensor_parallel_size"):
            EngineConfig(model=engine_target, tensor_parallel_size=bad)
    with pytest.raises(ValueError, match="quantization"):
        EngineConfig(model=engine_target, tensor_parallel_size=2, quantization="int8")


# ---- `specserve serve --tensor-parallel-size 2`: the server launches its worker ----------------

def tp_server(model: str, tmp_path, *flags: str):
    """A started `specserve serve --tensor-parallel-size 2` process on a tiny checkpoint (not yet ready)."""
    from conftest import ServerProcess

    return ServerProcess(["--model", model, "--served-model-name", "tiny", "--dtype", "float32", "--device", "cpu",
                          "--num-kv-blocks", "64", "--quantization", "none", "--tensor-parallel-size", "2", *flags],
                         log_path=tmp_path / "server.log").start()


def test_server_tp2_completion_equals_tp1(engine_target, tmp_path):
    import httpx
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams

    # n-gram drafts verified on the sharded target: the text of plain decoding at TP = 1
    server = tp_server(engine_target, tmp_path, "--speculative-config",
                       '{"method": "ngram", "num_speculative_tokens": 3, "adaptive": false}')
    try:
        params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
        prompts = ["Hello", "abcabcabcabc"]
        offline = LLM(engine_target, **ENGINE).generate(prompts, params)
        server.wait_ready()
        for prompt, expected in zip(prompts, offline):
            reply = httpx.post(server.url + "/v1/completions", timeout=60, json={
                "model": "tiny", "prompt": prompt, "max_tokens": 24, "temperature": 0.0, "ignore_eos": True})
            assert reply.status_code == 200, reply.text
            assert reply.json()["choices"][0]["text"] == expected.text
    finally:
        server.stop()
    assert "tensor_parallel=2" in server.log()


def _descendants_running(root: int, marker: str) -> list[int]:
    """Pids of root's descendant processes whose command line contains marker (from /proc)."""
    import os

    parents, commands = {}, {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                parents[int(entry)] = int(open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()[1])
                commands[int(entry)] = open(f"/proc/{entry}/cmdline", "rb").read().replace(b"\0", b" ").decode()
            except OSError:
                continue

    def under(pid):
        while pid > 1:
            pid = parents.get(pid, 0)
            if pid == root:
                return True
        return False
    return [pid for pid, command in commands.items() if marker in command and under(pid)]


def _worker(server) -> int:
    (worker,) = _descendants_running(server.process.pid, "engine.tensor_parallel")
    return worker


def _signal_mid_stream(server, worker: int, signum) -> float:
    """Send the server's worker `signum` while a stream runs: the stream ends with an engine_dead error
    event, /health is no longer 200 and the server exits 1. Returns the seconds from the signal to the
    stream's end."""
    import os
    import time

    import httpx
    from conftest import sse_events

    body = {"model": "tiny", "prompt": [8, 9], "max_tokens": 480, "ignore_eos": True, "stream": True,
            "temperature": 0.0}
    with httpx.Client(timeout=60) as http, http.stream("POST", server.url + "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))   # streaming
        os.kill(worker, signum)
        signalled = time.monotonic()
        rest = sse_events(lines)
        answered = time.monotonic() - signalled
    assert rest[-1] == "[DONE]" and rest[-2]["error"]["code"] == "engine_dead", rest[-3:]
    try:
        assert httpx.get(server.url + "/health", timeout=5).status_code == 503
    except httpx.TransportError:
        pass   # already gone
    assert server.process.wait(60) == 1
    return answered


@pytest.mark.slow
def test_a_dead_worker_kills_the_server(engine_target, tmp_path):
    """A worker killed during a stream: the stream ends with an engine_dead error event, /health is
    no longer 200, the server exits 1."""
    import signal

    server = tp_server(engine_target, tmp_path)
    try:
        server.wait_ready()
        _signal_mid_stream(server, _worker(server), signal.SIGKILL)
    finally:
        server.stop()
    assert "the tensor-parallel group failed" in server.log() or "tensor-parallel worker(s) exited" in server.log()


def test_the_kv_budget_buys_blocks_by_a_ranks_own_kv_heads(checkpoints):
    """Each rank caches only its KV heads: at TP = 2 a block of a 2-KV-head model costs half as many
    bytes per device (and a replicated single KV head as many as at TP = 1)."""
    from engine.model_runner import ModelRunner
    from engine.models import load_hf_config
    from engine.setup import shard_config

    def block_bytes(name, size):
        return ModelRunner.kv_bytes_per_block(shard_config(load_hf_config(checkpoints[name]), size), 16, torch.float32)

    assert block_bytes("llama", 2) * 2 == block_bytes("llama", 1)
    assert block_bytes("qwen3_one_kv_head", 2) == block_bytes("qwen3_one_kv_head", 1)


@pytest.mark.slow
def test_a_worker_dying_while_the_server_is_idle_turns_health_503(engine_target, tmp_path):
    """No request in flight: the engine core's idle check (every IDLE_CHECK_S) notices the dead worker,
    /health answers 503 and the server exits 1 without waiting for a request."""
    import os
    import signal
    import time

    import httpx

    server = tp_server(engine_target, tmp_path)
    try:
        server.wait_ready()
        worker = _worker(server)
        os.kill(worker, signal.SIGKILL)
        deadline, status = time.monotonic() + 30, 200
        while status == 200 and time.monotonic() < deadline:
            try:
                status = httpx.get(server.url + "/health", timeout=5).status_code
            except httpx.TransportError:
                status = None   # already gone
            time.sleep(0.2)
        assert status != 200
        assert server.process.wait(60) == 1
    finally:
        server.stop()
    assert "tensor-parallel worker(s) exited" in server.log()


# ---- a stopped or hung worker: the collectives' timeout ---------------------------------------------

def _rank_zero_meets_a_stuck_worker(rank, port, out_file):
    import os
    import time

    import numpy as np

    from engine.tensor_parallel import FORWARD, WorkerGroupError, join_group

    torch.set_num_threads(1)
    tp, channel = join_group(rank, 2, f"tcp://127.0.0.1:{port}", CPU, timeout=1.0)
    if rank == 1:
        channel.receive()   # takes one pass, then takes part in nothing more (as if stopped)
        time.sleep(8)
        os._exit(0)
    channel.send(FORWARD, np.arange(5))
    outcomes = []
    next_pass = lambda: channel.send(FORWARD, np.arange(5))   # noqa: E731
    all_reduce = lambda: dist.all_reduce(torch.ones(3), group=tp.group)   # noqa: E731
    for attempt in (next_pass, all_reduce):
        started = time.monotonic()
        try:
            attempt()
            outcomes.append(("returned", time.monotonic() - started, ""))
        except (WorkerGroupError, RuntimeError) as exc:
            outcomes.append((type(exc).__name__, time.monotonic() - started, str(exc)))
    torch.save(outcomes, out_file)
    os._exit(0)


def test_a_stuck_worker_fails_rank_zeros_collectives_within_the_timeout(tmp_path):
    """With tensor_parallel_timeout 1 s, rank 0's next message to a worker that stopped taking part
    is a WorkerGroupError after about a second, and so is a pass's all-reduce: neither waits for ever."""
    out_file = tmp_path / "outcomes.pt"
    mp.spawn(_rank_zero_meets_a_stuck_worker, args=(free_port(), str(out_file)), nprocs=2, join=True)
    (send, send_s, message), (reduce, reduce_s, _) = torch.load(out_file)
    assert send == "WorkerGroupError" and "gone or stuck" in message and 0.9 <= send_s < 5, (send, send_s, message)
    assert reduce == "RuntimeError" and 0.9 <= reduce_s < 5, (reduce, reduce_s)


@pytest.mark.slow
def test_a_stopped_worker_answers_the_waiting_client_within_the_timeout(engine_target, tmp_path):
    """A worker stopped (SIGSTOP) during a stream: after tensor_parallel_timeout the engine is dead, the
    stream ends with an engine_dead error event, /health is no longer 200 and the server exits 1."""
    import os
    import signal

    server = tp_server(engine_target, tmp_path, "--tensor-parallel-timeout", "3")
    worker = None
    try:
        server.wait_ready()
        worker = _worker(server)
        answered = _signal_mid_stream(server, worker, signal.SIGSTOP)
        assert answered < 3 + 10, answered
    finally:
        if worker is not None:
            try:
                os.kill(worker, signal.SIGKILL)
            except ProcessLookupError:
                pass
        server.stop()
    assert "gone or stuck" in server.log() or "a tensor-parallel pass failed" in server.log()
