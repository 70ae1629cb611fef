"""Serving benchmark: our server against `transformers serve --continuous-batching` (and llama.cpp's
server when installed) on the same checkpoint, and against our own offline engine.

Every server gets the same streamed chat requests: the Spec-Bench development questions (first
turns, the categories taken in turn), greedy, max_tokens 128 (with ignore_eos for ours;
transformers serve rejects the field and stops at EOS, so tokens/s counts the tokens each server
returned, from its usage, and the table shows tokens per request). --stop-at-eos drops ignore_eos,
so that every server does the same work where the peers stop at EOS (and no speculation is timed
on the easy text past an answer's end). At each concurrency every server runs in turn, the order
alternating between levels; with --rounds N every server runs N times per level, the order
rotating, and the rounds are pooled. Printed in one run, per server and concurrency: output
tokens/s, TTFT and ITL (median and p99), and ratios to the peer and to the offline engine
(LLM.generate over the same prompts with max_num_seqs = concurrency, run in turn with the
servers). ITL is per token: the gap between two streamed chunks divided by the tokens the later
one carries (a speculative chunk carries several).

    python bench/serve_bench.py [--config configs/default.yaml] [--concurrency 1,4,16,32] [--requests 0]
        [--variants ours] [--peers transformers,llamacpp] [--spec]

--variants chooses our server configurations, by name: `ours` (plain decoding, the engine core in its
own process with the default threads), `thread` (the engine loop on a thread of the API process),
`process-1` / `thread-1` (one engine thread), `spec` (the config's own speculation), `graphs` / `spec-graphs` (GPU: with `cuda_graphs`), `fp32` / `int8`
(plain decoding with `quantization: none` / `int8`; `ours` has the config's, auto by default; `fp32` then
serves bf16 where the CPU computes it natively),
`spec-int8`, `torch-ops` (plain decoding with the fused CPU ops off: SPECSERVE_CPU_KERNELS=0), and
`spec:<p>+<p>...` (auto over only those proposers: `--config configs/default-eagle.yaml --variants
spec:draft+ngram+suffix,spec:eagle+ngram+suffix` compares the draft and the head in one run).
--spec adds `spec`. `transformers serve` (transformers 5.x) loads the model through accelerate: `pip
install accelerate` beside this venv's packages (`--target DIR`, then DIR on PYTHONPATH) if it says
so. llama.cpp runs when `llama-cpp-python[server]` is importable and --gguf names the same weights
as a GGUF file; otherwise it is skipped with that note. To keep this venv's own packages, install
it beside them:
    pip wheel --no-deps --no-binary :all: llama-cpp-python      # builds from the sdist (5-20 minutes)
    pip install --target /tmp/llamacpp --no-deps llama_cpp_python-*.whl sse-starlette starlette-context \
        pydantic-settings diskcache python-dotenv
    PYTHONPATH=/tmp/llamacpp python bench/serve_bench.py --peers llamacpp --gguf model-bf16.gguf ...
and write the GGUF with the sdist's vendor/llama.cpp/convert_hf_to_gguf.py --outtype bf16 (on
PYTHONPATH: its gguf-py/ and conversion/, and sentencepiece).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from conversations import QUESTIONS, ROOT, chat_ids  # noqa: E402
PLAIN = json.dumps({"method": "none"})
VARIANTS = {   # name -> (extra flags of `specserve serve`, extra environment)
    "ours": (["--speculative-config", PLAIN], {}),
    "thread": (["--speculative-config", PLAIN, "--engine-core", "thread"], {}),
    "process-1": (["--speculative-config", PLAIN, "--engine-threads", "1"], {}),
    "thread-1": (["--speculative-config", PLAIN, "--engine-core", "thread", "--engine-threads", "1"], {}),
    "active": (["--speculative-config", PLAIN], {"OMP_WAIT_POLICY": "ACTIVE"}),
    "passive": (["--speculative-config", PLAIN], {"OMP_WAIT_POLICY": "PASSIVE"}),
    "spec": ([], {}),
    "graphs": (["--speculative-config", PLAIN, "--cuda-graphs", "true"], {}),   # GPU: decode passes as CUDA graphs
    "spec-graphs": (["--cuda-graphs", "true"], {}),
    # quantization none: the model's own weights, in the dtype auto then picks (bf16 where native, else fp32)
    "fp32": (["--speculative-config", PLAIN, "--quantization", "none"], {}),
    "int8": (["--speculative-config", PLAIN, "--quantization", "int8"], {}),
    "torch-ops": (["--speculative-config", PLAIN], {"SPECSERVE_CPU_KERNELS": "0"}),   # no fused CPU ops
    "spec-int8": (["--quantization", "int8"], {}),
}


@dataclass
class Result:
    tokens: int = 0
    seconds: float = 0.0
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    def merge(self, other: "Result") -> "Result":
        return Result(self.tokens + other.tokens, self.seconds + other.seconds, self.ttft + other.ttft,
                      self.itl + other.itl)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


WARM_UP = "Say hello."


def questions() -> list[str]:
    """The first turns, one category after another in turn (each category in file order), so that
    the first N prompts span Spec-Bench's categories instead of the file's first one or two: its
    first 8 are all writing and roleplay, where the copying proposers find least."""
    by_category: dict[str, list[str]] = {}
    with open(QUESTIONS) as f:
        for line in filter(str.strip, f):
            question = json.loads(line)
            by_category.setdefault(question["category"], []).append(question["turns"][0])
    queues = list(by_category.values())
    return [q[i] for i in range(max(map(len, queues))) for q in queues if i < len(q)]


# ---- servers -------------------------------------------------------------------------------------

class Launched:
    def __init__(self, name: str, command: list[str], port: int, model: str, env: dict | None = None,
                 extra_body: dict | None = None):
        self.name, self.port, self.model = name, port, model
        self.extra_body = extra_body or {}   # request fields only this server takes
        self.url = f"http://127.0.0.1:{port}"
        self.log = tempfile.NamedTemporaryFile(prefix=f"serve_bench_{name}_", suffix=".log", delete=False)
        self.process = subprocess.Popen(command, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT,
                                        env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})},
                                        stdin=subprocess.DEVNULL, start_new_session=True)   # our signals stay ours

    def wait(self, path: str, timeout: float = 600) -> "Launched":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited: see {self.log.name}")
            try:
                if httpx.get(self.url + path, timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} not ready after {timeout} s: see {self.log.name}")

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(20)
        except subprocess.TimeoutExpired:
            self.process.kill()


def variant(name: str) -> tuple[list[str], dict]:
    """A variant's extra `specserve serve` flags and environment: one of VARIANTS, or `spec:<p>+<p>...`,
    the config's speculation as auto over only those proposers (the config must name what they load)."""
    if name.startswith("spec:"):
        return ["--speculative-config", json.dumps({"method": "auto", "proposers": name[5:].split("+")})], {}
    return VARIANTS[name]


