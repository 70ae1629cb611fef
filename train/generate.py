"""specserve generate: the target's own answers to a prompt set, as chat JSONL for `specserve distill`.

    specserve generate --target MODEL --out runs/x/responses.jsonl [--prompts my_prompts.jsonl]
                       [--count 3000] [--max-tokens 320] [--greedy-fraction 0.5]

Prompts come from a JSONL file (one {"messages": [...]} per line, the last message a user turn), or
from the built-in broad set (train/prompts.py) when --prompts is not given. With the built-in set a
second round follows: some conversations get a follow-up user turn, and the longest answers become
documents to summarize or answer questions about. Each output line holds the conversation with
the target's answer appended, and the exact token ids (`prompt_token_ids`, `response_token_ids`)
the engine used, so distillation trains on the target's own tokenization.

Generation runs through specserve's own engine (batched, paged KV cache). Lines are appended as
batches finish; rerunning the same command skips the ids already in the file, so an interrupted
run resumes where it stopped.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

from train import prompts as builtin
from train.common import TrainError, numbered_jsonl, read_jsonl


def user_prompts(path) -> list[dict]:
    """Prompts from a JSONL file: each line's messages, ending in a user turn."""
    rows = []
    for number, row in numbered_jsonl(path):
        messages = row.get("messages") if isinstance(row, dict) else None
        if not isinstance(messages, list) or not messages or messages[-1].get("role") != "user":
            raise SystemExit(f"specserve generate: error: {path}: line {number} needs \"messages\" ending "
                             "in a user turn")
        rows.append({"id": str(row.get("id", f"prompt-{number}")), "category": row.get("category", "custom"),
                     "messages": messages})
    return rows


class Generator:
    """Answers conversations with the target through the engine, appending finished ones to a file."""

    def __init__(self, target: str, out: Path, max_tokens: int, greedy_fraction: float, seed: int,
                 max_num_seqs: int):
        from engine import LLM

        self.llm = LLM(target, max_num_seqs=max_num_seqs, max_num_batched_tokens=4096)
        self.tokenizer = self.llm.tokenizer
        self.out = out
        self.max_tokens = max_tokens
        self.greedy_fraction = greedy_fraction
        self.rng = random.Random(seed)
        self.done = {row["id"]: row for row in read_jsonl(out)} if out.exists() else {}

    def answer(self, rows: list[dict], chunk: int = 256) -> None:
        todo = [row for row in rows if row["id"] not in self.done]
        start = time.time()
        tokens = 0
        for i in range(0, len(todo), chunk):
            batch = todo[i: i + chunk]
            prompt_ids = [self._render(row["messages"]) for row in batch]
            params = [self._params(row["id"]) for row in batch]
            outputs = self.llm.generate(prompt_ids, params)
            with open(self.out, "a") as f:
                for row, ids, output, param in zip(batch, prompt_ids, outputs, params):
                    answer = self.tokenizer.decode(output.token_ids, skip_special_tokens=True)
                    record = {**row, "messages": row["messages"] + [{"role": "assistant", "content": answer}],
                              "prompt_token_ids": ids, "response_token_ids": output.token_ids,
                              "finish_reason": output.finish_reason, "temperature": param.temperature}
                    f.write(json.dumps(record) + "\n")
                    self.done[row["id"]] = record
                    tokens += len(output.token_ids)
            rate = tokens / max(time.time() - start, 1e-9)
            print(f"generate: {len(self.done)} answered ({i + len(batch)}/{len(todo)} this round), "
                  f"{rate:.0f} tokens/s", file=sys.stderr, flush=True)

    def _render(self, messages: list[dict]) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _params(self, row_id: str):
        from engine import SamplingParams

        # Per-id randomness, so a resumed run makes the same choices as an uninterrupted one.
        rng = random.Random(f"{row_id}")
        if rng.random() < self.greedy_fraction:
            return SamplingParams(max_tokens=self.max_tokens, temperature=0.0)
        return SamplingParams(max_tokens=self.max_tokens, temperature=0.7, top_p=0.95, seed=rng.randrange(2**31))


def builtin_rounds(generator: Generator, count: int, seed: int) -> None:
    """Round one: the built-in prompts. Round two: follow-ups, and documents made of round-one answers."""
    first = builtin.chat_prompts(count, seed)
    generator.answer(first)
    rng = random.Random(seed + 1)
    answered = [generator.done[row["id"]] for row in first]
    second = []
    for row in rng.sample(answered, len(answered) // 6):
        second.append({"id": f"followup-{row['id']}", "category": row["category"],
                       "messages": builtin.follow_up(row["messages"], rng)})
    long_answers = [row for row in answered if len(row["response_token_ids"]) >= 150]
    for row in rng.sample(long_answers, min(len(long_answers), count // 5)):
        second.append({"id": f"document-{row['id']}", "category": "document",
                       "messages": builtin.document_prompt(row["messages"][-1]["content"], rng)})
    generator.answer(second)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specserve generate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True, help="target model (checkpoint directory or GGUF file)")
    p.add_argument("--out", required=True, help="output JSONL (appended to; existing ids are skipped)")
    p.add_argument("--prompts", default=None, help="JSONL of {\"messages\": [...]} (default: the built-in set)")
    p.add_argument("--count", type=int, default=3000, help="built-in prompts in round one")
    p.add_argument("--max-tokens", type=int, default=320)
    p.add_argument("--greedy-fraction", type=float, default=0.5,
                   help="share of prompts answered greedily; the rest at temperature 0.7, top-p 0.95")
    p.add_argument("--max-num-seqs", type=int, default=96, help="answers generated at once")
    p.add_argument("--seed", type=int, default=0)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        prompts = user_prompts(args.prompts) if args.prompts else None
        generator = Generator(args.target, out, args.max_tokens, args.greedy_fraction, args.seed, args.max_num_seqs)
    except TrainError as exc:
        raise SystemExit(f"specserve generate: error: {exc}") from None
    if prompts is not None:
        generator.answer(prompts)
    else:
        builtin_rounds(generator, args.count, args.seed)
    print(f"wrote {len(generator.done)} conversations to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
