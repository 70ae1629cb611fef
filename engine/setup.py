"""Start-up: pick device and dtype, load target (and draft, EAGLE head), size the KV cache, build runners."""
from __future__ import annotations

import json
import logging
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.attention import FLASH_BLOCK_SIZE
from engine.attention_backends import choose_backend, uses_flash
from engine.cpu_kernels import fused_ops_usable
from engine.config import DraftConfig, EngineConfig, SpeculativeConfig
from engine.kv_cache import BlockPool
from engine.model_runner import ModelRunner
from engine.models.eagle import load_eagle_head
from engine.models.cpu_linear import cpu_has_fast_bf16, pack_linears, packed_linear_available
from engine.models.llama import use_fused_cpu_ops
from engine.models import gguf_linear
from engine.models.gguf import find_gguf, open_gguf
from engine.models.parallel import check_shardable, local_config
from engine.tensor_parallel import ParallelRunner, finish_setup, rank_device, start_group
from engine.models.loader import check_same_tokenizer, load_hf_config, load_model, special_token_ids
from engine.models.streamed_linear import BLOCKED_ROWS, check_quantization, kernel_unavailable_reason, stream_linears
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledRequest
from engine.spec_decode.base import DraftJob, Proposal, Proposer, Router
from engine.spec_decode.draft_model import DraftModelProposer
from engine.spec_decode.eagle import EagleProposer
from engine.spec_decode.grammar import GrammarProposer
from engine.spec_decode.ngram import NgramProposer
from engine.spec_decode.policy import MODEL_PROPOSERS, GoodputPolicy, Policy, StaticPolicy
from engine.spec_decode.suffix import SuffixProposer
from engine.step_costs import StepCosts
from engine.verify import verify

logger = logging.getLogger("specserve.engine")

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
CALIBRATION_MAX_BATCH = 32


@dataclass
class EngineParts:
    device: torch.device
    dtype: torch.dtype
    target: ModelRunner
    proposer: Router
    policy: Policy
    costs: StepCosts
    pool: BlockPool
    max_model_len: int
    vocab_size: int
    eos_token_ids: frozenset[int]
    quantization: str


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available")
    return device


def resolve_dtype(name: str, hf_config, device: torch.device, quantization: str = "auto",
                  model_path: str | None = None) -> torch.dtype:
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cpu":
        return torch.float32 if _bf16_weights_in_fp32(quantization, model_path) else cpu_native_dtype()
    configured = getattr(hf_config, "torch_dtype", None) or getattr(hf_config, "dtype", None)
    configured = _DTYPES.get(str(configured).replace("torch.", ""), torch.bfloat16)
    return configured if configured != torch.float32 else torch.bfloat16


def tensor_parallel_dtype(config: EngineConfig, hf_config, device: torch.device) -> torch.dtype:
    """Every rank's dtype under tensor parallelism: its shard keeps unquantized linears (quantization none)."""
    return resolve_dtype(config.dtype, hf_config, device, "none", config.model)


def shard_config(hf_config, tensor_parallel_size: int):
    """The config of the target's part on one device: under tensor parallelism each rank's KV cache
    holds only its own KV heads, so the KV budget (per device) buys blocks by the shard's heads."""
    return local_config(hf_config, tensor_parallel_size) if tensor_parallel_size > 1 else hf_config


def cpu_native_dtype() -> torch.dtype:
    """The dtype torch's own ops compute fastest in on this CPU: bf16 only where it is native
    (AVX512-BF16 / AMX); elsewhere torch emulates bf16 slowly."""
    return torch.bfloat16 if cpu_has_fast_bf16() else torch.float32


def _bf16_weights_in_fp32(quantization: str, model_path: str | None) -> bool:
    """Whether dtype auto on a CPU computes in fp32 over bf16 weights (quantization auto then picks
    bf16): wherever the CPU kernels run. Without native bf16 that halves the bytes each decode step
    reads; with it, the kernel still decodes one row ~2x faster than oneDNN's bf16 linear, the fused
    ops replace ~60 torch ops a layer, and wider passes go through oneDNN's bf16 matmul anyway
    (StreamedLinear.native_rows): the default target measured 2.2x at batch 1 and 1.2-1.3x at
    batch 4-16 over native bf16 on an AVX512-BF16 EPYC. There the weights are held twice (the
    kernel's layout and oneDNN's packed one), so a model whose files take more than a quarter of
    memory keeps native bf16. int8 weights have no second copy; quantization none asks for the
    model's own weights, which the CPU then computes in its native dtype."""
    if quantization == "none" or kernel_unavailable_reason():
        return False
    if quantization in ("int8", "gguf") or not cpu_has_fast_bf16() or serves_gguf_blocks(model_path):
        return True
    return _weight_bytes(model_path) * 4 <= _memory_bytes()


