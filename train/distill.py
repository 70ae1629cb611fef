"""specserve distill: train a small draft model to match a target's next-token
distribution, for speculative decoding.

    specserve distill --target TARGET (--data chat.jsonl | --generate-from prompts.jsonl | --corpus DIR_OR_FILES...) \\
        --out runs/my-draft (--draft EXISTING_DIR | --draft-from-target-layers 0 1
                             | --draft-layers 2 --draft-hidden 160 --draft-heads 5) \\
        [--steps 500] [--loss kl|tv] [--ce-weight 0.0] [--save-format safetensors|gguf] [--resume]

Data: chat JSONL (`--data`, {"messages": [...]} per line, rendered with the target's chat template,
loss on the last assistant turn only: see train/chat_data.py); or prompts whose answers the
target first generates with specserve's engine (`--generate-from`, written to <out>/responses.jsonl,
the self-distillation recipe); or plain text files (`--corpus`, loss on every position).
Runs on CUDA when present (the target in bf16), else on CPU (bf16 autocast where the CPU has
native bf16).

The target (any Hugging Face Llama / Mistral / Qwen2 / Qwen3 causal-LM
directory) runs without gradients; its logits on each batch are computed on
the fly and the draft is trained on forward KL(target || draft) (or total
variation), optionally plus ``ce_weight`` x next-token cross-entropy.
Checkpoints (``<out>/checkpoint``) are resumable; the final draft is a plain
Hugging Face directory in ``<out>`` with the target's tokenizer files.

`specserve distill --head eagle ...` trains an EAGLE-style self-drafting head (one decoder layer
over the target's own features, unrolled as it drafts) instead of a draft model: see train/eagle.py
(`specserve distill --head eagle --help` for its flags).

Before and after training it reports, on a held-out slice (every 50th conversation or file, or
the last 5% of the tokens of a single file): the draft's greedy acceptance against the target
(the fraction of trained positions where the draft's argmax equals the target's, teacher-forced),
1 - TV(target, draft) (the expected acceptance of a sampled draft token at temperature 1), and the
expected tokens per verification step at gamma, (1 - a^(g+1)) / (1 - a), which assumes each
position is accepted independently with probability a.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from train.chat_data import IGNORE, collate, load_chat_jsonl, sample_examples, split_examples
from train.common import (
    HELD_OUT_EVERY,
    TrainError,
    Throughput,
    adamw,
    add_run_options,
    autocast,
    corpus_files,
    count_params,
    eval_windows,
    load_checkpoint_state,
    progress_bar,
    resolve_precision,
    sample_batch,
    save_checkpoint,
    scheduled_lr,
    set_seed,
    set_threads,
    split_files,
    tokenize_files,
    train_device,
)
from train.draft_models import (
    SAVE_DTYPES,
    draft_from_target_layers,
    export_draft,
    hf_model,
    load_existing_draft,
    load_target,
    new_draft,
)


@dataclass
class DistillConfig:
    target: str
    out: str
    corpus: list[str] | None = None  # plain text files / directories (loss everywhere), or:
    data: str | None = None  # chat JSONL (loss on the last assistant turn), or:
    generate_from: str | None = None  # prompts JSONL, or "builtin": the target answers them first
    generate_count: int = 3000  # with generate_from="builtin": prompts in round one
    generate_max_tokens: int = 320
    draft: str | None = None  # existing checkpoint to start from; else the target's own layers:
    draft_from_target_layers: list[int] | None = None
    draft_layers: int = 2  # ... else a new Llama of this shape
    draft_hidden: int = 160
    draft_heads: int = 5
    draft_kv_heads: int = 1
    draft_intermediate: int | None = None  # default: about 8/3 x hidden, rounded to 32
    init_embeddings: str = "pca"  # new draft: "pca" of the target's embeddings, or "random"
    pattern: str | None = None  # glob for files inside corpus directories
    exclude: list[str] | None = None  # skip files below directories with these names
    steps: int = 200
    batch_size: int = 8
    seq_len: int = 256
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup: int = 20
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    loss: str = "kl"  # "kl" (forward KL, target || draft) or "tv" (total variation)
    ce_weight: float = 0.0  # + ce_weight x next-token cross-entropy on the data
    gamma: int = 4
    eval_windows: int = 32  # held-out windows (corpus) or conversations (chat data) to evaluate on
    held_out_every: int = HELD_OUT_EVERY
    precision: str = "auto"
    device: str = "auto"  # auto: cuda when present
    save_format: str = "safetensors"  # or "gguf" (one file, matrices as gguf_type)
    save_dtype: str = "float32"
    gguf_type: str = "Q8_0"
    seed: int = 0
    threads: int | None = None
    ckpt_every: int = 100  # steps
    resume: bool = False
    time_budget_min: float = 0.0  # > 0: cosine LR over elapsed training time, stop when spent (not bit-reproducible)
    stop_at: int | None = None  # stop after this step as if interrupted (resume later with resume=True)
    progress: bool = True


# ----------------------------------------------------------------------------- data


class TextCorpus:
    """Plain text files, tokenized into one stream (cached in <out>/data); random windows, loss everywhere."""

    def __init__(self, cfg: DistillConfig, out_dir: Path, eos_id: int):
        files = corpus_files(cfg.corpus, cfg.pattern, cfg.exclude)
        train_files, held_files = split_files(files, cfg.held_out_every)
        tok_json = Path(cfg.target) / "tokenizer.json"
        key = hashlib.sha256()
        for f in files:
            key.update(f"{f}:{f.stat().st_size}:{f.stat().st_mtime_ns}\n".encode())
        key.update(tok_json.read_bytes() if tok_json.exists() else str(cfg.target).encode())
        key.update(str(cfg.held_out_every).encode())
        digest = key.hexdigest()[:16]
        data_dir = out_dir / "data"
        meta_path = data_dir / "meta.json"
        if meta_path.exists() and json.loads(meta_path.read_text()).get("key") == digest:
            self.meta = json.loads(meta_path.read_text())
            self.train, held = np.load(data_dir / "train.npy"), np.load(data_dir / "val.npy")
        else:
            tokenizer = _fast_tokenizer(cfg.target)
            self.train = tokenize_files(tokenizer, train_files, eos_id)
            held = tokenize_files(tokenizer, held_files, eos_id)
            if len(self.train) == 0:
                raise TrainError("corpus is empty: its files hold no text")
            if len(held) == 0:  # a single file: hold out its last 5% of tokens
                cut = int(len(self.train) * 0.95)
                self.train, held = self.train[:cut], self.train[cut:]
            self.meta = {"key": digest, "files": len(files), "train_files": len(train_files),
                         "held_out_files": len(held_files), "train_tokens": int(len(self.train)),
                         "held_out_tokens": int(len(held))}
            data_dir.mkdir(parents=True, exist_ok=True)
            np.save(data_dir / "train.npy", self.train)
            np.save(data_dir / "val.npy", held)
            meta_path.write_text(json.dumps(self.meta, indent=2))
        self.cfg = cfg
        self.windows = eval_windows(held, cfg.seq_len, cfg.eval_windows)

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        rows = sample_batch(self.train, step, self.cfg.seed, self.cfg.batch_size, self.cfg.seq_len)
        return rows[:, :-1], rows[:, 1:]

    def eval_batches(self, batch_size: int = 8):
        for start in range(0, len(self.windows), batch_size):
            rows = self.windows[start: start + batch_size]
            yield rows[:, :-1], rows[:, 1:]


class ChatData:
    """Conversations (chat JSONL), loss on the last assistant turn."""

    def __init__(self, cfg: DistillConfig, path: Path, pad_id: int):
        from engine.tokenizer import load_tokenizer

        examples = load_chat_jsonl(path, load_tokenizer(cfg.target))
        self.train, held = split_examples(examples, cfg.held_out_every)
        self.held = held[: cfg.eval_windows]
        self.cfg, self.pad_id = cfg, pad_id
        self.meta = {"data": str(path), "conversations": len(examples), "train_conversations": len(self.train),
                     "held_out_conversations": len(held),
                     "train_tokens": int(sum(len(e.token_ids) - e.answer_start for e in self.train))}

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        examples = sample_examples(self.train, step, self.cfg.seed, self.cfg.batch_size)
        return collate(examples, self.cfg.seq_len, self.pad_id)

    def eval_batches(self, batch_size: int = 8):
        for start in range(0, len(self.held), batch_size):
            yield collate(self.held[start: start + batch_size], self.cfg.seq_len, self.pad_id)


def _fast_tokenizer(target_dir: str):
    """A ``tokenizers.Tokenizer`` for the target (batched, no special tokens added)."""
    tok_json = Path(target_dir) / "tokenizer.json"
    if tok_json.exists():
        from tokenizers import Tokenizer

        return Tokenizer.from_file(str(tok_json))
    from engine.tokenizer import load_tokenizer

    hf = load_tokenizer(target_dir)
    if getattr(hf, "backend_tokenizer", None) is None:
        raise TrainError(f"target {target_dir} has no fast tokenizer (tokenizer.json)")
    return hf.backend_tokenizer


def eos_token_id(target) -> int:
    eos = target.config.eos_token_id
    if isinstance(eos, (list, tuple)):
        eos = eos[0]
    if eos is None:
        raise TrainError("target config has no eos_token_id")
    return int(eos)


def pad_token_id(target) -> int:
    """The target's padding token, or its EOS when it names none."""
    pad = getattr(target.config, "pad_token_id", None)
    return eos_token_id(target) if pad is None else pad