def launch_ours(name: str, config: str, port: int, ignore_eos: bool = True) -> Launched:
    flags, env = variant(name)
    command = [sys.executable, "-m", "server.cli", "serve", "--config", config, "--port", str(port),
               "--served-model-name", "bench", "--log-level", "warning", *flags]
    return Launched(name, command, port, "bench", env=env, extra_body={"ignore_eos": ignore_eos}).wait("/health")


def launch_transformers(model_dir: str, port: int, dtype: str) -> Launched:
    exe = Path(sys.executable).parent / "transformers"
    command = [str(exe), "serve", "--continuous-batching", "--device", "cpu", "--dtype", dtype, "--port", str(port),
               "--host", "127.0.0.1", model_dir]
    return Launched("transformers", command, port, model_dir).wait("/health")


def launch_llamacpp(gguf: str | None, port: int) -> Launched | None:
    try:
        import llama_cpp.server  # noqa: F401
    except ImportError:
        print("llama.cpp: skipped (pip install 'llama-cpp-python[server]' to compare with it)")
        return None
    if not gguf:
        print("llama.cpp: skipped (give --gguf: the same weights as a bf16 GGUF file)")
        return None
    command = [sys.executable, "-m", "llama_cpp.server", "--model", gguf, "--port", str(port), "--host",
               "127.0.0.1", "--n_ctx", "4096", "--n_threads", str(os.cpu_count())]
    return Launched("llama.cpp", command, port, gguf).wait("/v1/models")


# ---- the client ----------------------------------------------------------------------------------

async def sse_chunks(response: httpx.Response):
    """The JSON chunks of a streamed OpenAI response: its "data: " lines up to [DONE]."""
    async for line in response.aiter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line[6:])


