"""specserve distill: train a small draft model to match a target's next-token
distribution, for speculative decoding.

    specserve distill --target models/default-target --corpus DIR_OR_FILES... \\
        --out runs/my-draft (--draft EXISTING_DIR | --draft-layers 2 --draft-hidden 160 --draft-heads 5) \\
        [--steps 500] [--loss kl|tv] [--ce-weight 0.0] [--resume]

The target (any Hugging Face Llama / Mistral / Qwen2 / Qwen3 causal-LM
directory) runs without gradients; its logits on each batch are computed on
the fly and the draft is trained on forward KL(target || draft) (or total
variation), optionally plus ``ce_weight`` x next-token cross-entropy.
Checkpoints (``<out>/checkpoint``) are resumable; the final draft is a plain
Hugging Face directory in ``<out>`` with the target's tokenizer files.

Before and after training it reports, on a held-out slice of the corpus
(every 50th file, or the last 5% of the tokens of a single file), the draft's
greedy acceptance rate against the target - the fraction of positions where
the draft's argmax equals the target's, teacher-forced on the held-out text -
and the expected tokens per verification step at gamma, (1 - a^(g+1)) / (1 - a),
which assumes each position is accepted independently with probability a.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from train.common import (
    HELD_OUT_EVERY,
    TrainError,
    Throughput,
    autocast,
    copy_tokenizer_files,
    corpus_files,
    cosine_lr,
    count_params,
    eval_windows,
    export_model,
    load_checkpoint_state,
    resolve_precision,
    sample_batch,
    save_checkpoint,
    set_seed,
    set_threads,
    split_files,
    tokenize_files,
)

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
SAVE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class DistillConfig:
    target: str
    corpus: list[str]
    out: str
    draft: str | None = None  # existing checkpoint to start from; else a new Llama:
    draft_layers: int = 2
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
    ce_weight: float = 0.0  # + ce_weight x next-token cross-entropy on the corpus
    gamma: int = 4
    eval_windows: int = 32
    held_out_every: int = HELD_OUT_EVERY
    precision: str = "auto"
    save_dtype: str = "float32"
    seed: int = 0
    threads: int | None = None
    ckpt_every: int = 100  # steps
    resume: bool = False
    time_budget_min: float = 0.0  # > 0: cosine LR over elapsed training time, stop when spent (not bit-reproducible)
    stop_at: int | None = None  # stop after this step as if interrupted (resume later with resume=True)
    progress: bool = True


# ----------------------------------------------------------------------------- models


def load_target(path: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    target_dir = Path(path)
    if not target_dir.exists():
        raise TrainError(f"target checkpoint not found: {target_dir}")
    if not (target_dir / "config.json").exists():
        raise TrainError(f"target {target_dir} is not a Hugging Face model directory (no config.json)")
    config = AutoConfig.from_pretrained(target_dir)
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise TrainError(f"target model type {config.model_type!r} is not supported "
                         f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    model.eval().requires_grad_(False)
    return model


def new_draft(cfg: DistillConfig, target):
    """A fresh Llama draft sharing the target's vocabulary and special ids."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tc = target.config
    if cfg.draft_hidden % cfg.draft_heads or cfg.draft_heads % cfg.draft_kv_heads:
        raise TrainError(f"draft hidden {cfg.draft_hidden} / heads {cfg.draft_heads} / kv heads "
                         f"{cfg.draft_kv_heads}: hidden must divide by heads, heads by kv heads")
    intermediate = cfg.draft_intermediate or 32 * math.ceil(cfg.draft_hidden * 8 / 3 / 32)
    config = LlamaConfig(
        vocab_size=tc.vocab_size,
        hidden_size=cfg.draft_hidden,
        intermediate_size=intermediate,
        num_hidden_layers=cfg.draft_layers,
        num_attention_heads=cfg.draft_heads,
        num_key_value_heads=cfg.draft_kv_heads,
        max_position_embeddings=getattr(tc, "max_position_embeddings", 2048),
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=tc.bos_token_id,
        eos_token_id=tc.eos_token_id,
        pad_token_id=getattr(tc, "pad_token_id", None),
    )
    torch.manual_seed(cfg.seed)
    draft = LlamaForCausalLM(config)
    if cfg.init_embeddings == "pca":
        init_embeddings_from_target(draft, target)
    return draft


@torch.no_grad()
def init_embeddings_from_target(draft, target) -> None:
    """Start the draft's (tied) embeddings from the target's, projected onto
    their top principal directions: similar tokens start close together."""
    source = target.get_input_embeddings().weight.float()
    dest = draft.get_input_embeddings().weight
    dim = dest.shape[1]
    if dim > min(source.shape):
        return
    centered = source - source.mean(0, keepdim=True)
    u, s, _ = torch.linalg.svd(centered, full_matrices=False)
    projected = u[:, :dim] * s[:dim]
    projected *= dest.std() / projected.std()
    dest.copy_(projected.to(dest.dtype))


