"""specserve distill --head eagle: train an EAGLE-style self-drafting head for a target.

    python -m train.eagle --target TARGET (--data chat.jsonl | --generate-from prompts.jsonl|builtin) \\
        --out runs/eagle-head [--unroll 4] [--steps 500 | --time-budget-min 60] [--resume]
    (or: specserve distill --head eagle ...the same flags)

The head (train/eagle_head.py; served by engine/models/eagle.py) is one Llama decoder layer over the
target's own final-norm hidden states: from (h_p, x_{p+1}) it predicts x_{p+2}, and its output
stands in for h_{p+1}, so it drafts a chain. It starts from fc = [I, 0] and a copy of the target's
last layer and final norm.

Training runs the chain as inference does (training-time test, as in EAGLE-3): for every anchor t
of a conversation, step 1 takes the true feature h_t, steps j = 2..unroll take the head's own
output of step j - 1 (with the true tokens x_{t+j}), and each step attends to the true-feature
positions 0..t plus its own anchor's earlier steps. The loss is forward KL(target || head) against
the target's distribution at position t + j, on the answer tokens (train/chat_data.py), a weighted
mean over steps with weight 0.8^(j-1) (each step's KL averaged over its own positions). The target
runs once per training conversation: its features are cached (bf16, in memory), later epochs read
them, and the teacher logits are lm_head of the cached features.

Held-out metrics (before and after, on ChatData's held-out conversations), teacher-forced, per
step j: the chain acceptance P(the head's argmax equals the target's at steps 1..j), over the
anchors whose whole chain lies in the answer; the step's own argmax agreement and its mean KL; and
the expected tokens per target forward at gamma = unroll, 1 + sum_j P(steps 1..j all match).
Written to <out>/eagle_stats.json; the head goes to <out>/config.json + <out>/model.safetensors.
"""
from __future__ import annotations

import argparse
import json
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

from train.chat_data import IGNORE, collate, sample_examples
from train.common import (
    HELD_OUT_EVERY, TrainError, Throughput, adamw, add_run_options, autocast, count_params, load_checkpoint_state,
    progress_bar, resolve_precision, save_checkpoint, scheduled_lr, set_seed, set_threads, train_device,
)
from train.distill import ChatData, generate_answers, pad_token_id
from train.draft_models import SAVE_DTYPES, load_target
from train.eagle_head import (
    HEAD_TENSORS, EagleHeadTrainer, head_config, head_logits_teacher_forced, target_features,
)

__all__ = ["EagleConfig", "train_eagle", "main", "EagleHeadTrainer", "head_logits_teacher_forced", "head_config",
           "HEAD_TENSORS", "target_features"]

STEP_DECAY = 0.8   # weight of chain step j in the loss: STEP_DECAY ** (j - 1)
LOSS_CHUNK = 128  # rows of [rows, vocab] logits at a time (small: the elementwise passes stay in cache)


@dataclass
class EagleConfig:
    target: str
    out: str
    data: str | None = None  # chat JSONL (loss on the last assistant turn), or:
    generate_from: str | None = None  # prompts JSONL, or "builtin": the target answers them first
    generate_count: int = 3000
    generate_max_tokens: int = 320
    unroll: int = 4
    steps: int = 500
    batch_size: int = 8
    seq_len: int = 384
    lr: float = 5e-4
    min_lr_ratio: float = 0.1
    warmup: int = 20
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    eval_windows: int = 32  # held-out conversations to evaluate on
    held_out_every: int = HELD_OUT_EVERY
    precision: str = "auto"
    device: str = "auto"
    save_dtype: str = "bfloat16"
    seed: int = 0
    threads: int | None = None
    ckpt_every: int = 100
    resume: bool = False
    time_budget_min: float = 0.0  # > 0: cosine LR over elapsed training time, stop when spent
    stop_at: int | None = None  # stop after this step as if interrupted
    progress: bool = True
    draft_vocab: int = 0  # > 0: draft only this many most frequent answer tokens (EAGLE-3's reduced vocabulary)
    init_head: str | None = None  # an exported head to start from instead of the target's last layer
    feature_layers: list[int] | None = None  # EAGLE-3's fused features: these decoder layers' outputs (e.g. low,
                                             # middle, high) instead of the final hidden state


