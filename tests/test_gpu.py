"""CUDA checks (skipped without a GPU): the flash-attn backend mirrors the torch reference,
and the engine on CUDA decodes exactly like the CPU reference (fp32, greedy)."""
import pytest
import torch
from helpers import make_tiny_checkpoint

from engine.attention import FLASH_BLOCK_SIZE, flash_available, paged_attention
from engine.attention_backends import FlashBackend, TorchBackend
from engine.attention_metadata import PassLayout

pytestmark = pytest.mark.gpu


def _random_pass(device, dtype, block_size):
    torch.manual_seed(0)
    num_blocks, heads, kv_heads, dim = 8, 8, 2, 64
    cache = torch.randn(2, num_blocks, block_size, kv_heads, dim, device=device, dtype=dtype)
    query_lens, seq_lens = [5, 1, 37], [300, 17, 37]   # verification, decode, prefill side by side
    tables = [[3, 1], [0], [6]]
    total = sum(query_lens)
    q = torch.randn(total, heads, dim, device=device, dtype=dtype)
    k = torch.randn(total, kv_heads, dim, device=device, dtype=dtype)
    v = torch.randn(total, kv_heads, dim, device=device, dtype=dtype)
    return cache, query_lens, seq_lens, tables, q, k, v


@pytest.mark.skipif(not flash_available(torch.device("cuda")), reason="flash-attn is not installed")
@pytest.mark.parametrize("sliding_window", [None, 24])   # 24 cuts the 300- and 37-token sequences
def test_flash_path_matches_torch_path(sliding_window):
    cache, query_lens, seq_lens, tables, q, k, v = _random_pass("cuda", torch.bfloat16, FLASH_BLOCK_SIZE)
    outs = []
    for backend in (TorchBackend, FlashBackend):
        meta = backend(FLASH_BLOCK_SIZE, torch.device("cuda")).build(PassLayout(query_lens, seq_lens, tables),
                                                                     sliding_window)
        outs.append(paged_attention(q, k, v, cache.clone(), meta, 64 ** -0.5, sliding_window).float())
    torch.testing.assert_close(outs[1], outs[0], atol=2e-2, rtol=2e-2)


def test_engine_on_cuda_matches_cpu(tmp_path):
    from engine import LLM, SamplingParams

    path = make_tiny_checkpoint(tmp_path / "tiny", arch="qwen3", seed=0)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    prompts = [[1, 2, 3, 4, 5], [7] * 40, [9, 8]]
    spec = {"method": "draft", "draft": {"model": str(path)}, "num_speculative_tokens": 4, "adaptive": False}
    cpu = LLM(str(path), dtype="float32", device="cpu").generate(prompts, params)
    gpu = LLM(str(path), dtype="float32", device="cuda", speculative=spec).generate(prompts, params)
    assert [o.token_ids for o in gpu] == [o.token_ids for o in cpu]
    assert all(o.spec.accepted == o.spec.proposed for o in gpu)


def test_bf16_target_with_fp32_draft_on_cuda(tmp_path):
    """Each runner decides flash-attn from its own dtype: a bf16 target may take the flash path while its
    fp32 draft must not (flash-attn has no fp32 kernels)."""
    from engine import LLM, SamplingParams

    path = make_tiny_checkpoint(tmp_path / "tiny", arch="llama", seed=0)
    spec = {"method": "draft", "draft": {"model": str(path), "dtype": "float32"}, "num_speculative_tokens": 3,
            "adaptive": False}
    llm = LLM(str(path), dtype="bfloat16", device="cuda", speculative=spec)
    assert not isinstance(llm.engine.spec.router.proposers["draft"].runner.attention, FlashBackend)
    assert isinstance(llm.engine.target.attention, FlashBackend) == flash_available(torch.device("cuda"))
    out = llm.generate([[1, 2, 3, 4, 5]], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    assert len(out.token_ids) == 12 and out.spec.proposed > 0


def test_sliding_window_on_cuda_matches_cpu(tmp_path):
    """A Mistral with a 16-token window decodes 40 tokens past it on CUDA exactly as on the CPU (fp32)."""
    from engine import LLM, SamplingParams

    path = make_tiny_checkpoint(tmp_path / "mistral", arch="mistral", seed=11, sliding_window=16)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    prompts = [list(range(30, 60)), [9, 8, 7]]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "adaptive": False}
    cpu = LLM(str(path), dtype="float32", device="cpu").generate(prompts, params)
    gpu = LLM(str(path), dtype="float32", device="cuda", max_num_batched_tokens=12, speculative=spec).generate(
        prompts, params)
    assert [o.token_ids for o in gpu] == [o.token_ids for o in cpu]


