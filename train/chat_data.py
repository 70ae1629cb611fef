"""Chat JSONL for distillation: conversations rendered with the target's chat template, loss on the
answer only.

Each line is {"messages": [...]} ending in an assistant turn (the format `specserve generate`
writes, and the usual fine-tuning format). Lines that carry `prompt_token_ids` and
`response_token_ids` (written by `specserve generate`) are used as they are, so the draft learns
on exactly the tokens the target produced; other lines are rendered with the chat template. Only
the positions that predict the last assistant turn (its end-of-turn token included) are trained
and evaluated: the prompt is context, not something the draft will ever be asked to guess.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from train.common import TrainError, numbered_jsonl

IGNORE = -100   # label of a position that is not trained (prompt, padding)


@dataclass(frozen=True)
class ChatExample:
    token_ids: np.ndarray   # [n] int64: prompt followed by the answer
    answer_start: int       # index of the answer's first token


def render(tokenizer, messages: list[dict]) -> ChatExample:
    """Prompt (all turns but the last, plus the generation prompt) and answer, as one token sequence."""
    if not messages or messages[-1].get("role") != "assistant":
        raise TrainError("each conversation must end with an assistant message")
    prompt_text = tokenizer.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True)
    full_text = tokenizer.apply_chat_template(messages, tokenize=False)
    prompt = tokenizer.encode(prompt_text, add_special_tokens=False)
    full = tokenizer.encode(full_text, add_special_tokens=False)
    if full[:len(prompt)] != prompt:   # a template whose prefix re-tokenizes differently
        eos = tokenizer.eos_token_id
        full = prompt + tokenizer.encode(messages[-1]["content"], add_special_tokens=False) + ([eos] if eos is not None else [])
    while len(full) > len(prompt) + 1 and tokenizer.decode(full[-1:]).isspace():
        full = full[:-1]   # the template's trailing newline after the end-of-turn token is not generated
    return ChatExample(np.asarray(full, dtype=np.int64), len(prompt))


def load_chat_jsonl(path, tokenizer) -> list[ChatExample]:
    path = Path(path)
    if not path.is_file():
        raise TrainError(f"chat data not found: {path}")
    examples = []
    for number, row in numbered_jsonl(path):
        if "prompt_token_ids" in row and "response_token_ids" in row:
            prompt, answer = row["prompt_token_ids"], row["response_token_ids"]
            if answer:
                examples.append(ChatExample(np.asarray(prompt + answer, dtype=np.int64), len(prompt)))
            continue
        if not isinstance(row.get("messages"), list):
            raise TrainError(f"{path}:{number}: needs \"messages\" (a list of chat turns)")
        try:
            examples.append(render(tokenizer, row["messages"]))
        except TrainError as exc:
            raise TrainError(f"{path}:{number}: {exc}") from None
    if not examples:
        raise TrainError(f"{path} holds no conversations")
    return examples


def split_examples(examples: list[ChatExample], every: int) -> tuple[list[ChatExample], list[ChatExample]]:
    """Every `every`-th conversation is held out (at least one, when there are two or more)."""
    held = examples[::every] if len(examples) > 1 else []
    train = [e for i, e in enumerate(examples) if i % every] if held else examples
    return train, held


def collate(examples: list[ChatExample], seq_len: int, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """inputs [B, L] and labels [B, L] (IGNORE outside answers), right-padded; a sequence longer than
    seq_len + 1 keeps its last seq_len + 1 tokens, so the answer survives and the prompt is cut."""
    rows = []
    for example in examples:
        ids = example.token_ids
        labels = ids.copy()
        labels[:example.answer_start] = IGNORE
        ids, labels = ids[-(seq_len + 1):], labels[-(seq_len + 1):]
        rows.append((ids[:-1], labels[1:]))
    length = max(len(ids) for ids, _ in rows)
    inputs = torch.full((len(rows), length), pad_id, dtype=torch.long)
    targets = torch.full((len(rows), length), IGNORE, dtype=torch.long)
    for i, (ids, labels) in enumerate(rows):
        inputs[i, :len(ids)] = torch.from_numpy(ids)
        targets[i, :len(labels)] = torch.from_numpy(labels)
    return inputs, targets


def sample_examples(examples: list[ChatExample], step: int, seed: int, batch_size: int) -> list[ChatExample]:
    """A deterministic batch for this step (same on a resumed run)."""
    rng = np.random.default_rng([seed, step])
    return [examples[i] for i in rng.integers(0, len(examples), batch_size)]