# ----------------------------------------------------------------------------- features


class FeatureCache:
    """The target's features of each conversation (as collate cuts it, keyed by its tokens), computed
    the first time the conversation is seen, kept on the CPU in `dtype`."""

    def __init__(self, target, seq_len: int, pad_id: int, device, bf16: bool, dtype=torch.bfloat16,
                 feature_layers=()):
        self.target, self.seq_len, self.pad_id = target, seq_len, pad_id
        self.device, self.bf16, self.dtype = device, bf16, dtype
        self.feature_layers = list(feature_layers)
        self.width = target.config.hidden_size * (len(self.feature_layers) + 1 if self.feature_layers else 1)
        self.rows: dict[bytes, torch.Tensor] = {}

    @torch.no_grad()
    def batch(self, examples) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """inputs [B, T], labels [B, T] (collate's) and features [B, T, W] (target_features', fp32, zero
        on padding)."""
        inputs, labels = collate(examples, self.seq_len, self.pad_id)
        lengths = [min(len(e.token_ids), self.seq_len + 1) - 1 for e in examples]
        keys = [inputs[i, :n].numpy().tobytes() for i, n in enumerate(lengths)]
        todo = list({key: i for i, key in enumerate(keys) if key not in self.rows}.values())
        if todo:
            width = max(lengths[i] for i in todo)
            with autocast(self.device, self.bf16):
                h = target_features(self.target, inputs[todo, :width].to(self.device), self.feature_layers)
            for row, i in zip(h, todo):
                self.rows[keys[i]] = row[:lengths[i]].to("cpu", self.dtype)
        features = torch.zeros(*inputs.shape, self.width)
        for i, key in enumerate(keys):
            features[i, :lengths[i]] = self.rows[key].float()
        return inputs, labels, features


# ----------------------------------------------------------------------------- loss


def step_masks(labels: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """mask_j [B, T]: anchor t is trained at chain step j when position t + j is (its label, the
    token step j predicts, is an answer token): the teacher is the target at t + j."""
    masks = []
    for j in range(1, steps + 1):
        mask = torch.zeros_like(labels, dtype=torch.bool)
        mask[:, :-j] = labels[:, j:] != IGNORE
        masks.append(mask)
    return masks


class Teacher:
    """The target's distribution at the answer positions (labels != IGNORE), from the features; with
    a draft vocabulary, restricted to it and renormalized (what the head can match). With
    `argmax`, also the target's own choice over the whole vocabulary (what acceptance compares)."""

    def __init__(self, head: EagleHeadTrainer, features, labels, device, bf16: bool, argmax: bool = False):
        trained = labels != IGNORE
        with torch.no_grad(), autocast(device, bf16):
            logits = head.logits(head.final(features[trained]).to(device))
            if argmax:
                self.argmax = head.target_logits(features[trained].to(device)).argmax(-1)
        self.probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        self.entropy = torch.cat([-torch.special.xlogy(part, part).sum(-1) for part in self.probs.split(LOSS_CHUNK)])
        self.row = torch.full(labels.shape, -1, dtype=torch.long)
        self.row[trained] = torch.arange(int(trained.sum()))

    def rows(self, mask: torch.Tensor, j: int) -> torch.Tensor:
        """Teacher rows of the anchors in `mask` at chain step j (their position + j)."""
        return self.row[:, j:][mask[:, :-j]].to(self.probs.device)


class SoftCrossEntropy(torch.autograd.Function):
    """sum over rows of -sum_v p_v log softmax(hidden @ weight^T)_v, p = teacher_probs[rows] (rows
    summing to 1). The gradient w.r.t. hidden, (softmax - p) @ weight, is made in the same chunked
    pass: no [rows, vocab] tensor outlives its chunk, the LM head's matmul runs twice, not three
    times, and few elementwise passes go over a chunk (on a CPU they cost as much as the matmuls).
    The loss value (for logging; the gradient is exact) floors q at 1e-30 before its log."""

    @staticmethod
    def forward(ctx, hidden, weight, teacher_probs, rows, dtype):
        w = weight.to(dtype)
        grad = torch.empty(hidden.shape, dtype=torch.float32, device=hidden.device)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, len(rows), LOSS_CHUNK):
            end = start + LOSS_CHUNK
            q = torch.softmax(hidden[start:end].to(dtype) @ w.T, dim=-1, dtype=torch.float32)
            p = teacher_probs[rows[start:end]]
            grad[start:end] = ((q - p).to(dtype) @ w).float()
            total -= torch.dot(p.view(-1), q.clamp_(min=1e-30).log_().view(-1))
        ctx.save_for_backward(grad)
        ctx.hidden_dtype = hidden.dtype
        return total

    @staticmethod
    def backward(ctx, grad_output):
        (grad,) = ctx.saved_tensors
        return (grad_output * grad).to(ctx.hidden_dtype), None, None, None, None