def open_data(cfg: DistillConfig, out_dir: Path, target):
    if cfg.corpus:
        return TextCorpus(cfg, out_dir, eos_token_id(target))
    path = Path(cfg.data) if cfg.data else generate_answers(cfg, out_dir)
    return ChatData(cfg, path, pad_token_id(target))


def generate_answers(cfg: DistillConfig, out_dir: Path) -> Path:
    """Self-distillation data: the target's own answers (specserve generate), resumable."""
    from train import generate

    out = out_dir / "responses.jsonl"
    argv = ["--target", cfg.target, "--out", str(out), "--max-tokens", str(cfg.generate_max_tokens),
            "--seed", str(cfg.seed), "--count", str(cfg.generate_count)]
    if cfg.generate_from != "builtin":
        argv += ["--prompts", cfg.generate_from]
    generate.main(argv)
    return out


# ----------------------------------------------------------------------------- losses / eval


def distill_loss(target_logits: torch.Tensor, draft_logits: torch.Tensor, kind: str) -> torch.Tensor:
    """Mean over positions of KL(target || draft) or TV(target, draft); logits [..., vocab]."""
    t_logp = F.log_softmax(target_logits.float(), dim=-1)
    d_logp = F.log_softmax(draft_logits.float(), dim=-1)
    if kind == "kl":
        per_pos = (t_logp.exp() * (t_logp - d_logp)).sum(-1)
    elif kind == "tv":
        per_pos = 0.5 * (t_logp.exp() - d_logp.exp()).abs().sum(-1)
    else:
        raise TrainError(f"unknown loss {kind!r} (kl or tv)")
    return per_pos.mean()