async def one_request(http: httpx.AsyncClient, server: Launched, question: str, max_tokens: int, result: Result):
    body = {"model": server.model, "messages": [{"role": "user", "content": question}], "max_tokens": max_tokens,
            "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}, **server.extra_body}
    start = time.perf_counter()
    last = None
    chunks = 0
    tokens = 0
    async with http.stream("POST", server.url + "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for chunk in sse_chunks(response):
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if not any(c.get("delta", {}).get("content") for c in chunk.get("choices", [])):
                continue
            now = time.perf_counter()
            if last is None:
                result.ttft.append(now - start)
            else:
                result.itl.append(now - last)
            last, chunks = now, chunks + 1
    # Spread each gap over the tokens its chunk carried (speculative chunks carry several).
    if tokens > chunks > 1:
        gaps = result.itl[-(chunks - 1):]
        del result.itl[-(chunks - 1):]
        per = (tokens - 1) / (chunks - 1)
        result.itl += [g / per for g in gaps for _ in range(round(per))]
    result.tokens += tokens or chunks


async def drive(server: Launched, prompts: list[str], concurrency: int, max_tokens: int) -> Result:
    result = Result()
    queue = list(prompts)

    async def worker(http):
        while queue:
            await one_request(http, server, queue.pop(0), max_tokens, result)
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600), limits=limits) as http:
        start = time.perf_counter()
        await asyncio.gather(*(worker(http) for _ in range(concurrency)))
        result.seconds = time.perf_counter() - start
    return result


class Offline:
    """Our offline engine (LLM.generate, plain decoding, max_num_seqs = the level's concurrency) on
    the same prompts, run in turn with the servers: this VM's speed drifts 15-20% within minutes,
    so an engine timed after every server had stopped (as it used to be) gave ratios that moved
    from 0.78x to 1.01x between runs of one level."""

    def __init__(self, config_path: str, ignore_eos: bool):
        self.config_path, self.ignore_eos = config_path, ignore_eos
        self.llm, self.concurrency = None, 0

    def run(self, prompts: list[str], concurrency: int, max_tokens: int) -> Result:
        from engine import SamplingParams
        llm = self._engine(concurrency)
        ids = [chat_ids(llm.tokenizer, [{"role": "user", "content": q}]) for q in prompts]
        start = time.perf_counter()
        outputs = llm.generate(ids, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=self.ignore_eos))
        return Result(sum(len(o.token_ids) for o in outputs), time.perf_counter() - start)

    def _engine(self, concurrency: int):
        """One engine per level (the last one dropped first), warmed up on a prompt outside the set."""
        if self.concurrency != concurrency:
            import dataclasses

            from engine import LLM, SamplingParams
            from server.config import load_config
            self.llm = None
            config = load_config(self.config_path, environ={}).engine
            config = dataclasses.replace(config, speculative=dataclasses.replace(config.speculative, method="none"))
            self.llm = LLM(config.model, **{f.name: getattr(config, f.name) for f in dataclasses.fields(config)
                                            if f.name not in ("model", "max_num_seqs")}, max_num_seqs=concurrency)
            self.llm.generate([chat_ids(self.llm.tokenizer, [{"role": "user", "content": WARM_UP}])],
                              SamplingParams(max_tokens=8, temperature=0.0))
            self.concurrency = concurrency
        return self.llm


def level_prompts(questions: list[str], concurrency: int, requests: int, start: int = 0) -> list[str]:
    """The prompts of one concurrency level and round: `requests` of them, or max(8, 2 x concurrency),
    from question `start` on. Every level and round takes the next ones: a prompt a server answered
    before is served from its prefix cache, and suffix drafting replays its earlier answer (levels
    used to start over at the first question, so a second level re-asked the first one's)."""
    count = requests or max(8, 2 * concurrency)
    return [questions[(start + i) % len(questions)] for i in range(count)]


# ---- the report ----------------------------------------------------------------------------------

def _ratio(value: float, width: int) -> str:
    return f"{value:{width - 1}.2f}x" if value == value else f"{'-':>{width}}"