def load_or_create_draft(cfg: DistillConfig, target, ckpt_dir: Path):
    from transformers import AutoConfig, AutoModelForCausalLM

    if cfg.resume and (ckpt_dir / "state.json").exists():
        draft = AutoModelForCausalLM.from_pretrained(ckpt_dir, dtype=torch.float32)
    elif cfg.draft:
        draft_dir = Path(cfg.draft)
        if not (draft_dir / "config.json").exists():
            raise TrainError(f"draft checkpoint not found: {draft_dir} (no config.json)")
        dconf = AutoConfig.from_pretrained(draft_dir)
        if dconf.vocab_size != target.config.vocab_size:
            raise TrainError(f"draft vocab size {dconf.vocab_size} differs from the target's "
                             f"{target.config.vocab_size}: the draft must share the target's vocabulary")
        draft = AutoModelForCausalLM.from_pretrained(draft_dir, dtype=torch.float32)
    else:
        draft = new_draft(cfg, target)
    if draft.get_output_embeddings().weight.shape[0] != target.get_output_embeddings().weight.shape[0]:
        raise TrainError("draft and target output vocabularies differ in size")
    return draft.train()


# ----------------------------------------------------------------------------- data


def load_corpus(cfg: DistillConfig, out_dir: Path, eos_id: int) -> tuple[np.ndarray, np.ndarray, dict]:
    """Tokenize the corpus with the target's tokenizer (cached in <out>/data)."""
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
        meta = json.loads(meta_path.read_text())
        return np.load(data_dir / "train.npy"), np.load(data_dir / "val.npy"), meta
    tokenizer = _fast_tokenizer(cfg.target)
    train = tokenize_files(tokenizer, train_files, eos_id)
    held = tokenize_files(tokenizer, held_files, eos_id)
    if len(train) == 0:
        raise TrainError("corpus is empty: its files hold no text")
    if len(held) == 0:  # a single file: hold out its last 5% of tokens
        cut = int(len(train) * 0.95)
        train, held = train[:cut], train[cut:]
    meta = {"key": digest, "files": len(files), "train_files": len(train_files),
            "held_out_files": len(held_files), "train_tokens": int(len(train)), "held_out_tokens": int(len(held))}
    data_dir.mkdir(parents=True, exist_ok=True)
    np.save(data_dir / "train.npy", train)
    np.save(data_dir / "val.npy", held)
    meta_path.write_text(json.dumps(meta, indent=2))
    return train, held, meta


def _fast_tokenizer(target_dir: str):
    """A ``tokenizers.Tokenizer`` for the target (batched, no special tokens added)."""
    tok_json = Path(target_dir) / "tokenizer.json"
    if tok_json.exists():
        from tokenizers import Tokenizer

        return Tokenizer.from_file(str(tok_json))
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(target_dir)
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


@torch.no_grad()
def evaluate(target, draft, windows: torch.Tensor, gamma: int, bf16: bool, batch_size: int = 8) -> dict:
    """Teacher-forced held-out metrics: greedy acceptance, KL, CE of both models."""
    was_training = draft.training
    draft.eval()
    device = torch.device("cpu")
    matches = kl = tv = ce_t = ce_d = 0.0
    count = 0
    for start in range(0, len(windows), batch_size):
        rows = windows[start : start + batch_size]
        inputs, labels = rows[:, :-1], rows[:, 1:].flatten()
        with autocast(device, bf16):
            t_logits = target(input_ids=inputs).logits.float().flatten(0, 1)
            d_logits = draft(input_ids=inputs).logits.float().flatten(0, 1)
        n = labels.numel()
        matches += (t_logits.argmax(-1) == d_logits.argmax(-1)).sum().item()
        kl += distill_loss(t_logits, d_logits, "kl").item() * n
        tv += distill_loss(t_logits, d_logits, "tv").item() * n
        ce_t += F.cross_entropy(t_logits, labels, reduction="sum").item()
        ce_d += F.cross_entropy(d_logits, labels, reduction="sum").item()
        count += n
    draft.train(was_training)
    acceptance = matches / count
    return {
        "acceptance": round(acceptance, 4),
        "expected_tokens_per_step": round(expected_tokens_per_step(acceptance, gamma), 3),
        "gamma": gamma,
        "kl": round(kl / count, 4),
        "tv": round(tv / count, 4),
        "target_loss": round(ce_t / count, 4),
        "draft_loss": round(ce_d / count, 4),
        "positions": count,
    }