def expected_tokens_per_step(acceptance: float, gamma: int) -> float:
    """Tokens per verification step with gamma drafts, if each position is
    accepted independently with probability ``acceptance``."""
    if acceptance >= 1.0:
        return float(gamma + 1)
    return (1 - acceptance ** (gamma + 1)) / (1 - acceptance)


def _shared_vocab(target_logits: torch.Tensor, draft_logits: torch.Tensor):
    """Both models' logits over the rows both embedding tables have (one tokenizer, tables padded apart)."""
    n = min(target_logits.shape[-1], draft_logits.shape[-1])
    return target_logits[..., :n], draft_logits[..., :n]


def _logits(model, inputs: torch.Tensor, labels: torch.Tensor, device: torch.device, bf16: bool):
    """Logits [N, vocab] at the trained positions (labels != IGNORE) and their labels [N]. The head
    runs on those positions only: over a 49k vocabulary it costs more than the draft's layers."""
    mask = labels != IGNORE
    with autocast(device, bf16):
        hidden = model.get_decoder()(input_ids=inputs.to(device)).last_hidden_state
        logits = model.get_output_embeddings()(hidden[mask.to(device)])
    return logits.float(), labels[mask].to(device)


@torch.no_grad()
def evaluate(target, draft, data, gamma: int, device: torch.device, bf16: bool) -> dict:
    """Teacher-forced held-out metrics: greedy acceptance, 1 - TV, KL, CE of both models."""
    was_training = draft.training
    draft.eval()
    matches = kl = tv = ce_t = ce_d = 0.0
    count = 0
    for inputs, labels in data.eval_batches():
        t_logits, kept = _logits(target, inputs, labels, device, bf16)
        d_logits, _ = _logits(draft, inputs, labels, device, bf16)
        t_logits, d_logits = _shared_vocab(t_logits, d_logits)
        n = kept.numel()
        matches += (t_logits.argmax(-1) == d_logits.argmax(-1)).sum().item()
        kl += distill_loss(t_logits, d_logits, "kl").item() * n
        tv += distill_loss(t_logits, d_logits, "tv").item() * n
        ce_t += F.cross_entropy(t_logits, kept, reduction="sum").item()
        ce_d += F.cross_entropy(d_logits, kept, reduction="sum").item()
        count += n
    draft.train(was_training)
    if count == 0:
        raise TrainError("the held-out slice has no trained positions")
    acceptance = matches / count
    return {
        "acceptance": round(acceptance, 4),
        "sampled_acceptance": round(1 - tv / count, 4),
        "expected_tokens_per_step": round(expected_tokens_per_step(acceptance, gamma), 3),
        "gamma": gamma,
        "kl": round(kl / count, 4),
        "tv": round(tv / count, 4),
        "target_loss": round(ce_t / count, 4),
        "draft_loss": round(ce_d / count, 4),
        "positions": count,
    }