def chain_loss(head: EagleHeadTrainer, features, inputs, labels, unroll: int, device, bf16: bool):
    """(weighted mean over chain steps of mean KL(target || head), [mean KL of each step])."""
    teacher = Teacher(head, features, labels, device, bf16)
    weight = head.lm_head_weight
    with autocast(device, bf16):
        outs = head.unrolled(features.to(device), inputs.to(device), unroll)
    total, weights, per_step = 0.0, 0.0, []
    for j, (out, mask) in enumerate(zip(outs, step_masks(labels, unroll)), 1):
        rows = teacher.rows(mask, j)
        if rows.numel() == 0:
            per_step.append(float("nan"))
            continue
        ce = SoftCrossEntropy.apply(out[mask.to(device)], weight, teacher.probs, rows,
                                    torch.bfloat16 if bf16 else torch.float32)
        kl = ce / len(rows) - teacher.entropy[rows].mean()
        per_step.append(kl.item())
        total = total + STEP_DECAY ** (j - 1) * kl
        weights += STEP_DECAY ** (j - 1)
    if not weights:
        raise TrainError("a batch has no answer tokens to train on")
    return total / weights, per_step


# ----------------------------------------------------------------------------- evaluation


@torch.no_grad()
def evaluate(head: EagleHeadTrainer, data: ChatData, cache: FeatureCache, unroll: int, device, bf16: bool) -> dict:
    """Teacher-forced held-out chain metrics (see the module docstring)."""
    was_training = head.training
    head.eval()
    match = torch.zeros(unroll)       # step j's argmax agreement, over step j's anchors
    chain = torch.zeros(unroll)       # steps 1..j all agree, over anchors whose whole chain is in the answer
    kl, count = torch.zeros(unroll), torch.zeros(unroll)
    chain_count = 0
    for start in range(0, len(data.held), 4):
        inputs, labels, features = cache.batch(data.held[start:start + 4])
        teacher = Teacher(head, features, labels, device, bf16, argmax=True)
        with autocast(device, bf16):
            outs = head.unrolled(features.to(device), inputs.to(device), unroll)
        masks = step_masks(labels, unroll)
        full = torch.stack(masks).all(0)     # anchors whose every chain step predicts an answer token
        all_so_far = torch.ones(int(full.sum()), dtype=torch.bool)
        chain_count += int(full.sum())
        for j, (out, mask) in enumerate(zip(outs, masks), 1):
            rows = teacher.rows(mask, j)
            with autocast(device, bf16):
                logp = torch.log_softmax(head.logits(out[mask.to(device)]).float(), dim=-1)
            t_probs = teacher.probs[rows]
            kl[j - 1] += (-(t_probs * logp).sum() - teacher.entropy[rows].sum()).item()
            agree = (head.token_ids(logp.argmax(-1)) == teacher.argmax[rows]).cpu()
            match[j - 1] += agree.sum().item()
            count[j - 1] += len(rows)
            all_so_far &= agree[full[mask]]      # the chain anchors among step j's anchors
            chain[j - 1] += all_so_far.sum().item()
    head.train(was_training)
    if count[0] == 0 or chain_count == 0:
        raise TrainError(f"the held-out conversations have no answers of more than {unroll} tokens to evaluate on")
    chain_acc = (chain / chain_count).tolist()
    return {
        "chain_acceptance": [round(a, 4) for a in chain_acc],
        "step_acceptance": [round(a, 4) for a in (match / count.clamp(min=1)).tolist()],
        "kl": [round(a, 4) for a in (kl / count.clamp(min=1)).tolist()],
        "expected_tokens_per_forward": round(1 + sum(chain_acc), 3),
        "gamma": unroll,
        "positions": int(count[0]),
        "chain_anchors": chain_count,
    }