def describe(tag: str, metrics: dict) -> str:
    return (f"{tag}: greedy acceptance {metrics['acceptance']:.3f}, expected tokens/step at gamma "
            f"{metrics['gamma']} = {metrics['expected_tokens_per_step']:.2f} (assumes i.i.d. acceptance), "
            f"KL {metrics['kl']:.3f}, draft CE {metrics['draft_loss']:.3f}, target CE {metrics['target_loss']:.3f}")


# ----------------------------------------------------------------------------- training


def _optimizer(draft, cfg: DistillConfig):
    decay = [p for p in draft.parameters() if p.dim() >= 2]
    no_decay = [p for p in draft.parameters() if p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr, betas=(0.9, 0.95),
    )


def _train_step(target, draft, optimizer, batch: torch.Tensor, cfg: DistillConfig, bf16: bool) -> float:
    device = torch.device("cpu")
    inputs = batch[:, :-1]
    with torch.no_grad(), autocast(device, bf16):
        t_logits = target(input_ids=inputs).logits
    with autocast(device, bf16):
        d_logits = draft(input_ids=inputs).logits
    loss = distill_loss(t_logits, d_logits, cfg.loss)
    if cfg.ce_weight:
        loss = loss + cfg.ce_weight * F.cross_entropy(d_logits.float().flatten(0, 1), batch[:, 1:].flatten())
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(draft.parameters(), cfg.grad_clip)
    optimizer.step()
    return loss.item()


def _lr(cfg: DistillConfig, step: int, time_fraction: float | None) -> float:
    """Warmup then cosine, over steps or (with a time budget) over the elapsed fraction of it."""
    if time_fraction is None or step < cfg.warmup:
        return cosine_lr(step, cfg.steps, cfg.lr, cfg.warmup, cfg.min_lr_ratio)
    return cosine_lr(1000 + int(9000 * min(time_fraction, 1.0)), 10000, cfg.lr, 1000, cfg.min_lr_ratio)


def _progress(cfg: DistillConfig, start: int):
    from tqdm import tqdm

    return tqdm(total=None if cfg.time_budget_min else cfg.steps, initial=start, desc="distill", unit="step", disable=not cfg.progress,
                mininterval=1.0 if sys.stderr.isatty() else 30.0, dynamic_ncols=True)


