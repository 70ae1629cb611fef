"""specserve generate: the target's own answers to a prompt set, as chat JSONL for `specserve distill`.

    specserve generate --target MODEL --out runs/x/responses.jsonl [--prompts my_prompts.jsonl | self]
                       [--count 3000] [--max-tokens 320] [--greedy-fraction 0.5]

Prompts come from a JSONL file (one {"messages": [...]} per line, the last message a user turn), or
from the built-in broad set (train/prompts.py) when --prompts is not given. With the built-in set a
second round follows: some conversations get a follow-up user turn, and the longest answers become
documents to summarize or answer questions about.

`--prompts self` has the target write the user turns too (self-instruct as Magpie does it): the
chat template is rendered up to where a user's text would start, and the target, sampling at
temperature 1, writes a request there and ends the turn itself; turns it does not end within
USER_TURN_MAX_TOKENS, shorter than three words or already written are dropped. --count such
conversations are answered, then a quarter of them get a follow-up turn written the same way after
the answer. The requests cover whatever the target thinks users ask, far beyond a template set, so
drafts trained on the answers meet fewer unfamiliar prompts. The written turns are kept in
<out>.prompts.jsonl, so a resumed run writes none twice. Each output line holds the conversation with
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


SELF = "self"
USER_TURN_MAX_TOKENS = 160
USER_SLOT = "\x00user-turn\x00"


def user_turn_prefix(tokenizer, context: list[dict]) -> list[int]:
    """The chat template rendered after `context` up to where the next user message's text starts."""
    text = tokenizer.apply_chat_template(context + [{"role": "user", "content": USER_SLOT}], tokenize=False)
    if USER_SLOT not in text:
        raise TrainError("the target's chat template does not show the user's text as given, so the target "
                         "cannot write user turns (--prompts self)")
    return tokenizer.encode(text[:text.index(USER_SLOT)], add_special_tokens=False)


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
        self.turns_file = out.with_name(out.stem + ".prompts.jsonl")
        self.turns = {row["id"]: row["messages"] for row in read_jsonl(self.turns_file)} \
            if self.turns_file.exists() else {}   # id -> the conversation ending in a written user turn, or None

    def write_user_turns(self, wanted: list[tuple[str, list[dict]]], chunk: int = 256) -> list[dict]:
        """For each (id, context): the target writes the next user turn (module docstring). Returns
        the prompt rows of the turns kept, in order."""
        todo = [(row_id, context) for row_id, context in wanted if row_id not in self.turns]
        seen = {messages[-1]["content"] for messages in self.turns.values() if messages}
        for i in range(0, len(todo), chunk):
            batch = todo[i: i + chunk]
            written = self._sample_user_turns([user_turn_prefix(self.tokenizer, context) for _, context in batch],
                                              [row_id for row_id, _ in batch])
            with open(self.turns_file, "a") as f:
                for (row_id, context), (text, ended) in zip(batch, written):
                    text = text.strip()
                    keep = ended and len(text.split()) >= 3 and text not in seen
                    seen.add(text)
                    self.turns[row_id] = context + [{"role": "user", "content": text}] if keep else None
                    f.write(json.dumps({"id": row_id, "messages": self.turns[row_id]}) + "\n")
            kept = sum(self.turns[row_id] is not None for row_id, _ in todo[: i + len(batch)])
            print(f"generate: {kept} of {i + len(batch)} user turns written kept", file=sys.stderr, flush=True)
        return [{"id": row_id, "category": "self-instruct", "messages": self.turns[row_id]}
                for row_id, _ in wanted if self.turns[row_id] is not None]

    def _sample_user_turns(self, prefixes: list[list[int]], row_ids: list[str]) -> list[tuple[str, bool]]:
        """(text, whether the target ended the turn itself) for each prefix; seeded per id."""
        from engine import SamplingParams

        params = [SamplingParams(max_tokens=USER_TURN_MAX_TOKENS, temperature=1.0, top_p=0.95,
                                 seed=random.Random(f"user-{row_id}").randrange(2**31)) for row_id in row_ids]
        outputs = self.llm.generate(prefixes, params)
        return [(self.tokenizer.decode(o.token_ids, skip_special_tokens=True), o.finish_reason == "stop")
                for o in outputs]

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


def self_instruct_rounds(generator: Generator, count: int, seed: int) -> None:
    """Round one: `count` conversations whose user turn the target wrote. Round two: a follow-up turn,
    written the same way, for a quarter of them."""
    first = generator.write_user_turns([(f"self-{seed}-{i}", []) for i in range(count)])
    generator.answer(first)
    rng = random.Random(seed + 1)
    answered = [generator.done[row["id"]] for row in first]
    follow = rng.sample(answered, len(answered) // 4)
    second = generator.write_user_turns([(f"followup-{row['id']}", row["messages"]) for row in follow])
    generator.answer(second)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specserve generate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True, help="target model (checkpoint directory or GGUF file)")
    p.add_argument("--out", required=True, help="output JSONL (appended to; existing ids are skipped)")
    p.add_argument("--prompts", default=None,
                   help="JSONL of {\"messages\": [...]}, or 'self': the target writes the user turns "
                        "(default: the built-in set)")
    p.add_argument("--count", type=int, default=3000, help="built-in or self-written prompts in round one")
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
        prompts = user_prompts(args.prompts) if args.prompts not in (None, SELF) else None
        generator = Generator(args.target, out, args.max_tokens, args.greedy_fraction, args.seed, args.max_num_seqs)
        if prompts is not None:
            generator.answer(prompts)
        elif args.prompts == SELF:
            self_instruct_rounds(generator, args.count, args.seed)
        else:
            builtin_rounds(generator, args.count, args.seed)
    except TrainError as exc:
        raise SystemExit(f"specserve generate: error: {exc}") from None
    print(f"wrote {len(generator.done)} conversations to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