def describe(tag: str, m: dict) -> str:
    fmt = lambda xs: " ".join(f"{x:.3f}" for x in xs)  # noqa: E731
    return (f"{tag}: chain acceptance by step [{fmt(m['chain_acceptance'])}], per-step argmax agreement "
            f"[{fmt(m['step_acceptance'])}], KL [{fmt(m['kl'])}], expected tokens per target forward at "
            f"gamma {m['gamma']} = {m['expected_tokens_per_forward']:.2f}")


# ----------------------------------------------------------------------------- training


def _check(cfg: EagleConfig) -> None:
    if bool(cfg.data) == bool(cfg.generate_from):
        raise TrainError("give exactly one of --data (chat JSONL) and --generate-from (prompts JSONL or 'builtin')")
    if cfg.data and not Path(cfg.data).is_file():
        raise TrainError(f"chat data not found: {cfg.data}")
    if cfg.generate_from and cfg.generate_from != "builtin" and not Path(cfg.generate_from).is_file():
        raise TrainError(f"prompts not found: {cfg.generate_from}")
    if cfg.unroll < 1:
        raise TrainError(f"--unroll must be at least 1, got {cfg.unroll}")
    if cfg.save_dtype not in SAVE_DTYPES:
        raise TrainError(f"unknown save dtype {cfg.save_dtype!r} ({', '.join(SAVE_DTYPES)})")


def choose_draft_vocab(examples, size: int, vocab_size: int) -> tuple[list[int], float]:
    """The `size` tokens the head may draft: the most frequent answer tokens, then prompt tokens,
    then the lowest ids (BPE's earliest merges: the most common strings). Returns them and the
    share of answer tokens they cover."""
    answers, prompts = Counter(), Counter()
    for example in examples:
        answers.update(example.token_ids[example.answer_start:].tolist())
        prompts.update(example.token_ids[:example.answer_start].tolist())
    chosen = dict.fromkeys(t for t, _ in answers.most_common(size))
    chosen.update(dict.fromkeys(t for t, _ in prompts.most_common(size)))
    chosen.update(dict.fromkeys(range(min(size, vocab_size))))
    vocab = sorted(list(chosen)[:size])
    kept = set(vocab)
    covered = sum(n for t, n in answers.items() if t in kept) / max(1, sum(answers.values()))
    return vocab, covered


def _set_draft_vocab(head: EagleHeadTrainer, cfg: EagleConfig, data: ChatData, log) -> None:
    """Give a head without a draft vocabulary the one --draft-vocab asks for (a resumed head keeps
    its own: its training so far was against it)."""
    if head.draft_vocab is not None:
        if cfg.draft_vocab and cfg.draft_vocab != len(head.draft_vocab):
            log(f"keeping the checkpoint's draft vocabulary of {len(head.draft_vocab)} tokens")
        return
    vocab_size = head.head_config["eagle"]["target_vocab_size"]
    if not cfg.draft_vocab or cfg.draft_vocab >= vocab_size:
        return
    vocab, covered = choose_draft_vocab(data.train, cfg.draft_vocab, vocab_size)
    head.set_draft_vocab(vocab)
    log(f"draft vocabulary: {len(vocab)} of {vocab_size} tokens, {100 * covered:.2f}% of the training answers' tokens")