def test_cuda_graphs_decode_like_cpu(tmp_path):
    """Decode and verification passes replayed as CUDA graphs (fp32: the torch attention path inside
    the graphs) give the CPU's greedy output, with a draft model and n-gram routed per request."""
    from engine import LLM, SamplingParams, decode_grid

    path = make_tiny_checkpoint(tmp_path / "tiny", arch="llama", seed=0)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    prompts = [[1, 2, 3, 4, 5], [7] * 40, [9, 8], list(range(20, 45)), [3] * 7]
    cpu = LLM(str(path), dtype="float32", device="cpu").generate(prompts, params)
    spec = {"method": "auto", "draft": {"model": str(path)}, "proposers": ["draft", "ngram"], "num_speculative_tokens": 4}
    llm = LLM(str(path), dtype="float32", device="cuda", cuda_graphs=True, speculative=spec)
    gpu = llm.generate(prompts, params)
    assert [o.token_ids for o in gpu] == [o.token_ids for o in cpu]
    assert llm.engine.target.decode_grid.graphs   # something was captured and replayed
    assert decode_grid._capture_seconds > 0   # and its recording kept off the cost model's clock
    assert llm.engine.spec.router.proposers["draft"].runner.decode_grid.capture


def test_draft_trees_on_cuda_graphs_decode_like_cpu(tmp_path):
    """Draft trees (n-gram and draft model, tree_nodes 8) verified in captured graphs of their own (the
    tree bits in the grid's buffers, the mask built on the device): the CPU's greedy output (fp32), a
    windowed target too. In bf16 the chain passes keep flash-attn where it is installed, the tree
    passes take SDPA, and the output is as long as asked."""
    from engine import LLM, SamplingParams

    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    stem = [11, 12, 13]
    prompts = [stem + [1, 2] + stem + [3, 4] + stem + [5, 6] + stem, [7] * 40, list(range(20, 45)) * 3]
    for arch, extra in (("llama", {}), ("mistral", {"sliding_window": 72})):
        path = make_tiny_checkpoint(tmp_path / arch, arch=arch, seed=0, **extra)
        cpu = LLM(str(path), dtype="float32", device="cpu").generate(prompts, params)
        spec = {"method": "auto", "draft": {"model": str(path)}, "proposers": ["draft", "ngram"], "num_speculative_tokens": 4,
                "tree_nodes": 8, "adaptive": False}
        llm = LLM(str(path), dtype="float32", device="cuda", cuda_graphs=True, speculative=spec)
        gpu = llm.generate(prompts, params)
        assert [o.token_ids for o in gpu] == [o.token_ids for o in cpu], arch
        assert any(key[3] for key in llm.engine.target.decode_grid.graphs), "no tree pass was captured"
    llm = LLM(str(path), dtype="bfloat16", device="cuda", cuda_graphs=True, speculative=spec)
    out = llm.generate(prompts, params)
    assert all(len(o.token_ids) == 32 for o in out) and any(key[3] for key in llm.engine.target.decode_grid.graphs)


@pytest.mark.skipif(not flash_available(torch.device("cuda")), reason="flash-attn is not installed")
@pytest.mark.parametrize("sliding_window", [None, 24])
def test_flash_decode_rows_match_torch_path(sliding_window):
    """flash_attn_with_kvcache over a padded decode grid (verification, decode, and a sequence shorter
    than the grid's rows) agrees with the grid's torch path."""
    from engine.decode_grid import DecodeGrid
    from engine.model_runner import ForwardItem

    cache = _random_pass("cuda", torch.bfloat16, FLASH_BLOCK_SIZE)[0]
    items = [ForwardItem([0] * 5, 295, [3, 1], 5), ForwardItem([0], 16, [0], 1), ForwardItem([0] * 2, 1, [6], 2)]
    outs = []
    for backend in (TorchBackend, FlashBackend):
        grid = DecodeGrid(None, [cache], FLASH_BLOCK_SIZE, scratch_block=7, max_seqs=4, max_query_len=8,
                          max_blocks=2, device=torch.device("cuda"),
                          attention=backend(FLASH_BLOCK_SIZE, torch.device("cuda")))
        rows = grid._fill(items, *grid.shape(items), False)   # a 4 x 8 grid
        meta = grid._inputs(*grid.shape(items), False)[2]
        generator = torch.Generator("cuda").manual_seed(1)
        q, k, v = (torch.randn(meta.slot_mapping.shape[0], heads, 64, device="cuda", dtype=torch.bfloat16,
                               generator=generator) for heads in (8, 2, 2))
        out = paged_attention(q, k, v, cache.clone(), meta, 64 ** -0.5, sliding_window)
        outs.append(out[rows].float())
    torch.testing.assert_close(outs[1], outs[0], atol=2e-2, rtol=2e-2)