def serves_gguf_blocks(model_path: str | None) -> bool:
    """Whether quantization auto serves this model from its GGUF blocks: a GGUF file with matrices of
    a kernel type (engine/models/gguf_linear.py), on a CPU with AVX512-VNNI (the portable loop is slower
    than dequantized bf16 weights)."""
    if not model_path or not gguf_linear.vnni_available():
        return False
    path = find_gguf(model_path)
    if path is None:
        return False
    checkpoint = open_gguf(path)
    return any(checkpoint.type_name(name) in gguf_linear.KERNEL_TYPES for name in checkpoint.tensor_names().values())


def _weight_bytes(model_path: str | None) -> int:
    if not model_path:
        return 0
    if os.path.isfile(model_path):
        return os.path.getsize(model_path)
    return sum(os.path.getsize(os.path.join(model_path, name)) for name in os.listdir(model_path)
               if name.endswith((".safetensors", ".gguf", ".bin")))


def _memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def resolve_quantization(name: str, dtype_name: str, dtype: torch.dtype, device: torch.device,
                         model_path: str | None = None) -> str:
    """auto: a quantized GGUF model's own blocks where the VNNI kernel runs (serves_gguf_blocks), else bf16
    weights through the CPU kernels where dtype auto chose fp32 on a CPU (see _bf16_weights_in_fp32);
    else none. Any other value is checked and kept."""
    if name != "auto":
        check_quantization(name, device)
        return name
    if device.type != "cpu" or dtype_name != "auto" or dtype != torch.float32:
        return "none"
    reason = kernel_unavailable_reason()
    if reason:
        logger.warning("quantization auto: serving fp32 weights, the bf16 weight kernel is unavailable (%s)", reason)
        return "none"
    return "gguf" if serves_gguf_blocks(model_path) else "bf16"


def draft_output_tokens(draft: DraftConfig, draft_config) -> torch.Tensor | None:
    """The token ids a draft vocabulary (`speculative.draft.vocab: N`) keeps: the first N and every
    special token (chat markers, end of text). BPE ids follow merge order, so the first ones are the
    frequent ones; a draft that cannot propose a token only loses that draft position (the target's
    token stands), and its proposal q, zero outside, keeps rejection sampling exact."""
    if draft.vocab is None or draft.vocab >= draft_config.vocab_size:
        return None
    ids = set(range(draft.vocab)) | {i for i in special_token_ids(draft.model) if i < draft_config.vocab_size}
    return torch.tensor(sorted(ids))


def _draft_requantization(draft: DraftConfig, device: torch.device) -> str | None:
    """The GGUF type the draft's linears are re-quantized into (`speculative.draft.quantization`), upper case;
    a CPU option: it serves them with the GGUF kernels."""
    if draft.quantization is None:
        return None
    if device.type != "cpu":
        raise ValueError(f"speculative.draft.quantization ({draft.quantization}) serves the draft with the CPU's GGUF "
                         f"kernels; the engine runs on {device}")
    reason = gguf_linear.unavailable_reason()
    if reason:
        raise ValueError(f"speculative.draft.quantization ({draft.quantization}) needs the CPU kernels: {reason}")
    if not gguf_linear.vnni_available():
        logger.warning("speculative.draft.quantization %s: no AVX512-VNNI here, the draft runs on the portable "
                       "(slow) GGUF loop", draft.quantization)
    return draft.quantization.upper()


def eos_token_ids(model_path: str, hf_config) -> frozenset[int]:
    ids = getattr(hf_config, "eos_token_id", None)
    generation_config = os.path.join(model_path, "generation_config.json")
    if os.path.isfile(generation_config):
        with open(generation_config) as f:
            ids = json.load(f).get("eos_token_id", ids)
    if ids is None:
        return frozenset()
    return frozenset([ids] if isinstance(ids, int) else ids)


@dataclass(frozen=True)
class ProposerInputs:
    """What a proposer is built from: the speculative settings, the target's vocabulary and runner,
    and the runners of the networks loaded for the model proposers (by name, built on first ask)."""
    spec: SpeculativeConfig
    vocab_size: int
    target: ModelRunner
    runners: dict[str, Callable[[], ModelRunner]]