def distill(cfg: DistillConfig, log=print) -> dict:
    """Run (or resume) a distillation; returns the stats also written to <out>/distill_stats.json."""
    set_threads(cfg.threads)
    set_seed(cfg.seed)
    if cfg.loss not in ("kl", "tv"):
        raise TrainError(f"unknown loss {cfg.loss!r} (kl or tv)")
    if cfg.save_dtype not in SAVE_DTYPES:
        raise TrainError(f"unknown save dtype {cfg.save_dtype!r} ({', '.join(SAVE_DTYPES)})")
    out_dir, ckpt_dir = Path(cfg.out), Path(cfg.out) / "checkpoint"
    bf16 = resolve_precision(cfg.precision, torch.device("cpu"))
    corpus_files(cfg.corpus, cfg.pattern, cfg.exclude)  # fail on a missing / empty corpus before loading models
    target = load_target(cfg.target)
    draft = load_or_create_draft(cfg, target, ckpt_dir)
    train_tokens, held_tokens, data_meta = load_corpus(cfg, out_dir, eos_token_id(target))
    windows = eval_windows(held_tokens, cfg.seq_len, cfg.eval_windows)
    optimizer = _optimizer(draft, cfg)
    resuming = cfg.resume and (ckpt_dir / "state.json").exists()
    if resuming:
        state = load_checkpoint_state(ckpt_dir, optimizer)
        log(f"resumed from {ckpt_dir} at step {state['step']}")
    else:
        state = {"step": 0, "tokens": 0, "train_seconds": 0.0}
    log(f"target {count_params(target) / 1e6:.2f}M params, draft {count_params(draft) / 1e6:.2f}M params, "
        f"{'bf16 autocast' if bf16 else 'fp32'}; corpus {data_meta['train_tokens']:,} train / "
        f"{data_meta['held_out_tokens']:,} held-out tokens")
    if "before" not in state:
        state["before"] = evaluate(target, draft, windows, cfg.gamma, bf16)
    log(describe("before", state["before"]))

    meter, bar = Throughput(), _progress(cfg, state["step"])
    t0 = time.time()
    budget_s = 60 * cfg.time_budget_min
    steps = 10**9 if budget_s else cfg.steps
    last_step = min(steps, cfg.stop_at or steps)

    def done() -> bool:
        return state["step"] >= last_step or bool(budget_s and state["train_seconds"] >= budget_s)

    while not done():
        step = state["step"]
        for group in optimizer.param_groups:
            group["lr"] = _lr(cfg, step, state["train_seconds"] / budget_s if budget_s else None)
        batch = sample_batch(train_tokens, step, cfg.seed, cfg.batch_size, cfg.seq_len)
        loss = _train_step(target, draft, optimizer, batch, cfg, bf16)
        n_tok = batch[:, 1:].numel()
        state["step"] += 1
        state["tokens"] += n_tok
        state["last_loss"] = round(loss, 4)
        now = time.time()
        state["train_seconds"] += now - t0
        t0 = now
        bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{meter.update(n_tok):.0f}", refresh=False)
        bar.update(1)
        if state["step"] % cfg.ckpt_every == 0 or done():
            save_checkpoint(ckpt_dir, draft, optimizer, state, Path(cfg.target))
    bar.close()
    if state["step"] < steps and not (budget_s and state["train_seconds"] >= budget_s):
        log(f"stopped at step {state['step']} of {cfg.steps}; continue with --resume")
        return {"steps": state["step"], "train_tokens": state["tokens"], "stopped": True, **state}

    state["after"] = evaluate(target, draft, windows, cfg.gamma, bf16)
    log(describe("after", state["after"]))
    export_model(draft, out_dir, None, SAVE_DTYPES[cfg.save_dtype])
    copy_tokenizer_files(Path(cfg.target), out_dir)
    stats = {
        "target": str(cfg.target),
        "target_params": count_params(target),
        "draft_params": count_params(draft),
        "steps": state["step"],
        "train_tokens": state["tokens"],
        "train_seconds": round(state["train_seconds"], 1),
        "final_train_loss": state.get("last_loss"),
        "loss": cfg.loss,
        "ce_weight": cfg.ce_weight,
        "precision": "bf16" if bf16 else "fp32",
        "corpus": data_meta,
        "before": state["before"],
        "after": state["after"],
        "note": "acceptance = fraction of held-out positions where draft argmax == target argmax "
                "(teacher-forced); expected tokens/step = (1 - a^(g+1)) / (1 - a), assuming i.i.d. acceptance",
    }
    (out_dir / "distill_stats.json").write_text(json.dumps(stats, indent=2))
    return stats


# ----------------------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    d = DistillConfig(target="", corpus=[], out="")
    p = argparse.ArgumentParser(prog="specserve distill", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True, help="target Hugging Face model directory")
    p.add_argument("--corpus", nargs="+", required=True, help="text files and/or directories")
    p.add_argument("--pattern", default=None, help="glob for files inside corpus directories, e.g. '*.py'")
    p.add_argument("--exclude", nargs="*", default=None, help="skip directories with these names")
    p.add_argument("--out", required=True, help="output directory (final draft + checkpoint/)")
    p.add_argument("--draft", default=None, help="existing draft checkpoint to start from")
    p.add_argument("--draft-layers", type=int, default=d.draft_layers)
    p.add_argument("--draft-hidden", type=int, default=d.draft_hidden)
    p.add_argument("--draft-heads", type=int, default=d.draft_heads)
    p.add_argument("--draft-kv-heads", type=int, default=d.draft_kv_heads)
    p.add_argument("--draft-intermediate", type=int, default=None)
    p.add_argument("--init-embeddings", choices=["pca", "random"], default=d.init_embeddings)
    for name in ("steps", "batch_size", "seq_len", "warmup", "gamma", "eval_windows", "held_out_every",
                 "seed", "ckpt_every"):
        p.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(d, name))
    for name in ("lr", "min_lr_ratio", "weight_decay", "grad_clip", "ce_weight"):
        p.add_argument("--" + name.replace("_", "-"), type=float, default=getattr(d, name))
    p.add_argument("--loss", choices=["kl", "tv"], default=d.loss)
    p.add_argument("--precision", choices=["auto", "bf16", "fp32"], default=d.precision,
                   help="bf16 autocast or fp32 (auto: bf16 where the CPU has native bf16)")
    p.add_argument("--save-dtype", choices=list(SAVE_DTYPES), default=d.save_dtype)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--resume", action="store_true", help="continue from <out>/checkpoint")
    p.add_argument("--time-budget-min", type=float, default=0.0,
                   help="train for this many minutes (cosine LR over elapsed time) instead of --steps")
    p.add_argument("--stop-at", type=int, default=None, help="stop after this step (resume later)")
    p.add_argument("--no-progress", dest="progress", action="store_false")
    return p


def main(argv: list[str] | None = None) -> int:
    args = vars(build_parser().parse_args(argv))
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