def table(results: dict[int, dict[str, Result]], offline_tps: dict[int, float], peer: str | None) -> list[str]:
    lines = [f"{'conc':>4} {'server':>12} {'tok/s':>7} {'tok/req':>7} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} {'ITL p99':>8}"
             f" {'/ ' + (peer or 'peer'):>15} {'/ offline':>9}"]
    for c, by_server in results.items():
        for name, r in by_server.items():
            vs_peer = r.tok_s / by_server[peer].tok_s if peer in by_server and name != peer else float("nan")
            vs_off = r.tok_s / offline_tps[c] if c in offline_tps and name != peer else float("nan")
            lines.append(f"{c:4d} {name:>12} {r.tok_s:7.1f} {r.tokens / max(1, len(r.ttft)):7.1f} {1e3 * statistics.median(r.ttft):7.0f}ms "
                         f"{1e3 * percentile(r.ttft, 0.99):7.0f}ms {1e3 * statistics.median(r.itl):6.1f}ms "
                         f"{1e3 * percentile(r.itl, 0.99):6.1f}ms {_ratio(vs_peer, 15)} {_ratio(vs_off, 10)}")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(ROOT / "configs" / "default.yaml"))
    p.add_argument("--concurrency", default="1,4,16,32")
    p.add_argument("--requests", type=int, default=0, help="requests per level (default: max(8, 2 x concurrency))")
    p.add_argument("--rounds", type=int, default=1,
                   help="drive every server this many times per level, the order rotating each round, and pool the "
                        "rounds: short turns see the same machine (runs of ~30 s in turn moved by 15%% on a shared VM)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--stop-at-eos", action="store_true", help="ours stop at EOS as the peers do (default: ignore_eos)")
    p.add_argument("--variants", default="ours", help=f"our server configurations: {', '.join(VARIANTS)}")
    p.add_argument("--spec", action="store_true", help="also our server with the config's own speculation")
    p.add_argument("--peers", default="transformers,llamacpp")
    p.add_argument("--gguf", default=None, help="the same weights as a GGUF file, for llama.cpp")
    p.add_argument("--no-offline", action="store_true")
    p.add_argument("--port", type=int, default=8790)
    args = p.parse_args(argv)
    levels = [int(c) for c in args.concurrency.split(",")]
    variants = args.variants.split(",") + (["spec"] if args.spec and "spec" not in args.variants else [])
    unknown = [v for v in variants if v not in VARIANTS and not v.startswith("spec:")]
    if unknown:
        p.error(f"--variants: unknown {', '.join(unknown)}; choose among {', '.join(VARIANTS)} or spec:<p>+<p>...")
    from server.config import load_config
    model_dir = load_config(args.config, environ={}).engine.model
    all_questions = questions()

    servers = {}
    try:
        for i, name in enumerate(variants):
            servers[name] = launch_ours(name, args.config, args.port + i, ignore_eos=not args.stop_at_eos)
        peers = args.peers.split(",") if args.peers else []
        if "transformers" in peers:   # in its fastest dtype here: bf16 where the CPU computes it natively
            from engine.setup import cpu_native_dtype
            dtype = str(cpu_native_dtype()).replace("torch.", "")
            servers["transformers"] = launch_transformers(model_dir, args.port + 20, dtype)
        if "llamacpp" in peers:
            launched = launch_llamacpp(args.gguf, args.port + 21)
            if launched:
                servers["llama.cpp"] = launched
        for server in servers.values():   # warm-up: one short request each, on a prompt outside the set
            asyncio.run(drive(server, [WARM_UP], 1, 8))
        results: dict[int, dict[str, Result]] = {}
        offline_tps: dict[int, float] = {}
        offline = None if args.no_offline else Offline(args.config, ignore_eos=not args.stop_at_eos)
        runners = list(servers) + ([] if offline is None else ["offline"])
        start = 0
        for level_index, c in enumerate(levels):
            order = runners if level_index % 2 == 0 else runners[::-1]
            pooled = {name: Result() for name in runners}
            for _ in range(args.rounds):   # each round its own prompts: no server answers one twice
                prompts = level_prompts(all_questions, c, args.requests, start)
                start += len(prompts)
                if start > len(all_questions):
                    print(f"note: past the {len(all_questions)} questions, prompts repeat", file=sys.stderr)
                for name in order:
                    result = (offline.run(prompts, c, args.max_tokens) if name == "offline" else
                              asyncio.run(drive(servers[name], prompts, c, args.max_tokens)))
                    pooled[name] = pooled[name].merge(result)
                order = order[1:] + order[:1]
            if offline is not None:
                offline_tps[c] = pooled.pop("offline").tok_s
            results[c] = pooled
            print(f"concurrency {c}: " + ", ".join(f"{k} {v.tok_s:.1f} tok/s" for k, v in results[c].items())
                  + (f", offline engine (plain) {offline_tps[c]:.1f} tok/s" if c in offline_tps else ""), flush=True)
    finally:
        for server in servers.values():
            server.stop()

    peer = "transformers" if "transformers" in servers else ("llama.cpp" if "llama.cpp" in servers else None)
    print(f"\nstreamed chat completions, {args.max_tokens} tokens, greedy; ratios: tokens/s over {peer or 'no peer'}"
          " and over the offline engine (plain decoding) at the same concurrency")
    print("\n".join(table(results, offline_tps, peer)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
