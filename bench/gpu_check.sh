#!/usr/bin/env bash
# The device check, as one prepared run on a GPU machine (run from the repository root), most
# valuable first, every part cut short at a shared deadline (GPU_CHECK_SECONDS, default 480):
#   1. the `gpu`-marked tests (flash-attn path vs torch path, engine on CUDA vs CPU, CUDA graphs,
#      draft trees in graphs);
#   2. bench/gpu_scale.py: a Llama-3.1-8B-shaped target (random weights, load_format dummy) in bf16
#      with CUDA graphs: plain decoding at batch 1 and 16 against the bandwidth bound, a pass's cost
#      by its rows, and the oracle sweep of chains against trees;
#   3. bench/bench_engine.py: ours vs transformers generate on the same GPU, batching, and the
#      engine with cuda_graphs beside the eager one;
#   4. the server on CUDA (engine core in its own process, and on a thread; with and without CUDA
#      graphs) against the offline engine, through bench/serve_bench.py: needs the server packages,
#      installed from wheels in .cache/gpu/wheels (the device reaches no registry), and the default
#      target's tokenizer and config in .cache/gpu/tokenizer (its weights are random here: the
#      real ones are too large to carry, and plain decoding costs the same);
#   5. bench/bench_spec.py with CUDA graphs (speedup at controlled acceptance; fp32, as it checks
#      that speculative greedy output equals plain, which bf16 rounding breaks);
#   6. engine-level suites with the engine on CUDA (device "auto" picks it), cheapest first.
# GPU_CHECK_PARTS (comma-separated names: gpu_tests, scale, bench_engine, serve, bench_spec, engine_tests)
# runs only those. Results go to $OUT (set by the device tool) or ./gpu-results. Prepare the carried files with
#   pip download --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
#       --implementation cp --abi cp312 fastapi uvicorn pydantic -d .cache/gpu/wheels
#   cp .cache/models/smollm2-135m-instruct/{tokenizer*.json,chat_template.jinja,*config.json} .cache/gpu/tokenizer/
set -o pipefail
OUT=${OUT:-gpu-results}
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
DEADLINE=$((SECONDS + ${GPU_CHECK_SECONDS:-480}))
PARTS=",${GPU_CHECK_PARTS:-gpu_tests,scale,bench_engine,serve,bench_spec,engine_tests},"

# part LIMIT NAME COMMAND...: run COMMAND for at most LIMIT seconds (less if the deadline is nearer),
# its output in $OUT/NAME.txt.
part() {
    local limit=$1 name=$2 left=$((DEADLINE - SECONDS))
    shift 2
    [[ $PARTS == *",$name,"* ]] || return 0
    if (( left < 30 )); then echo "$name: skipped, out of time" | tee "$OUT/$name.txt"; return; fi
    (( limit > left )) && limit=$left
    echo "== $name (at most ${limit}s)"
    timeout "$limit" "$@" 2>&1 | grep -v 'Writing\|Loading' | tee "$OUT/$name.txt"
    echo "== $name: exit ${PIPESTATUS[0]} at ${SECONDS}s" | tee -a "$OUT/$name.txt"
}

serve_check() {
    local target=/tmp/gpu-target config=/tmp/gpu-serve.yaml
    python -m pip install -q --no-index --find-links .cache/gpu/wheels fastapi uvicorn pydantic || return 1
    python -c "import fastapi, uvicorn, pydantic" || return 1
    python - "$target" <<'EOF' || return 1
import shutil, sys, torch
from pathlib import Path
from transformers import AutoConfig, AutoModelForCausalLM
out, src = Path(sys.argv[1]), Path(".cache/gpu/tokenizer")
torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(src)).to(torch.bfloat16)
model.save_pretrained(out)
for f in src.iterdir():
    if f.name != "config.json":
        shutil.copy(f, out / f.name)
EOF
    printf 'model: %s\nserved_model_name: specserve-default\ndtype: bfloat16\nspeculative:\n  method: none\n' \
        "$target" > "$config"
    python bench/serve_bench.py --config "$config" --concurrency ${SERVE_CONCURRENCY:-1,16} --variants ${SERVE_VARIANTS:-ours,graphs} \
        --peers ""
}

{ nvidia-smi -L; lscpu | grep 'Model name'
  python -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
} 2>&1 | tee "$OUT/env.txt"
part 120 gpu_tests python -m pytest -q -p no:cacheprovider -rs tests/test_gpu.py
part 180 scale python bench/gpu_scale.py --out "$OUT/scale.json"
part 150 bench_engine python bench/bench_engine.py --dtype bfloat16 --new-tokens 128 --cuda-graphs
export -f serve_check
part 300 serve bash -c serve_check
part 150 bench_spec python bench/bench_spec.py --dtype float32 --alphas 0.5,0.9 --batches 1,16 --repeats 2 \
    --skip shift --cuda-graphs
# The whole engine-level suites took over 250 s on the H200 for 32 tests (each builds and calibrates
# small engines): the cheaper files first, slow-marked tests left out.
part 300 engine_tests python -m pytest -q -p no:cacheprovider -rxs -m "not slow" tests/test_rejection.py \
    tests/test_sampler.py tests/test_kv_cache.py tests/test_decode_grid.py tests/test_engine.py \
    tests/test_spec_decode.py