def _train_step(head, optimizer, cache: FeatureCache, examples, cfg: EagleConfig, device, bf16: bool):
    inputs, labels, features = cache.batch(examples)
    loss, per_step = chain_loss(head, features, inputs, labels, cfg.unroll, device, bf16)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(head.parameters(), cfg.grad_clip)
    optimizer.step()
    return loss.item(), per_step, int((labels != IGNORE).sum())


def train_eagle(cfg: EagleConfig, log=print) -> dict:
    """Run (or resume) training; returns the stats also written to <out>/eagle_stats.json."""
    set_threads(cfg.threads)
    set_seed(cfg.seed)
    _check(cfg)
    out_dir, ckpt_dir = Path(cfg.out), Path(cfg.out) / "checkpoint"
    device = train_device(cfg.device)
    bf16 = resolve_precision(cfg.precision, device)
    target = load_target(cfg.target, device)
    pad = pad_token_id(target)
    data = ChatData(cfg, Path(cfg.data) if cfg.data else generate_answers(cfg, out_dir), pad)
    resuming = cfg.resume and (ckpt_dir / "state.json").exists()
    head = (EagleHeadTrainer.load(ckpt_dir, target) if resuming
            else EagleHeadTrainer.load(cfg.init_head, target) if cfg.init_head
            else EagleHeadTrainer.from_target(target, cfg.unroll, cfg.feature_layers))
    if cfg.feature_layers is not None and sorted(cfg.feature_layers) != head.feature_layers:
        raise TrainError(f"--feature-layers {' '.join(map(str, cfg.feature_layers))}: the head "
                         f"{'checkpoint' if resuming else cfg.init_head} takes "
                         f"{head.feature_layers or 'the final hidden state'}")
    head.head_config["eagle"]["unroll"] = cfg.unroll
    _set_draft_vocab(head, cfg, data, log)
    head = head.to(device).train()
    optimizer = adamw(head, cfg)
    state = load_checkpoint_state(ckpt_dir, optimizer) if resuming else {"step": 0, "tokens": 0, "train_seconds": 0.0}
    if resuming:
        log(f"resumed from {ckpt_dir} at step {state['step']}")
    log(f"target {count_params(target) / 1e6:.2f}M params, EAGLE head {count_params(head) / 1e6:.2f}M params, "
        f"unroll {cfg.unroll}, {device.type}, {'bf16' if bf16 else 'fp32'}; data {data.meta}")
    train_cache = FeatureCache(target, cfg.seq_len, pad, device, bf16, feature_layers=head.feature_layers)
    held_cache = FeatureCache(target, cfg.seq_len, pad, device, bf16, torch.float32, head.feature_layers)
    if "before" not in state:
        state["before"] = evaluate(head, data, held_cache, cfg.unroll, device, bf16)
    log(describe("before", state["before"]))

    meter, bar = Throughput(), progress_bar(cfg, state["step"], "eagle")
    budget_s = 60 * cfg.time_budget_min
    steps = 10**9 if budget_s else cfg.steps
    last_step = min(steps, cfg.stop_at or steps)

    def done() -> bool:
        return state["step"] >= last_step or bool(budget_s and state["train_seconds"] >= budget_s)

    t0 = time.time()
    while not done():
        step = state["step"]
        for group in optimizer.param_groups:
            group["lr"] = scheduled_lr(cfg, step, state["train_seconds"] / budget_s if budget_s else None)
        examples = sample_examples(data.train, step, cfg.seed, cfg.batch_size)
        loss, per_step, n_tok = _train_step(head, optimizer, train_cache, examples, cfg, device, bf16)
        state["step"] += 1
        state["tokens"] += n_tok
        state["last_loss"], state["last_step_kl"] = round(loss, 4), [round(x, 4) for x in per_step]
        now = time.time()
        state["train_seconds"] += now - t0
        t0 = now
        bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{meter.update(n_tok):.0f}", cached=len(train_cache.rows),
                        refresh=False)
        bar.update(1)
        if state["step"] % cfg.ckpt_every == 0 or done():
            save_checkpoint(ckpt_dir, head, optimizer, state, None)
    bar.close()
    if state["step"] < steps and not (budget_s and state["train_seconds"] >= budget_s):
        log(f"stopped at step {state['step']} of {cfg.steps}; continue with --resume")
        return {"steps": state["step"], "train_tokens": state["tokens"], "stopped": True, **state}

    state["after"] = evaluate(head, data, held_cache, cfg.unroll, device, bf16)
    log(describe("after", state["after"]))
    head.cpu().save_pretrained(out_dir, SAVE_DTYPES[cfg.save_dtype])
    stats = {
        "target": str(cfg.target), "head": str(out_dir), "head_params": count_params(head),
        "unroll": cfg.unroll, "steps": state["step"], "train_tokens": state["tokens"],
        "train_seconds": round(state["train_seconds"], 1), "final_train_loss": state.get("last_loss"),
        "final_train_step_kl": state.get("last_step_kl"), "precision": "bf16" if bf16 else "fp32",
        "device": device.type, "data": data.meta, "before": state["before"], "after": state["after"],
        "note": f"teacher-forced on held-out answers; chain_acceptance[j-1] = P(head argmax == target argmax at "
                f"chain steps 1..j), over anchors whose whole chain lies in the answer; expected tokens per target "
                f"forward = 1 + sum of chain_acceptance (gamma = unroll); loss = sum_j {STEP_DECAY}^(j-1) KL_j / "
                f"sum_j {STEP_DECAY}^(j-1)",
    }
    (out_dir / "eagle_stats.json").write_text(json.dumps(stats, indent=2))
    return stats


