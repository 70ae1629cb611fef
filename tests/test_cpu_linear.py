"""Packed oneDNN linears: same results as F.linear (up to reassociation), swapped in at start-up."""
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


def test_engine_packs_every_linear_on_cpu(tmp_path):
    from engine.config import EngineConfig
    from engine.engine import Engine

    path = make_tiny_checkpoint(tmp_path / "m", arch="qwen2", seed=0, tie_word_embeddings=True)
    model = Engine(EngineConfig(model=str(path), dtype="float32")).target.model
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert isinstance(model.lm_head, PackedLinear)
    assert pack_linears(model) == 0
