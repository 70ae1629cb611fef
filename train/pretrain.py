"""Pretrain the default target: a small Llama on the Python standard library
with next-token cross-entropy, bf16 autocast on CPU, resumable.

    python -m train.pretrain --run-dir runs/default [--max-steps N] [--resume]

The corpus is tokenized once into ``<run-dir>/data/{train,val}.npy`` (uint16);
checkpoints go to ``<run-dir>/target-ckpt`` (model + optimizer + step + RNG),
the log to ``<run-dir>/target-train.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from train.common import (
    TrainError,
    Throughput,
    autocast,
    count_params,
    cosine_lr,
    eval_windows,
    load_checkpoint_state,
    resolve_precision,
    sample_batch,
    save_checkpoint,
    set_seed,
    set_threads,
    split_files,
    stdlib_files,
    tokenize_files,
)


def prepare_stdlib_data(run_dir: Path, tokenizer_dir: Path) -> tuple[np.ndarray, np.ndarray]:
    """Tokenize the stdlib once (train / held-out split by file) and cache it."""
    data_dir = Path(run_dir) / "data"
    train_path, val_path = data_dir / "train.npy", data_dir / "val.npy"
    if not (train_path.exists() and val_path.exists()):
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json"))
        eos_id = tok.token_to_id("<|endoftext|>")
        train_files, held_files = split_files(stdlib_files())
        data_dir.mkdir(parents=True, exist_ok=True)
        np.save(data_dir / "train.tmp.npy", tokenize_files(tok, train_files, eos_id))
        np.save(data_dir / "val.tmp.npy", tokenize_files(tok, held_files, eos_id))
        (data_dir / "train.tmp.npy").rename(train_path)
        (data_dir / "val.tmp.npy").rename(val_path)
        stats = {"train_files": len(train_files), "held_out_files": len(held_files)}
        (data_dir / "files.json").write_text(json.dumps(stats))
    return np.load(train_path, mmap_mode="r"), np.load(val_path, mmap_mode="r")


def build_llama(vocab_size: int, hidden: int, layers: int, heads: int, kv_heads: int,
                intermediate: int, max_positions: int, eos_id: int, pad_id: int, seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    return model


@torch.no_grad()
def held_out_loss(model, windows: torch.Tensor, device: torch.device, bf16: bool, batch_size: int = 8) -> float:
    model.eval()
    total, count = 0.0, 0
    for start in range(0, len(windows), batch_size):
        rows = windows[start : start + batch_size].to(device)
        with autocast(device, bf16):
            logits = model(input_ids=rows[:, :-1]).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), rows[:, 1:].flatten(), reduction="sum")
        total += loss.item()
        count += rows[:, 1:].numel()
    model.train()
    return total / count


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run-dir", default="runs/default")
    p.add_argument("--tokenizer", default=None, help="tokenizer dir (default <run-dir>/tokenizer)")
    p.add_argument("--hidden", type=int, default=448)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=7)
    p.add_argument("--kv-heads", type=int, default=1)
    p.add_argument("--intermediate", type=int, default=1216)
    p.add_argument("--max-positions", type=int, default=1024)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-steps", type=int, default=360)
    p.add_argument("--time-budget-min", type=float, default=0.0,
                   help="train for this many minutes of training time (cosine LR over elapsed time, "
                        "stops when spent) instead of --max-steps; for shared machines of unknown speed")
    p.add_argument("--lr", type=float, default=2.5e-3)
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--eval-every", type=int, default=40)
    p.add_argument("--eval-windows", type=int, default=32)
    p.add_argument("--ckpt-minutes", type=float, default=5.0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--precision", choices=["auto", "bf16", "fp32"], default="auto",
                   help="bf16 autocast or fp32; auto = bf16 where the CPU has native bf16")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--benchmark", type=int, default=0, help="run N steps, print tokens/s, save nothing")
    return p.parse_args(argv)


def train(args) -> dict:
    set_threads(args.threads)
    set_seed(args.seed)
    device = torch.device("cpu")
    bf16 = resolve_precision(args.precision, device)
    run_dir = Path(args.run_dir)
    tok_dir = Path(args.tokenizer or run_dir / "tokenizer")
    if not (tok_dir / "tokenizer.json").exists():
        raise TrainError(f"no tokenizer.json in {tok_dir}: run python -m train.tokenizer first")
    train_tokens, val_tokens = prepare_stdlib_data(run_dir, tok_dir)
    ckpt_dir = run_dir / "target-ckpt"
    log_path = run_dir / "target-train.jsonl"

    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    if args.resume and (ckpt_dir / "state.json").exists():
        from transformers import LlamaForCausalLM

        model = LlamaForCausalLM.from_pretrained(ckpt_dir, dtype=torch.float32)
    else:
        model = build_llama(tok.get_vocab_size(), args.hidden, args.layers, args.heads, args.kv_heads,
                            args.intermediate, args.max_positions, tok.token_to_id("<|endoftext|>"),
                            tok.token_to_id("<|pad|>"), args.seed)
    model.to(device).train()
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95), eps=1e-8,
    )
    state = {"step": 0, "tokens": 0, "train_seconds": 0.0, "best_val_loss": None}
    if args.resume and (ckpt_dir / "state.json").exists():
        state = load_checkpoint_state(ckpt_dir, optimizer)
        print(f"resumed from {ckpt_dir} at step {state['step']}", flush=True)
    params = count_params(model)
    print(f"precision: {'bf16 autocast' if bf16 else 'fp32'}", flush=True)
    print(f"target: {params / 1e6:.2f}M params, {len(train_tokens):,} train tokens, "
          f"{len(val_tokens):,} held-out tokens", flush=True)
    windows = eval_windows(val_tokens, args.seq_len, args.eval_windows)

    meter = Throughput()
    last_ckpt = time.time()
    log = open(log_path, "a") if not args.benchmark else None
    max_steps = args.benchmark or args.max_steps
    step_start = state["step"]
    t_session = time.time()
    budget_s = 60 * args.time_budget_min
    if budget_s and not args.benchmark:
        max_steps = 10**9

    def finished() -> bool:
        return state["step"] >= max_steps or bool(budget_s and state["train_seconds"] >= budget_s)

    while not finished():
        step = state["step"]
        lr = cosine_lr(step, args.max_steps, args.lr, args.warmup, args.min_lr_ratio)
        if budget_s and step >= args.warmup:
            frac = 1000 + int(9000 * state["train_seconds"] / budget_s)  # elapsed fraction, in 1/10000
            lr = cosine_lr(frac, 10000, args.lr, 1000, args.min_lr_ratio)
        for group in optimizer.param_groups:
            group["lr"] = lr
        batch = sample_batch(train_tokens, step, args.seed, args.batch_size, args.seq_len).to(device)
        with autocast(device, bf16):
            logits = model(input_ids=batch[:, :-1]).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        optimizer.step()
        n_tok = batch[:, 1:].numel()
        state["step"] += 1
        state["tokens"] += n_tok
        tps = meter.update(n_tok)
        record = {"step": state["step"], "loss": round(loss.item(), 4), "lr": lr,
                  "grad_norm": round(float(grad_norm), 3), "tok_s": round(tps, 1), "tokens": state["tokens"]}
        now = time.time()
        state["train_seconds"] = state.get("train_seconds", 0.0) + (now - t_session)
        t_session = now
        if state["step"] % args.eval_every == 0 or finished():
            if not args.benchmark:
                record["val_loss"] = round(held_out_loss(model, windows, device, bf16), 4)
                best = state.get("best_val_loss")
                state["best_val_loss"] = record["val_loss"] if best is None else min(best, record["val_loss"])
                state["val_loss"] = record["val_loss"]
        if log:
            log.write(json.dumps(record) + "\n")
            log.flush()
        if state["step"] % 10 == 0 or "val_loss" in record:
            print(" ".join(f"{k}={v}" for k, v in record.items()), flush=True)
        if not args.benchmark and (now - last_ckpt > args.ckpt_minutes * 60 or finished()):
            save_checkpoint(ckpt_dir, model, optimizer, state, tok_dir)
            last_ckpt = now
    if args.benchmark:
        done = state["step"] - step_start
        print(f"benchmark: {done} steps, {tps:.0f} tokens/s (last window)", flush=True)
    state["params"] = params
    state["precision"] = "bf16" if bf16 else "fp32"
    state["train_corpus_tokens"] = int(len(train_tokens))
    state["held_out_tokens"] = int(len(val_tokens))
    return state


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        state = train(args)
    except TrainError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(state), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