def describe(tag: str, metrics: dict) -> str:
    return (f"{tag}: greedy acceptance {metrics['acceptance']:.3f}, 1 - TV {metrics['sampled_acceptance']:.3f}, "
            f"expected tokens/step at gamma {metrics['gamma']} = {metrics['expected_tokens_per_step']:.2f} "
            f"(assumes i.i.d. acceptance), KL {metrics['kl']:.3f}, draft CE {metrics['draft_loss']:.3f}, "
            f"target CE {metrics['target_loss']:.3f}")


# ----------------------------------------------------------------------------- training


def _train_step(target, draft, optimizer, inputs, labels, cfg: DistillConfig, device, bf16: bool) -> float:
    with torch.no_grad():
        t_logits, _ = _logits(target, inputs, labels, device, bf16)
    d_logits, kept = _logits(draft, inputs, labels, device, bf16)
    t_logits, d_logits = _shared_vocab(t_logits, d_logits)
    loss = distill_loss(t_logits, d_logits, cfg.loss)
    if cfg.ce_weight:
        loss = loss + cfg.ce_weight * F.cross_entropy(d_logits, kept)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(draft.parameters(), cfg.grad_clip)
    optimizer.step()
    return loss.item()


def _draft(cfg: DistillConfig, target, ckpt_dir: Path):
    if cfg.resume and (ckpt_dir / "state.json").exists():
        draft = hf_model(ckpt_dir)
    elif cfg.draft:
        draft = load_existing_draft(cfg.draft, target, cfg.target)
    elif cfg.draft_from_target_layers:
        draft = draft_from_target_layers(target, list(cfg.draft_from_target_layers))
    else:
        draft = new_draft(target, cfg.draft_layers, cfg.draft_hidden, cfg.draft_heads, cfg.draft_kv_heads,
                          cfg.draft_intermediate, cfg.init_embeddings, cfg.seed)
    return draft.float().train()


def _check(cfg: DistillConfig) -> None:
    if sum(bool(source) for source in (cfg.corpus, cfg.data, cfg.generate_from)) != 1:
        raise TrainError("give exactly one of --corpus, --data and --generate-from")
    if cfg.loss not in ("kl", "tv"):
        raise TrainError(f"unknown loss {cfg.loss!r} (kl or tv)")
    if cfg.save_dtype not in SAVE_DTYPES:
        raise TrainError(f"unknown save dtype {cfg.save_dtype!r} ({', '.join(SAVE_DTYPES)})")
    if cfg.save_format not in ("safetensors", "gguf"):
        raise TrainError(f"unknown save format {cfg.save_format!r} (safetensors or gguf)")
    if cfg.corpus:
        corpus_files(cfg.corpus, cfg.pattern, cfg.exclude)  # fail on a missing / empty corpus before loading models
    if cfg.data and not Path(cfg.data).is_file():
        raise TrainError(f"chat data not found: {cfg.data}")


