"""Shared pieces of the training tools: corpus files, token arrays, batches,
learning-rate schedule, resumable checkpoints and Hugging Face export.

Everything here is deterministic given a seed: file order is sorted, the
held-out split is a fixed rule on that order, and the batch for step ``s`` is
drawn from a generator seeded with ``(seed, s)``, so a resumed run sees the
same batches as an uninterrupted one.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch

from engine.models.cpu_linear import cpu_has_fast_bf16

HELD_OUT_EVERY = 50  # every 50th file (sorted order, index % 50 == 0) is held out
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "generation_config.json",
)


class TrainError(Exception):
    """A problem with the inputs of a training tool, with a message for the user."""


# ----------------------------------------------------------------------------- corpus


def numbered_jsonl(path):
    """(line number, object) for each non-blank line of a JSONL file; a line that is not JSON is a
    TrainError naming it."""
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield number, json.loads(line)
            except json.JSONDecodeError as exc:
                raise TrainError(f"{path}:{number}: not JSON ({exc})") from None


def read_jsonl(path) -> list:
    return [row for _, row in numbered_jsonl(path)]


def corpus_files(paths: list[str | Path], pattern: str | None = None,
                 exclude: list[str] | None = None) -> list[Path]:
    """Expand files and directories into a sorted list of text files.

    A directory contributes every file matching ``pattern`` (default: all
    files, skipping hidden ones and obvious binaries) below it, except those
    with a path component named in ``exclude`` (e.g. site-packages)."""
    skip = set(exclude or ())
    if not paths:
        raise TrainError("no corpus given: pass one or more text files or directories")
    files: list[Path] = []
    for raw in paths:
        path = Path(raw)
        if not path.exists():
            raise TrainError(f"corpus path does not exist: {path}")
        if path.is_file():
            files.append(path)
            continue
        found = sorted(path.rglob(pattern or "*"))
        for f in found:
            parts = f.relative_to(path).parts
            if not f.is_file() or any(part.startswith(".") or part in skip for part in parts):
                continue
            if pattern is None and f.suffix in {".pyc", ".so", ".bin", ".safetensors", ".npy", ".pt"}:
                continue
            files.append(f)
    files = sorted(set(files), key=lambda p: p.as_posix())
    if not files:
        raise TrainError(f"corpus is empty: no files found under {', '.join(map(str, paths))}")
    return files


def split_files(files: list[Path], every: int = HELD_OUT_EVERY) -> tuple[list[Path], list[Path]]:
    """Deterministic held-out split: file i (in the given sorted order) is held
    out when i % every == 0. With a single file nothing is held out here; the
    caller then holds out the tail of its tokens instead."""
    if len(files) < 2:
        return list(files), []
    every = max(2, min(every, len(files)))
    train = [f for i, f in enumerate(files) if i % every != 0]
    held = [f for i, f in enumerate(files) if i % every == 0]
    return train, held


def read_text(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


def tokenize_files(tokenizer, files: list[Path], eos_id: int, batch: int = 256) -> np.ndarray:
    """Token ids of every file, each followed by ``eos_id``, concatenated.

    ``tokenizer`` is a ``tokenizers.Tokenizer`` (fast, batched)."""
    chunks: list[np.ndarray] = []
    for start in range(0, len(files), batch):
        texts = [read_text(f) for f in files[start : start + batch]]
        for enc in tokenizer.encode_batch(texts, add_special_tokens=False):
            chunks.append(np.asarray(enc.ids + [eos_id], dtype=np.int64))
    if not chunks:
        return np.zeros(0, dtype=np.uint16)
    ids = np.concatenate(chunks)
    dtype = np.uint16 if ids.max(initial=0) < 2**16 else np.int32
    return ids.astype(dtype)


# ----------------------------------------------------------------------------- batches


def sample_batch(tokens: np.ndarray, step: int, seed: int, batch_size: int, seq_len: int) -> torch.Tensor:
    """``[batch_size, seq_len + 1]`` random windows; the same for the same (seed, step)."""
    n = len(tokens) - seq_len - 1
    if n <= 0:
        raise TrainError(f"corpus too small: {len(tokens)} tokens for windows of {seq_len + 1}")
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, n + 1, size=batch_size)
    rows = np.stack([tokens[s : s + seq_len + 1] for s in starts]).astype(np.int64)
    return torch.from_numpy(rows)


def eval_windows(tokens: np.ndarray, seq_len: int, max_windows: int) -> torch.Tensor:
    """Fixed non-overlapping ``[n, seq_len + 1]`` windows from the start of the held-out tokens."""
    n = min(max_windows, (len(tokens) - 1) // seq_len)
    if n <= 0:
        raise TrainError(f"held-out slice too small: {len(tokens)} tokens for windows of {seq_len + 1}")
    rows = [tokens[i * seq_len : i * seq_len + seq_len + 1] for i in range(n)]
    return torch.from_numpy(np.stack(rows).astype(np.int64))


# ----------------------------------------------------------------------------- schedule / precision


def cosine_lr(step: int, total: int, peak: float, warmup: int, min_ratio: float = 0.1) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def scheduled_lr(cfg, step: int, time_fraction: float | None) -> float:
    """Warmup then cosine (cfg: lr, warmup, steps, min_lr_ratio), over steps or (with a time budget)
    over the elapsed fraction of it."""
    if time_fraction is None or step < cfg.warmup:
        return cosine_lr(step, cfg.steps, cfg.lr, cfg.warmup, cfg.min_lr_ratio)
    return cosine_lr(1000 + int(9000 * min(time_fraction, 1.0)), 10000, cfg.lr, 1000, cfg.min_lr_ratio)


def adamw(model, cfg) -> torch.optim.AdamW:
    """AdamW over model's parameters (cfg: lr, weight_decay), no decay on vectors (norms, biases)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr, betas=(0.9, 0.95),
    )


