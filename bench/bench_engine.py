"""Engine benchmark: ours vs transformers at batch 1, the memory-bandwidth bound, and batching.

Builds a random ~270M-parameter Llama (hidden 1024, 16 layers, vocab 32000) and prints,
measured side by side in one run on the same prompts:
  * our greedy decode tokens/s at batch 1 and transformers' generate() tokens/s, and the ratio;
  * the bandwidth bound (weight bytes streamed per token / measured read bandwidth) and our fraction;
  * our total tokens/s with 1, 4 and 16 concurrent requests.

    python bench/bench_engine.py [--dtype auto|float32|bfloat16] [--new-tokens 64]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import checkpoint_param_counts, random_llama, read_bandwidth, timed  # noqa: E402

from engine import LLM, SamplingParams  # noqa: E402


def prompts(n: int, length: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 32000, (length,), generator=g).tolist() for _ in range(n)]


def ours_tokens_per_s(llm: LLM, batch: list[list[int]], new_tokens: int, repeats: int) -> float:
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    seconds = timed(lambda: llm.generate(batch, params), repeats)
    return len(batch) * new_tokens / seconds


def hf_tokens_per_s(path: str, dtype: torch.dtype, device: torch.device, prompt: list[int], new_tokens: int,
                    repeats: int) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    ids = torch.tensor([prompt], device=device)

    def run():
        with torch.inference_mode():
            model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new_tokens,
                           min_new_tokens=new_tokens, pad_token_id=0)
    return new_tokens / timed(run, repeats)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--cuda-graphs", action="store_true",
                        help="GPU: also run an engine with cuda_graphs and print its ratio to the eager one")
    parser.add_argument("--model-dir", default=os.path.join(tempfile.gettempdir(), "specserve-bench", "target"))
    args = parser.parse_args(argv)

    path = random_llama(args.model_dir)
    llm = LLM(path, dtype=args.dtype, skip_tokenizer_init=True, max_num_seqs=16)
    dtype, device = llm.engine.dtype, llm.engine.device
    num_params, num_streamed = checkpoint_param_counts(path)
    print(f"model: random Llama, {num_params / 1e6:.0f}M params, "
          f"dtype {str(dtype).replace('torch.', '')} (auto picks bf16 only where the CPU has native bf16), "
          f"device {device}, {torch.get_num_threads()} CPU threads")
    batch1 = prompts(1, args.prompt_len)
    ours = ours_tokens_per_s(llm, batch1, args.new_tokens, args.repeats)
    theirs = hf_tokens_per_s(path, dtype, device, batch1[0], args.new_tokens, args.repeats)
    weight_bytes = num_streamed * torch.tensor([], dtype=dtype).element_size()
    bandwidth = read_bandwidth(device=device)
    bound = bandwidth / weight_bytes
    print(f"batch 1 greedy decode: ours {ours:.2f} tok/s, transformers {theirs:.2f} tok/s, ratio {ours / theirs:.2f}x")
    print(f"bandwidth bound: {weight_bytes / 1e9:.2f} GB of weights per token at {bandwidth / 1e9:.1f} GB/s "
          f"-> {bound:.2f} tok/s; ours reaches {ours / bound:.0%} of it")
    results = {1: ours}
    for n in (4, 16):
        results[n] = ours_tokens_per_s(llm, prompts(n, args.prompt_len), args.new_tokens, args.repeats)
    for n, tps in results.items():
        print(f"{n:2d} concurrent requests: {tps:7.2f} tok/s total ({tps / results[1]:.2f}x batch 1)")
    if args.cuda_graphs:
        graphs = LLM(path, dtype=args.dtype, skip_tokenizer_init=True, max_num_seqs=16, cuda_graphs=True)
        for n in results:
            tps = ours_tokens_per_s(graphs, prompts(n, args.prompt_len), args.new_tokens, args.repeats)
            print(f"{n:2d} concurrent requests, cuda_graphs: {tps:7.2f} tok/s total ({tps / results[n]:.2f}x eager)")


if __name__ == "__main__":
    main()