def distill(cfg: DistillConfig, log=print) -> dict:
    """Run (or resume) a distillation; returns the stats also written to <out>/distill_stats.json."""
    set_threads(cfg.threads)
    set_seed(cfg.seed)
    _check(cfg)
    out_dir, ckpt_dir = Path(cfg.out), Path(cfg.out) / "checkpoint"
    device = train_device(cfg.device)
    bf16 = resolve_precision(cfg.precision, device)
    target = load_target(cfg.target, device)
    data = open_data(cfg, out_dir, target)
    draft = _draft(cfg, target, ckpt_dir).to(device)
    optimizer = adamw(draft, cfg)
    resuming = cfg.resume and (ckpt_dir / "state.json").exists()
    if resuming:
        state = load_checkpoint_state(ckpt_dir, optimizer)
        log(f"resumed from {ckpt_dir} at step {state['step']}")
    else:
        state = {"step": 0, "tokens": 0, "train_seconds": 0.0}
    log(f"target {count_params(target) / 1e6:.2f}M params, draft {count_params(draft) / 1e6:.2f}M params, "
        f"{device.type}, {'bf16' if bf16 else 'fp32'}; data {data.meta}")
    if "before" not in state:
        state["before"] = evaluate(target, draft, data, cfg.gamma, device, bf16)
    log(describe("before", state["before"]))

    meter, bar = Throughput(), progress_bar(cfg, state["step"], "distill")
    t0 = time.time()
    budget_s = 60 * cfg.time_budget_min
    steps = 10**9 if budget_s else cfg.steps
    last_step = min(steps, cfg.stop_at or steps)

    def done() -> bool:
        return state["step"] >= last_step or bool(budget_s and state["train_seconds"] >= budget_s)

    while not done():
        step = state["step"]
        for group in optimizer.param_groups:
            group["lr"] = scheduled_lr(cfg, step, state["train_seconds"] / budget_s if budget_s else None)
        inputs, labels = data.batch(step)
        loss = _train_step(target, draft, optimizer, inputs, labels, cfg, device, bf16)
        n_tok = int((labels != IGNORE).sum())
        state["step"] += 1
        state["tokens"] += n_tok
        state["last_loss"] = round(loss, 4)
        now = time.time()
        state["train_seconds"] += now - t0
        t0 = now
        bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{meter.update(n_tok):.0f}", refresh=False)
        bar.update(1)
        if state["step"] % cfg.ckpt_every == 0 or done():
            save_checkpoint(ckpt_dir, draft, optimizer, state, None)
    bar.close()
    if state["step"] < steps and not (budget_s and state["train_seconds"] >= budget_s):
        log(f"stopped at step {state['step']} of {cfg.steps}; continue with --resume")
        return {"steps": state["step"], "train_tokens": state["tokens"], "stopped": True, **state}

    state["after"] = evaluate(target, draft, data, cfg.gamma, device, bf16)
    log(describe("after", state["after"]))
    saved = export_draft(draft.cpu(), out_dir, Path(cfg.target), cfg.save_format, cfg.save_dtype, cfg.gguf_type)
    stats = {
        "target": str(cfg.target),
        "draft": str(saved),
        "target_params": count_params(target),
        "draft_params": count_params(draft),
        "steps": state["step"],
        "train_tokens": state["tokens"],
        "train_seconds": round(state["train_seconds"], 1),
        "final_train_loss": state.get("last_loss"),
        "loss": cfg.loss,
        "ce_weight": cfg.ce_weight,
        "precision": "bf16" if bf16 else "fp32",
        "device": device.type,
        "data": data.meta,
        "before": state["before"],
        "after": state["after"],
        "note": "acceptance = fraction of held-out trained positions where draft argmax == target argmax "
                "(teacher-forced); sampled_acceptance = 1 - TV(target, draft); expected tokens/step = "
                "(1 - a^(g+1)) / (1 - a), assuming i.i.d. acceptance",
    }
    (out_dir / "distill_stats.json").write_text(json.dumps(stats, indent=2))
    return stats


