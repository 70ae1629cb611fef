"""specserve train-default: rebuild the embedded default model pair in models/.

    specserve train-default [--run-dir runs/default] [--models-dir models] [--target-steps 360] ...

Steps (each skips work already done, so an interrupted recipe resumes):
  1. tokenizer  byte-level BPE (vocab 8192) on the running interpreter's stdlib *.py
                (not site-packages); every 50th file (sorted) is held out
  2. target     a ~16M-parameter Llama, next-token cross-entropy   -> <run-dir>/target-ckpt
  3. export     target weights in bf16                               -> <models-dir>/default-target
  4. draft      a ~2M-parameter Llama (2 layers) distilled from the exported target
                with `specserve distill` (forward KL)                -> <models-dir>/default-draft
  5. report     held-out losses, acceptance, expected tokens/step, and the acceptance
                measured in specserve's engine                       -> <models-dir>/README.md, default_stats.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

from train.common import TrainError, count_params, export_model, stdlib_dir

CONFIG_YAML = """\
# The embedded default pair, rebuilt by `specserve train-default` (see models/README.md).
model: models/default-target
served_model_name: specserve-default
dtype: auto
speculative:
  method: draft
  model: models/default-draft
  num_speculative_tokens: 4
"""
MAX_MODELS_BYTES = 64 * 2**20


def parse_args(argv):
    p = argparse.ArgumentParser(prog="specserve train-default", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run-dir", default="runs/default", help="work directory (checkpoints, token caches)")
    p.add_argument("--models-dir", default="models")
    p.add_argument("--config-out", default="configs/default.yaml")
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--target-steps", type=int, default=360)
    p.add_argument("--target-time-min", type=float, default=64.0,
                   help="train the target for this many minutes (time-based cosine) instead of --target-steps")
    p.add_argument("--target-args", default="", help="extra arguments for train.pretrain, quoted")
    p.add_argument("--draft-steps", type=int, default=300)
    p.add_argument("--draft-time-min", type=float, default=52.0,
                   help="distill for this many minutes (time-based cosine) instead of --draft-steps")
    p.add_argument("--draft-layers", type=int, default=2)
    p.add_argument("--draft-hidden", type=int, default=160)
    p.add_argument("--draft-heads", type=int, default=5)
    p.add_argument("--draft-kv-heads", type=int, default=1)
    p.add_argument("--draft-intermediate", type=int, default=448)
    p.add_argument("--draft-lr", type=float, default=3e-3)
    p.add_argument("--draft-batch-size", type=int, default=8)
    p.add_argument("--eval-windows", type=int, default=96, help="held-out windows of 256 tokens for the report")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def step_tokenizer(args, run_dir: Path) -> Path:
    from train.tokenizer import build_default_tokenizer

    print("[1/5] tokenizer", flush=True)
    return build_default_tokenizer(run_dir / "tokenizer", args.vocab_size)


def step_target(args, run_dir: Path) -> dict:
    from train import pretrain

    ckpt = run_dir / "target-ckpt"
    state_path = ckpt / "state.json"
    state = json.loads(state_path.read_text()) if state_path.exists() else None
    if state and (state["train_seconds"] >= 60 * args.target_time_min if args.target_time_min
                  else state["step"] >= args.target_steps):
        print(f"[2/5] target: done ({ckpt})", flush=True)
    else:
        print("[2/5] target: training (resumes from its checkpoint)", flush=True)
        argv = ["--run-dir", str(run_dir), "--max-steps", str(args.target_steps), "--threads", str(args.threads),
                "--seed", str(args.seed), "--resume", *args.target_args.split()]
        if args.target_time_min:
            argv += ["--time-budget-min", str(args.target_time_min)]
        if pretrain.main(argv) != 0:
            raise TrainError("target pretraining failed")
    return json.loads(state_path.read_text())


def step_export_target(run_dir: Path, models_dir: Path) -> Path:
    from transformers import AutoModelForCausalLM

    print("[3/5] export target (bf16)", flush=True)
    out = models_dir / "default-target"
    if out.exists():
        shutil.rmtree(out)
    model = AutoModelForCausalLM.from_pretrained(run_dir / "target-ckpt")
    export_model(model, out, run_dir / "tokenizer")
    return out


def step_draft(args, run_dir: Path, target_dir: Path, models_dir: Path) -> dict:
    from train.distill import DistillConfig, distill

    print("[4/5] draft: distilling (resumes from its checkpoint)", flush=True)
    out = run_dir / "draft"
    cfg = DistillConfig(
        target=str(target_dir), corpus=[str(stdlib_dir())], pattern="*.py",
        exclude=["site-packages", "dist-packages"], out=str(out),
        draft_layers=args.draft_layers, draft_hidden=args.draft_hidden, draft_heads=args.draft_heads,
        draft_kv_heads=args.draft_kv_heads, draft_intermediate=args.draft_intermediate,
        steps=args.draft_steps, batch_size=args.draft_batch_size, seq_len=256, lr=args.draft_lr,
        warmup=20, eval_windows=args.eval_windows, save_dtype="bfloat16", seed=args.seed,
        threads=args.threads, ckpt_every=25, resume=True, time_budget_min=args.draft_time_min,
    )
    stats_path = out / "distill_stats.json"
    if stats_path.exists() and (args.draft_time_min or json.loads(stats_path.read_text())["steps"] >= args.draft_steps):
        stats = json.loads(stats_path.read_text())
    else:
        stats = distill(cfg)
        if stats.get("stopped"):
            raise TrainError("draft distillation stopped early; rerun to resume")
    dest = models_dir / "default-draft"
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    for f in out.iterdir():
        if f.is_file() and f.name != "distill_stats.json":
            shutil.copy2(f, dest / f.name)
    return stats


def engine_acceptance(run_dir: Path, models_dir: Path, num_prompts: int = 8, prompt_len: int = 64,
                      max_tokens: int = 64) -> dict:
    """Greedy speculative generation in specserve's own engine (fp32, gamma 4) from
    prompts cut from the held-out files: the acceptance the server will see."""
    import numpy as np

    try:
        from engine.llm import LLM
        from engine.sampling_params import SamplingParams

        held = np.load(run_dir / "data" / "val.npy")
        stride = len(held) // num_prompts
        prompts = [held[i * stride : i * stride + prompt_len].astype(int).tolist() for i in range(num_prompts)]
        llm = LLM(model=str(models_dir / "default-target"), dtype="float32", skip_tokenizer_init=True,
                  speculative={"method": "draft", "model": str(models_dir / "default-draft"),
                               "num_speculative_tokens": 4})
        outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    except Exception as exc:  # the engine is optional for the recipe; report why it was skipped
        return {"skipped": f"{type(exc).__name__}: {exc}"}
    proposed = sum(o.spec.proposed for o in outs)
    accepted = sum(o.spec.accepted for o in outs)
    forwards = sum(o.spec.target_forwards for o in outs)
    return {"prompts": num_prompts, "max_tokens": max_tokens, "gamma": 4, "proposed": proposed,
            "accepted": accepted, "acceptance": round(accepted / max(proposed, 1), 4),
            "tokens_per_target_forward": round(sum(len(o.token_ids) for o in outs) / max(forwards, 1), 3)}


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).iterdir() if f.is_file())


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    run_dir, models_dir = Path(args.run_dir), Path(args.models_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    try:
        step_tokenizer(args, run_dir)
        target_state = step_target(args, run_dir)
        target_dir = step_export_target(run_dir, models_dir)
        draft_stats = step_draft(args, run_dir, target_dir, models_dir)
    except TrainError as exc:
        raise SystemExit(f"specserve train-default: error: {exc}") from None
    print("[5/5] report", flush=True)
    stats = collect_stats(args, run_dir, models_dir, target_state, draft_stats)
    stats["engine"] = engine_acceptance(run_dir, models_dir)
    (models_dir / "default_stats.json").write_text(json.dumps(stats, indent=2) + "\n")
    (models_dir / "README.md").write_text(render_readme(stats))
    config_out = Path(args.config_out)
    config_out.parent.mkdir(parents=True, exist_ok=True)
    config_out.write_text(CONFIG_YAML)
    total = stats["models_bytes"]
    print(f"done in {time.time() - t0:.0f}s; models {total / 2**20:.1f} MiB", flush=True)
    if total > MAX_MODELS_BYTES:
        print(f"warning: models are {total / 2**20:.1f} MiB, over the 64 MiB budget", file=sys.stderr)
    return 0


def collect_stats(args, run_dir: Path, models_dir: Path, target_state: dict, draft: dict) -> dict:
    from transformers import AutoConfig

    tconf = AutoConfig.from_pretrained(models_dir / "default-target")
    dconf = AutoConfig.from_pretrained(models_dir / "default-draft")
    data = json.loads((run_dir / "data" / "files.json").read_text())

    def shape(c):
        return {"layers": c.num_hidden_layers, "hidden": c.hidden_size, "heads": c.num_attention_heads,
                "kv_heads": c.num_key_value_heads, "intermediate": c.intermediate_size, "vocab": c.vocab_size}

    return {
        "corpus": {"source": f"Python {sys.version.split()[0]} stdlib *.py ({stdlib_dir()})",
                   "train_files": data["train_files"], "held_out_files": data["held_out_files"],
                   "train_tokens": draft["corpus"]["train_tokens"],
                   "held_out_tokens": draft["corpus"]["held_out_tokens"],
                   "held_out_rule": "sorted file index % 50 == 0"},
        "target": {"params": draft["target_params"], "shape": shape(tconf), "steps": target_state["step"],
                   "train_tokens": target_state["tokens"],
                   "train_minutes": round(target_state["train_seconds"] / 60, 1),
                   "precision": target_state.get("precision", "fp32"),
                   "held_out_loss": draft["after"]["target_loss"]},
        "draft": {"params": draft["draft_params"], "shape": shape(dconf), "steps": draft["steps"],
                  "train_tokens": draft["train_tokens"], "train_minutes": round(draft["train_seconds"] / 60, 1),
                  "loss": draft["loss"], "held_out_loss": draft["after"]["draft_loss"],
                  "held_out_loss_before": draft["before"]["draft_loss"]},
        "acceptance": {"gamma": draft["after"]["gamma"], "positions": draft["after"]["positions"],
                       "before": draft["before"]["acceptance"], "after": draft["after"]["acceptance"],
                       "expected_tokens_per_step_before": draft["before"]["expected_tokens_per_step"],
                       "expected_tokens_per_step_after": draft["after"]["expected_tokens_per_step"],
                       "kl_before": draft["before"]["kl"], "kl_after": draft["after"]["kl"]},
        "models_bytes": dir_bytes(models_dir / "default-target") + dir_bytes(models_dir / "default-draft"),
        "recipe_args": vars(args),
    }


def render_readme(s: dict) -> str:
    t, d, a, c = s["target"], s["draft"], s["acceptance"], s["corpus"]
    total_minutes = t["train_minutes"] + d["train_minutes"]
    e = s.get("engine", {})
    engine_line = "" if "acceptance" not in e else (
        f"\nIn specserve's own engine (fp32, greedy, gamma {e['gamma']}, {e['prompts']} prompts cut from the\n"
        f"held-out files, {e['max_tokens']} new tokens each) the target accepted {e['accepted']} of\n"
        f"{e['proposed']} drafted tokens ({e['acceptance']:.3f}), {e['tokens_per_target_forward']:.2f} tokens "
        f"per target forward pass.\n")
    precision_note = "" if t["precision"] == "bf16" else (
        " (bf16 autocast is used only where the CPU has native bf16, AVX512-BF16 or AMX; on these\n"
        "  AVX2-only cores torch emulates bf16 matmuls about 25x slower than fp32)")

    def shape(x):
        return (f"{x['layers']} layers, hidden {x['hidden']}, {x['heads']} heads / {x['kv_heads']} KV heads, "
                f"MLP {x['intermediate']}, vocab {x['vocab']}, tied embeddings")

    return f"""# The embedded default model pair

