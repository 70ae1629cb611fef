#!/usr/bin/env bash
# The device check, as one prepared run on a GPU machine (run from the repository root):
#   - the `gpu`-marked tests (flash-attn path vs torch path, engine on CUDA vs CPU, CUDA graphs);
#   - the engine-level suites with the engine on CUDA (device "auto" picks it): losslessness, the
#     chi-square tests, accounting, sampler, KV cache, model parity;
#   - bench/bench_engine.py (ours vs transformers generate on the same GPU, batching) and
#     bench/bench_spec.py (speedup at controlled acceptance against the theory; fp32, as it checks that
#     speculative greedy output equals plain, which bf16 rounding breaks).
# Results go to $OUT (set by the device tool) or ./gpu-results. Needs torch with CUDA, transformers,
# pytest, scipy; no server packages (fastapi, uvicorn) and no network.
set -o pipefail
OUT=${OUT:-gpu-results}
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
{ nvidia-smi -L; lscpu | grep 'Model name'
  python -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
} 2>&1 | tee "$OUT/env.txt"
python -m pytest -q -p no:cacheprovider -rs tests/test_gpu.py 2>&1 | tee "$OUT/gpu_tests.txt"
timeout 300 python -m pytest -q -p no:cacheprovider -rxs tests/test_spec_decode.py tests/test_controller.py tests/test_engine.py \
    tests/test_rejection.py tests/test_sampler.py tests/test_kv_cache.py tests/test_models.py 2>&1 \
    | tee "$OUT/engine_tests.txt"
timeout 200 python bench/bench_engine.py --dtype bfloat16 --new-tokens 128 --cuda-graphs 2>&1 | tee "$OUT/bench_engine.txt"
timeout 240 python bench/bench_spec.py --dtype float32 --alphas 0,0.5,0.9 --batches 1,16 2>&1 | grep -v 'Writing\|Loading' | tee "$OUT/bench_spec.txt"