# ----------------------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    d = DistillConfig(target="", out="")
    p = argparse.ArgumentParser(prog="specserve distill", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True, help="target model: Hugging Face directory or GGUF file")
    p.add_argument("--out", required=True, help="output directory (final draft + checkpoint/)")
    p.add_argument("--corpus", nargs="+", default=None, help="text files and/or directories (loss everywhere)")
    p.add_argument("--data", default=None, help="chat JSONL ({\"messages\": [...]}, loss on the last answer)")
    p.add_argument("--generate-from", default=None, metavar="PROMPTS",
                   help="prompts JSONL (or 'builtin'): the target answers them first, into <out>/responses.jsonl")
    p.add_argument("--generate-count", type=int, default=d.generate_count)
    p.add_argument("--generate-max-tokens", type=int, default=d.generate_max_tokens)
    p.add_argument("--pattern", default=None, help="glob for files inside corpus directories, e.g. '*.py'")
    p.add_argument("--exclude", nargs="*", default=None, help="skip directories with these names")
    p.add_argument("--draft", default=None, help="existing draft checkpoint to start from")
    p.add_argument("--draft-from-target-layers", type=int, nargs="+", default=None, metavar="LAYER",
                   help="start from the target itself, keeping only these decoder layers")
    p.add_argument("--draft-layers", type=int, default=d.draft_layers)
    p.add_argument("--draft-hidden", type=int, default=d.draft_hidden)
    p.add_argument("--draft-heads", type=int, default=d.draft_heads)
    p.add_argument("--draft-kv-heads", type=int, default=d.draft_kv_heads)
    p.add_argument("--draft-intermediate", type=int, default=None)
    p.add_argument("--init-embeddings", choices=["pca", "random"], default=d.init_embeddings)
    for name in ("steps", "batch_size", "seq_len", "warmup", "gamma", "eval_windows", "held_out_every",
                 "seed", "ckpt_every"):
        p.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(d, name))
    p.add_argument("--ce-weight", type=float, default=d.ce_weight)
    p.add_argument("--loss", choices=["kl", "tv"], default=d.loss)
    p.add_argument("--save-format", choices=["safetensors", "gguf"], default=d.save_format)
    p.add_argument("--save-dtype", choices=list(SAVE_DTYPES), default=d.save_dtype)
    p.add_argument("--gguf-type", default=d.gguf_type, help="matrix type with --save-format gguf (Q8_0, F16, ...)")
    add_run_options(p, d)
    p.add_argument("--head", choices=["eagle"], default=None,
                   help="train an EAGLE head instead of a draft model (train/eagle.py; its own flags)")
    return p


def _head_argv(argv: list[str]) -> list[str] | None:
    """argv without `--head eagle` (or `--head=eagle`) when it asks for a head; None when it does not."""
    for i, arg in enumerate(argv):
        if arg == "--head" or arg.startswith("--head="):
            value = arg.partition("=")[2] if "=" in arg else (argv[i + 1] if i + 1 < len(argv) else "")
            if value != "eagle":
                raise SystemExit(f"specserve distill: error: --head {value!r}: the only head is 'eagle'")
            return argv[:i] + argv[i + (1 if "=" in arg else 2):]
    return None


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    head_argv = _head_argv(argv)
    if head_argv is not None:   # specserve distill --head eagle: train/eagle.py
        from train import eagle

        return eagle.main(head_argv)
    args = vars(build_parser().parse_args(argv))
    args.pop("head")
    cfg = DistillConfig(**args)
    try:
        stats = distill(cfg)
    except TrainError as exc:
        raise SystemExit(f"specserve distill: error: {exc}") from None
    keys = ("steps", "train_tokens", "train_seconds", "before", "after")
    print(json.dumps({k: stats[k] for k in keys if k in stats}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