`default-target` and `default-draft` are small Llama-architecture code models made by this
repository's own recipe, so anyone can rebuild them offline:

    specserve train-default          # or: python -m train.default

`configs/default.yaml` serves them with speculative method `draft`, gamma 4. Weights are bf16
safetensors ({s['models_bytes'] / 2**20:.1f} MiB for both); both directories carry the same tokenizer.

## Recipe

- **Corpus**: {c['source']}; {c['train_files']} training files ({c['train_tokens']:,} tokens),
  {c['held_out_files']} held-out files ({c['held_out_tokens']:,} tokens), held out by {c['held_out_rule']}.
- **Tokenizer**: byte-level BPE (`tokenizers`), vocab {t['shape']['vocab']}, trained on the training files only;
  `<|endoftext|>` ends each file (eos/bos), `<|pad|>` pads; a plain `# role:` chat template.
- **Target**: {shape(t['shape'])}; {t['params'] / 1e6:.2f}M parameters; next-token cross-entropy, AdamW,
  cosine LR, {t['steps']} steps, {t['train_tokens']:,} training tokens, {t['train_minutes']} min on 2 shared
  CPU cores in {t['precision']}{precision_note}.
- **Draft**: {shape(d['shape'])}; {d['params'] / 1e6:.2f}M parameters ({d['params'] / t['params']:.0%} of the
  target), embeddings started from a PCA projection of the target's, then `specserve distill` with
  forward KL(target || draft) for {d['steps']} steps, {d['train_tokens']:,} tokens, {d['train_minutes']} min.