# ----------------------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    d = EagleConfig(target="", out="")
    p = argparse.ArgumentParser(prog="specserve distill --head eagle", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True, help="target model: Hugging Face directory or GGUF file")
    p.add_argument("--out", required=True, help="output directory (the head + checkpoint/ + eagle_stats.json)")
    p.add_argument("--data", default=None, help="chat JSONL ({\"messages\": [...]}, loss on the last answer)")
    p.add_argument("--generate-from", default=None, metavar="PROMPTS",
                   help="prompts JSONL (or 'builtin'): the target answers them first, into <out>/responses.jsonl")
    for name in ("generate_count", "generate_max_tokens", "unroll", "steps", "batch_size", "seq_len", "warmup",
                 "eval_windows", "held_out_every", "seed", "ckpt_every", "draft_vocab"):
        p.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(d, name))
    p.add_argument("--save-dtype", choices=list(SAVE_DTYPES), default=d.save_dtype)
    p.add_argument("--feature-layers", type=int, nargs="+", default=None, metavar="LAYER",
                   help="EAGLE-3's fused features: the head reads these decoder layers' outputs (e.g. a low, a "
                        "middle and a high one) instead of the target's final hidden state")
    p.add_argument("--init-head", default=None, metavar="DIR",
                   help="start from this exported head (e.g. models/smollm2-135m-eagle) instead of the target's last layer")
    add_run_options(p, d)
    return p


def main(argv: list[str] | None = None) -> int:
    cfg = EagleConfig(**vars(build_parser().parse_args(argv)))
    try:
        stats = train_eagle(cfg)
    except TrainError as exc:
        raise SystemExit(f"specserve distill --head eagle: error: {exc}") from None
    keys = ("steps", "train_tokens", "train_seconds", "before", "after")
    print(json.dumps({k: stats[k] for k in keys if k in stats}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