# Every proposer by the name it drafts as, in the order the router asks them (and a static plan prefers
# them): a new proposer adds its module and its line here, and the engine reaches it through the Router.
PROPOSER_BUILDERS: dict[str, Callable[[ProposerInputs], Proposer]] = {
    "grammar": lambda p: GrammarProposer(),   # structured outputs' forced tokens: built whenever the engine drafts
    "draft": lambda p: DraftModelProposer(p.runners["draft"](), p.vocab_size, p.spec.draft.temperature),
    "eagle": lambda p: EagleProposer(p.runners["eagle"](), p.target, p.vocab_size, p.spec.draft.temperature),
    "ngram": lambda p: NgramProposer(p.spec.ngram.min, p.spec.ngram.max),
    "suffix": lambda p: SuffixProposer(p.spec.suffix.max_match, p.spec.suffix.cache_tokens, p.spec.suffix.min_prob,
                                       p.spec.suffix.min_score, p.spec.suffix.spec_factor),
}


def build_engine_parts(config: EngineConfig) -> EngineParts:
    spec = config.speculative
    device = resolve_device(config.device)
    hf_config = load_hf_config(config.model)
    tp = workers = None
    if config.tensor_parallel_size > 1:   # the target sharded over worker processes (engine/tensor_parallel.py)
        check_shardable(hf_config, config.tensor_parallel_size)
        device = rank_device(device, 0)
        tp, workers = start_group(config, device)
    dtype = tensor_parallel_dtype(config, hf_config, device) if tp else \
        resolve_dtype(config.dtype, hf_config, device, config.quantization, config.model)
    draft_dtype = _DTYPES[spec.draft.dtype] if spec.draft.dtype else dtype
    # Each runner decides from its own dtype: flash-attn has no fp32 kernels.
    target_flash = uses_flash(config.attention_backend, device, dtype)
    draft_flash = "draft" in spec.proposers and uses_flash(config.attention_backend, device, draft_dtype)
    block_size = config.block_size or (FLASH_BLOCK_SIZE if target_flash or draft_flash else 16)
    if (target_flash or draft_flash) and block_size % FLASH_BLOCK_SIZE:
        raise ValueError(f"block_size must be a multiple of {FLASH_BLOCK_SIZE} with flash-attn, got {block_size}")

    quantization = "none" if tp else resolve_quantization(config.quantization, config.dtype, dtype, device,
                                                          config.model)
    dummy = config.load_format == "dummy"
    target_model = load_model(config.model, dtype, device, gguf_blocks=quantization == "gguf", tensor_parallel=tp,
                              random_weights=dummy)
    draft_model = draft_config = head = None
    if "draft" in spec.proposers:
        draft_config = load_hf_config(spec.draft.model)
        check_same_tokenizer(config.model, hf_config, spec.draft.model, draft_config)
        requantize = _draft_requantization(spec.draft, device)
        draft_model = _prepared(load_model(spec.draft.model, draft_dtype, device, quantization == "gguf",
                                           draft_output_tokens(spec.draft, draft_config), requantize,
                                           random_weights=dummy), draft_dtype, device, quantization,
                                config.cpu_kernels)
    if "eagle" in spec.proposers:   # the head shares the target's embeddings and LM head: the target's dtype
        # Before the target is packed: a draft vocabulary copies rows of its LM head.
        head = _prepared(load_eagle_head(spec.draft.head, target_model, dtype, device), dtype, device, quantization,
                         config.cpu_kernels)
    verify_rows = 1 + max(spec.gamma, spec.tree_nodes)   # one request's largest pass: its last token and drafts
    if tp is None:   # a shard keeps plain linears: the parallel ones communicate, packed ones would not
        # One request's verification pass computes each row as a decode step would: greedy speculation
        # at one stream gives plain decoding's tokens.
        target_model = _prepared(target_model, dtype, device, quantization, config.cpu_kernels,
                                 max(BLOCKED_ROWS, verify_rows))

    bytes_per_block = ModelRunner.kv_bytes_per_block(shard_config(hf_config, config.tensor_parallel_size),
                                                     block_size, dtype)
    if draft_config is not None:
        bytes_per_block += ModelRunner.kv_bytes_per_block(draft_config, block_size, draft_dtype)
    if head is not None:   # its one layer's KV, and the target's kept features
        bytes_per_block += ModelRunner.kv_bytes_per_block(head.config, block_size, dtype) + \
            block_size * target_model.feature_size * dtype.itemsize
    num_blocks = config.num_kv_blocks or max(1, config.kv_cache_memory_bytes // bytes_per_block)
    max_model_len = _max_model_len(config, target_model, draft_model, num_blocks * block_size - spec.gamma)
    blocks_per_seq = -(-(max_model_len + spec.gamma) // block_size)
    if config.num_kv_blocks is None:   # a budget larger than every sequence at full length is never used
        num_blocks = min(num_blocks, config.max_num_seqs * blocks_per_seq)

    pool = BlockPool(num_blocks, block_size, config.enable_prefix_caching)
    # One attention backend per runner, chosen here for its model and dtype (engine/attention_backends.py).
    attention = lambda model, model_dtype: choose_backend(config.attention_backend, model, block_size, device,
                                                          model_dtype)
    target = (ParallelRunner if tp else ModelRunner)(target_model, num_blocks, block_size, dtype, device,
                                                     attention(target_model, dtype), keep_features=head is not None)
    if tp:
        finish_setup(target, workers, num_blocks, block_size)
    built = ProposerInputs(spec, hf_config.vocab_size, target, {
        "draft": lambda: ModelRunner(draft_model, num_blocks, block_size, draft_dtype, device,
                                     attention(draft_model, draft_dtype)),
        "eagle": lambda: ModelRunner(head, num_blocks, block_size, dtype, device, attention(head, dtype))})
    proposers = {name: build(built) for name, build in PROPOSER_BUILDERS.items() if name in spec.proposers
                 or (name == "grammar" and spec.gamma)}
    grids = {target: verify_rows}
    if "draft" in proposers:
        grids[proposers["draft"].runner] = verify_rows   # drafting passes (a tree's levels), and catch-ups
    _decode_grids(config, device, grids, blocks_per_seq)
    router = Router(proposers, hf_config.vocab_size)
    costs = StepCosts()
    methods = [m for m in ("grammar", *spec.proposers) if m in proposers]   # a static plan's preference
    if spec.adaptive:
        policy: Policy = GoodputPolicy(methods, costs, spec.p_min)
    else:
        policy = StaticPolicy(methods, spec.gamma, costs, spec.p_min)
    if spec.gamma:
        models = [p for name, p in proposers.items() if name in MODEL_PROPOSERS]
        _calibrate(costs, target, models, pool, min(config.max_num_seqs, CALIBRATION_MAX_BATCH), spec.gamma)
    logger.info("engine ready: model=%s dtype=%s quantization=%s fused_cpu_ops=%s attention=%s device=%s "
                "tensor_parallel=%d kv_blocks=%d x %d tokens, max_model_len=%d, sliding_window=%s, speculative=%s "
                "gamma=%d", config.model, str(dtype).replace("torch.", ""), quantization,
                "on" if target.fused_ops else "off", target.attention.name, device,
                config.tensor_parallel_size,
                num_blocks, block_size, max_model_len, target_model.sliding_window, spec.method, spec.gamma)
    return EngineParts(device, dtype, target, router, policy, costs, pool, max_model_len, hf_config.vocab_size,
                       eos_token_ids(config.model, hf_config), quantization)


def _decode_grids(config: EngineConfig, device: torch.device, query_lens: dict, max_blocks: int) -> None:
    """Decode-shaped passes on a DecodeGrid: captured as CUDA graphs with cuda_graphs, else at their own
    sizes wherever flash-attn serves them (flash_attn_with_kvcache reads decode rows best)."""
    if config.cuda_graphs and device.type != "cuda":
        raise ValueError(f"cuda_graphs needs a CUDA device; this engine runs on {device}")
    for runner, max_query_len in query_lens.items():
        if config.cuda_graphs or runner.attention.decode_on_grid:
            runner.enable_decode_grid(config.max_num_seqs, max_query_len, max_blocks, pad=config.cuda_graphs,
                                      capture=config.cuda_graphs)


def _prepared(model, dtype: torch.dtype, device: torch.device, quantization: str, cpu_kernels: bool,
              exact_rows: int = BLOCKED_ROWS):
    """The model in its serving form on CPU: linears weight-only bf16 / int8 when asked, else
    oneDNN-packed (both make small-batch matmuls, i.e. verification, cheaper than torch's default);
    in fp32 with cpu_kernels, the layers' small ops fused (engine/cpu_kernels.py). exact_rows: bf16
    passes of fewer rows keep row-independent results (streamed_linear.StreamedLinear)."""
    if quantization != "none":   # with gguf: the linears left dense (types without a kernel) as bf16
        stream_linears(model, "bf16" if quantization == "gguf" else quantization, exact_rows)
    if packed_linear_available(device, dtype):   # every linear left (all of them without quantization)
        pack_linears(model)
    if fused_ops_usable(device, dtype, cpu_kernels):
        use_fused_cpu_ops(model)
    return model


def _max_model_len(config: EngineConfig, target, draft, kv_capacity: int) -> int:
    limits = [target.max_position_embeddings, kv_capacity]
    if draft is not None:
        limits.append(draft.max_position_embeddings)
    if config.max_model_len is not None:
        if config.max_model_len > min(limits):
            raise ValueError(f"max_model_len {config.max_model_len} exceeds what the model and KV cache allow "
                             f"({min(limits)} tokens)")
        limits.append(config.max_model_len)
    if min(limits) < 2:
        raise ValueError(f"the KV cache is too small to hold a sequence ({kv_capacity} token slots)")
    return min(limits)


def _calibrate(costs: StepCosts, target: ModelRunner, models: list, pool: BlockPool, max_batch: int,
               gamma: int) -> None:
    """Fill the cost tables, through the real verification and drafting paths on scratch blocks:
    target passes of 1, 2, gamma / 2 + 1 and gamma + 1 tokens per request at batch 1, 2, 4, ...,
    each model proposer's one-token forward at the same batches, and its price per catch-up token.
    Each timing is the fastest of the last few of five runs: a shape's first passes are slow (kernel
    creation, fresh memory; on a GPU, capturing its CUDA graph), and timings only err upwards."""
    context = 2 * pool.block_size
    max_batch = min(max_batch, pool.num_free_blocks // 4)
    params = SamplingParams(max_tokens=1, temperature=0.0)
    # Distinct random tokens for every request and draft position: a mixture of experts routes each
    # token on its own, and a pass of one repeated token reads a few experts where real drafts read many.
    rng = random.Random(0)
    vocab = min([target.model.vocab_size] + [p.runner.model.vocab_size for p in models])   # a draft's may be smaller

    def tokens(n: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(n)]

    def requests(batch: int) -> list[Request]:
        out = []
        for i in range(batch):
            request = Request(f"calibration-{i}", tokens(context), context - 1, params, arrival_time=0.0,
                              generator=None, num_computed_tokens=context - 1)
            pool.allocate(request.block_table, context + gamma)
            out.append(request)
        return out

    def release(scheduled: list[Request], proposer=None) -> None:
        for request in scheduled:
            pool.free(request.block_table)
            if proposer is not None:
                proposer.on_finish(request.request_id)

    def target_pass(batch: int, lookahead: int) -> float:
        scheduled = requests(batch)
        proposal = Proposal([tokens(lookahead) for _ in scheduled], None)
        items = [ScheduledRequest.of(r, 1, lookahead) for r in scheduled]
        seconds = []
        for _ in range(5):
            start = time.perf_counter()
            verify(target, items, proposal)
            seconds.append(time.perf_counter() - start)
        release(scheduled)
        return min(seconds[2:])

    batches = [1 << i for i in range(max(0, max_batch).bit_length())]
    for batch in batches:
        for lookahead in sorted({0, 1, max(1, gamma // 2), gamma}):
            costs.target.add(batch, lookahead + 1, target_pass(batch, lookahead))
    for proposer in models:
        table = costs.draft(proposer.name)
        for batch in batches:
            scheduled = requests(batch)
            jobs = [DraftJob(r, 1) for r in scheduled]
            proposer.propose(jobs)   # catches each request up on its context; later forwards feed one token
            table.add(batch, min(proposer.propose(jobs).forwards[0].seconds for _ in range(5)))
            release(scheduled, proposer)
        catch_ups = []
        for _ in range(5):   # a fresh request each time: its first forward catches up on the whole context
            scheduled = requests(1)
            forward = proposer.propose([DraftJob(scheduled[0], 1)]).forwards[0]
            catch_ups.append((forward.seconds - table.tabled(1)) / max(forward.catch_up, 1))
            release(scheduled, proposer)
        table.catch_up_price = max(0.0, min(catch_ups[2:]))
