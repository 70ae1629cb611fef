"""Packed oneDNN linears: same results as F.linear (up to reassociation), swapped in at start-up."""
import os

import pytest
import torch
from helpers import make_tiny_checkpoint

from engine.models.cpu_linear import PackedLinear, pack_linears, packed_linear_available

pytestmark = pytest.mark.skipif(not packed_linear_available(torch.device("cpu"), torch.float32),
                                reason="this torch build has no oneDNN linear")


@pytest.mark.parametrize("rows", [1, 5, 16, 33])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_linear(rows, bias):
    torch.manual_seed(rows)
    linear = torch.nn.Linear(96, 200, bias=bias)
    x = torch.randn(rows, 96)
    with torch.inference_mode():
        torch.testing.assert_close(PackedLinear(linear)(x), linear(x), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(PackedLinear(linear)(x.t().contiguous().t()), linear(x), rtol=1e-5, atol=1e-5)


BUILD_PRIMITIVES = """
import os, torch
from engine.models.cpu_linear import PackedLinear
def rss():
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS")).split()[1]) / 1024
torch.set_num_threads(1)
linears = [PackedLinear(torch.nn.Linear(64, 192)), PackedLinear(torch.nn.Linear(192, 64))]
start = rss()
with torch.inference_mode():
    for rows in range(1, 501):   # 1,000 primitives: ~560 MiB at oneDNN's own cache sizes
        for linear in linears:
            linear(torch.randn(rows, linear.in_features))
print(os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"], os.environ["LRU_CACHE_CAPACITY"], rss() - start)
"""


def test_onednn_primitive_caches_are_bounded():
    """oneDNN builds a primitive (~0.56 MiB) per weight shape and row count; the caches that keep
    them are capped when cpu_linear is imported, so serving every row count stays bounded."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")}
    result = subprocess.run([sys.executable, "-c", BUILD_PRIMITIVES], capture_output=True, text=True, env=env,
                            timeout=300, check=True)
    onednn, ideep, growth_mib = result.stdout.split()
    assert onednn == ideep == "256"
    assert float(growth_mib) < 300, result.stdout   # 200 measured; uncapped, 1,000 primitives take ~560


def test_engine_packs_every_linear_on_cpu(tmp_path):
    from engine.config import EngineConfig
    from engine.engine import Engine

    path = make_tiny_checkpoint(tmp_path / "m", arch="qwen2", seed=0, tie_word_embeddings=True)
    model = Engine(EngineConfig(model=str(path), dtype="float32")).target.model
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert isinstance(model.lm_head, PackedLinear)
    assert pack_linears(model) == 0


HUGE_PAGES = """
import engine, torch
x = torch.ones(64 << 20, dtype=torch.uint8)   # 64 MiB, touched
huge = 0
for line in open("/proc/self/smaps_rollup"):
    if line.startswith("AnonHugePages:"):
        huge = int(line.split()[1])
import os
print(os.environ["THP_MEM_ALLOC_ENABLE"], huge)
"""


def test_importing_the_engine_puts_big_tensors_in_huge_pages():
    """engine/__init__ sets THP_MEM_ALLOC_ENABLE before torch is imported (torch reads it once), so
    big CPU tensors get transparent huge pages where the kernel offers them (madvise or always);
    an explicit 0 turns them off."""
    import subprocess
    import sys

    mode = open("/sys/kernel/mm/transparent_hugepage/enabled").read() if os.path.exists(
        "/sys/kernel/mm/transparent_hugepage/enabled") else "[never]"
    for setting, expect_huge in ((None, "[never]" not in mode), ("0", False)):
        env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
        if setting is not None:
            env["THP_MEM_ALLOC_ENABLE"] = setting
        result = subprocess.run([sys.executable, "-c", HUGE_PAGES], capture_output=True, text=True, env=env,
                                timeout=120, check=True)
        value, huge_kib = result.stdout.split()
        assert value == (setting or "1")
        if setting == "0" and "[always]" not in mode:
            assert int(huge_kib) == 0, result.stdout
        if expect_huge:
            assert int(huge_kib) >= 2048, result.stdout   # at least one 2 MiB page (the kernel may be short of them)