## Figures (held-out files, {a['positions']:,} teacher-forced positions, bf16 weights as served)

| | target | draft |
| --- | --- | --- |
| parameters | {t['params']:,} | {d['params']:,} |
| training tokens | {t['train_tokens']:,} | {d['train_tokens']:,} |
| training time | {t['train_minutes']} min | {d['train_minutes']} min |
| held-out loss (nats/token) | {t['held_out_loss']:.3f} | {d['held_out_loss']:.3f} (before distillation {d['held_out_loss_before']:.3f}) |

| draft vs target, gamma {a['gamma']} | before distillation | after |
| --- | --- | --- |
| greedy acceptance rate | {a['before']:.3f} | {a['after']:.3f} |
| expected tokens per verification step | {a['expected_tokens_per_step_before']:.2f} | {a['expected_tokens_per_step_after']:.2f} |
| KL(target \\|\\| draft), nats | {a['kl_before']:.3f} | {a['kl_after']:.3f} |

Greedy acceptance is the fraction of held-out positions where the draft's argmax equals the
target's, with both fed the same held-out text. Expected tokens per step is
(1 - a^(g+1)) / (1 - a), which assumes every position is accepted independently with
probability a; real runs differ because acceptance is correlated along a sequence.
{engine_line}

These are tiny models trained for {total_minutes:.0f} minutes in all on two CPU cores: they produce
Python-flavoured text, not useful code. They exist so that the server, the tests and the
benchmarks have a real speculative pair with a realistic acceptance rate, without downloads.
Figures are in `default_stats.json`.
"""


if __name__ == "__main__":
    raise SystemExit(main())