def train_device(name: str) -> torch.device:
    """``auto`` (cuda when present), or a device name."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def progress_bar(cfg, start: int, desc: str):
    """A step counter (cfg: steps, time_budget_min, progress): open-ended under a time budget, and
    quiet (every 30 s) when stderr is not a terminal."""
    from tqdm import tqdm

    return tqdm(total=None if cfg.time_budget_min else cfg.steps, initial=start, desc=desc, unit="step",
                disable=not cfg.progress, mininterval=1.0 if sys.stderr.isatty() else 30.0, dynamic_ncols=True)


def add_run_options(p, defaults) -> None:
    """The flags every trainer shares: optimiser, precision, device, threads, resuming, budget, progress."""
    for name in ("lr", "min_lr_ratio", "weight_decay", "grad_clip"):
        p.add_argument("--" + name.replace("_", "-"), type=float, default=getattr(defaults, name))
    p.add_argument("--precision", choices=["auto", "bf16", "fp32"], default=defaults.precision,
                   help="bf16 autocast or fp32 (auto: bf16 on CUDA, and on CPUs with native bf16)")
    p.add_argument("--device", default=defaults.device, help="auto (cuda when present), cpu, cuda, cuda:1, ...")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--resume", action="store_true", help="continue from <out>/checkpoint")
    p.add_argument("--time-budget-min", type=float, default=0.0,
                   help="train for this many minutes (cosine LR over elapsed time) instead of --steps")
    p.add_argument("--stop-at", type=int, default=None, help="stop after this step (resume later)")
    p.add_argument("--no-progress", dest="progress", action="store_false")


def resolve_precision(precision: str, device: torch.device) -> bool:
    """``auto`` | ``bf16`` | ``fp32`` -> whether to use bf16 autocast."""
    if precision == "bf16":
        return True
    if precision == "fp32":
        return False
    return device.type == "cuda" or (device.type == "cpu" and cpu_has_fast_bf16())


def autocast(device: torch.device, enabled: bool = True):
    if not enabled:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)


def set_seed(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)


# ----------------------------------------------------------------------------- checkpoints


def copy_tokenizer_files(src: Path, dst: Path) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if name == "generation_config.json":
            continue
        if (Path(src) / name).exists():
            shutil.copy2(Path(src) / name, dst / name)


def save_checkpoint(ckpt_dir: Path, model, optimizer, state: dict, tokenizer_dir: Path | None) -> None:
    """Atomically write a resumable checkpoint: an HF model directory (fp32
    weights, loadable by from_pretrained) + optimizer.pt + state.json."""
    ckpt_dir = Path(ckpt_dir)
    tmp = ckpt_dir.with_name(ckpt_dir.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp, safe_serialization=True)
    if tokenizer_dir is not None:
        copy_tokenizer_files(tokenizer_dir, tmp)
    torch.save(
        {"optimizer": optimizer.state_dict(), "torch_rng": torch.get_rng_state()},
        tmp / "optimizer.pt",
    )
    (tmp / "state.json").write_text(json.dumps(state, indent=2))
    old = ckpt_dir.with_name(ckpt_dir.name + ".old")
    if ckpt_dir.exists():
        if old.exists():
            shutil.rmtree(old)
        ckpt_dir.rename(old)
    tmp.rename(ckpt_dir)
    if old.exists():
        shutil.rmtree(old)


def load_checkpoint_state(ckpt_dir: Path, optimizer) -> dict:
    blob = torch.load(Path(ckpt_dir) / "optimizer.pt", map_location="cpu", weights_only=False)
    optimizer.load_state_dict(blob["optimizer"])
    torch.set_rng_state(blob["torch_rng"])
    return json.loads((Path(ckpt_dir) / "state.json").read_text())


def export_model(model, out_dir: Path, tokenizer_dir: Path | None, dtype: torch.dtype = torch.bfloat16) -> int:
    """Save a serving copy (weights cast to ``dtype``) as an HF directory; returns its size in bytes."""
    import copy

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    clone = copy.deepcopy(model).to(dtype)
    clone.save_pretrained(out_dir, safe_serialization=True)
    if tokenizer_dir is not None:
        copy_tokenizer_files(tokenizer_dir, out_dir)
    return sum(f.stat().st_size for f in out_dir.iterdir() if f.is_file())


def count_params(model) -> int:
    """Unique parameters (tied embeddings counted once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


class Throughput:
    """Tokens per second over a sliding window of recent steps."""

    def __init__(self, window: int = 20):
        self.window = window
        self.events: list[tuple[float, int]] = []

    def update(self, num_tokens: int) -> float:
        self.events.append((time.perf_counter(), num_tokens))
        self.events = self.events[-self.window :]
        if len(self.events) < 2:
            return 0.0
        elapsed = self.events[-1][0] - self.events[0][0]
        return sum(n for _, n in self.events[1:]) / max(elapsed, 1e-9)


def set_threads(num_threads: int | None) -> None:
    if num_threads:
        torch.set_num_threads(num_threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
