"""specserve distill --head eagle (train/eagle.py) on tiny random targets: training lowers the
held-out KL and raises acceptance, runs resume, the export is the engine's format, the unrolled
(training-time test) attention matches a plain causal forward and a step-by-step KV-cache
reference, and bad inputs fail with clear messages."""
from __future__ import annotations

import json

import pytest
import torch
from helpers import IM_END_ID, IM_START_ID, make_tiny_checkpoint

from train.common import TrainError
from train.eagle import EagleConfig, EagleHeadTrainer, head_logits_teacher_forced, train_eagle

pytestmark = pytest.mark.slow   # training

HEAD_TENSORS = ["fc.weight", "layer.input_layernorm.weight", "layer.self_attn.q_proj.weight",
                "layer.self_attn.k_proj.weight", "layer.self_attn.v_proj.weight", "layer.self_attn.o_proj.weight",
                "layer.post_attention_layernorm.weight", "layer.mlp.gate_proj.weight", "layer.mlp.up_proj.weight",
                "layer.mlp.down_proj.weight", "norm.weight"]
QUIET = dict(log=lambda *_: None)


def load_hf(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval().requires_grad_(False)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    """A tiny random Llama with a sharpened LM head (a clear argmax to imitate)."""
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("eagle_train") / "target", arch="llama", num_layers=2,
                                seed=2, rope_parameters={"rope_type": "default", "rope_theta": 500.0})
    model = load_hf(path)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def chat_data(target_dir, tmp_path_factory):
    """Conversations whose answers are the target's own greedy continuations (token ids given)."""
    model = load_hf(target_dir)
    generator = torch.Generator().manual_seed(0)
    ids = torch.cat([torch.full((150, 1), IM_START_ID), torch.randint(0, 256, (150, 9), generator=generator),
                     torch.full((150, 1), IM_END_ID)], dim=1)
    with torch.no_grad():   # greedy, batched (every prompt has the same length)
        for _ in range(28):
            ids = torch.cat([ids, model(ids).logits[:, -1:].argmax(-1)], dim=1)
    path = tmp_path_factory.mktemp("eagle_data") / "chat.jsonl"
    path.write_text("".join(json.dumps({"prompt_token_ids": row[:11], "response_token_ids": row[11:]}) + "\n"
                            for row in ids.tolist()))
    return path


def cfg(target_dir, data, out, **overrides) -> EagleConfig:
    base = dict(target=str(target_dir), data=str(data), out=str(out), unroll=3, steps=300, batch_size=8, seq_len=48,
                lr=1e-2, warmup=4, eval_windows=16, held_out_every=5, precision="fp32", threads=2, ckpt_every=50,
                progress=False, seed=0)
    base.update(overrides)
    return EagleConfig(**base)


@pytest.fixture(scope="module")
def trained(target_dir, chat_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("eagle_run") / "head"
    return out, train_eagle(cfg(target_dir, chat_data, out), **QUIET)


def test_training_lowers_kl_and_raises_acceptance(trained):
    out, stats = trained
    before, after = stats["before"], stats["after"]
    assert after["kl"][0] < 0.6 * before["kl"][0] and after["kl"][-1] < 0.6 * before["kl"][-1]
    assert after["step_acceptance"][0] > before["step_acceptance"][0] + 0.1
    assert after["expected_tokens_per_forward"] > before["expected_tokens_per_forward"]
    assert 1.0 <= after["expected_tokens_per_forward"] <= 1 + stats["unroll"]
    chain = after["chain_acceptance"]
    assert len(chain) == 3 and all(a >= b for a, b in zip(chain, chain[1:]))
    assert json.loads((out / "eagle_stats.json").read_text())["after"] == after


def test_export_is_the_engine_format_and_loads_back(trained, target_dir, tmp_path):
    from safetensors import safe_open

    out, _ = trained
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert sorted(f.keys()) == sorted(HEAD_TENSORS)
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
        assert f.get_tensor("fc.weight").shape == (64, 128)
    config = json.loads((out / "config.json").read_text())
    target_config = json.loads((target_dir / "config.json").read_text())
    assert config["architectures"] == ["EagleHead"] and config["num_hidden_layers"] == 1
    assert config["eagle"] == {"format": 1, "feature": "final_norm_hidden", "unroll": 3, "target_hidden_size": 64,
                               "target_vocab_size": target_config["vocab_size"]}
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                "rms_norm_eps", "rope_parameters", "max_position_embeddings", "vocab_size", "tie_word_embeddings"):
        assert config[key] == target_config[key], key
    assert not config["attention_bias"] and not config["mlp_bias"] and config["model_type"] == "llama"
    # the bf16 export against the fp32 checkpoint of the same weights; an fp32 save round-trips exactly
    target = load_hf(target_dir)
    ids = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        exact = head_logits_teacher_forced(EagleHeadTrainer.load(out / "checkpoint", target), target, ids)
        rounded = head_logits_teacher_forced(EagleHeadTrainer.load(out, target), target, ids)
        assert exact.shape == (2, 19, target.config.vocab_size)
        assert (exact.argmax(-1) == rounded.argmax(-1)).float().mean() > 0.9
        head = EagleHeadTrainer.load(out / "checkpoint", target)
        head.save_pretrained(tmp_path / "fp32")
        again = head_logits_teacher_forced(EagleHeadTrainer.load(tmp_path / "fp32", target), target, ids)
    assert torch.equal(again, exact)


def test_resume_continues_from_checkpoint(target_dir, chat_data, tmp_path):
    from safetensors.torch import load_file

    run = dict(steps=12, unroll=2, ckpt_every=4)
    full = train_eagle(cfg(target_dir, chat_data, tmp_path / "full", **run), **QUIET)
    part = tmp_path / "part"
    stopped = train_eagle(cfg(target_dir, chat_data, part, stop_at=6, **run), **QUIET)
    assert stopped["stopped"] and stopped["steps"] == 6 and not (part / "model.safetensors").exists()
    messages = []
    resumed = train_eagle(cfg(target_dir, chat_data, part, resume=True, **run), log=messages.append)
    assert any("resumed" in m and "step 6" in m for m in messages)
    assert resumed["steps"] == 12 and resumed["train_tokens"] == full["train_tokens"]
    assert resumed["before"] == full["before"]
    assert resumed["after"]["kl"] == pytest.approx(full["after"]["kl"], rel=1e-3, abs=1e-4)
    weights = [load_file(str(out / "checkpoint" / "model.safetensors")) for out in (tmp_path / "full", part)]
    for name in HEAD_TENSORS:
        torch.testing.assert_close(weights[0][name], weights[1][name], rtol=1e-3, atol=1e-4)


def test_init_head_starts_from_an_exported_head(target_dir, chat_data, tmp_path):
    run = dict(steps=6, unroll=2, ckpt_every=3)
    first = train_eagle(cfg(target_dir, chat_data, tmp_path / "first", **run), **QUIET)
    second = train_eagle(cfg(target_dir, chat_data, tmp_path / "second", init_head=str(tmp_path / "first"), **run),
                         **QUIET)
    # the second run is evaluated first on the first run's export (bf16-rounded), not on a fresh head
    assert second["before"]["kl"] == pytest.approx(first["after"]["kl"], rel=0.05)
    assert second["before"]["kl"][0] < first["before"]["kl"][0]


def test_a_draft_vocabulary_is_chosen_from_the_answers_trained_exported_and_kept_on_resume(
        target_dir, chat_data, tmp_path):
    from safetensors import safe_open

    from train.chat_data import ChatExample
    from train.eagle import choose_draft_vocab
    examples = [ChatExample(torch.tensor([1, 2, 3, 7, 7, 8]).numpy(), 3), ChatExample(torch.tensor([4, 7, 9]).numpy(), 1)]
    vocab, covered = choose_draft_vocab(examples, 3, 256)
    assert vocab == [7, 8, 9] and covered == 1.0           # answer tokens first
    vocab, covered = choose_draft_vocab(examples, 2, 256)
    assert vocab == [7, 8] and covered == pytest.approx(4 / 5)
    assert choose_draft_vocab(examples, 6, 256)[0] == [1, 2, 3, 7, 8, 9]   # then prompt tokens
    assert choose_draft_vocab(examples, 9, 256)[0] == [0, 1, 2, 3, 4, 5, 7, 8, 9]   # then the lowest ids

    run = dict(steps=8, unroll=2, ckpt_every=4, draft_vocab=96)
    messages = []
    stopped = train_eagle(cfg(target_dir, chat_data, tmp_path / "run", stop_at=4, **run), log=messages.append)
    assert stopped["stopped"] and any("draft vocabulary: 96 of" in m for m in messages)
    messages = []
    stats = train_eagle(cfg(target_dir, chat_data, tmp_path / "run", resume=True, **dict(run, draft_vocab=64)),
                        log=messages.append)
    assert any("keeping the checkpoint's draft vocabulary of 96" in m for m in messages)
    assert 1.0 <= stats["after"]["expected_tokens_per_forward"] <= 3.0
    with safe_open(str(tmp_path / "run" / "model.safetensors"), "pt") as f:
        assert sorted(f.keys()) == sorted(HEAD_TENSORS + ["draft_vocab"])
        ids = f.get_tensor("draft_vocab")
    assert ids.dtype == torch.long and len(ids) == 96 and bool((ids[1:] > ids[:-1]).all())
    assert json.loads((tmp_path / "run" / "config.json").read_text())["eagle"]["draft_vocab_size"] == 96
    target = load_hf(target_dir)
    head = EagleHeadTrainer.load(tmp_path / "run", target)
    assert torch.equal(head.draft_vocab, ids)
    logits = head_logits_teacher_forced(head, target, torch.randint(0, 256, (1, 10)))
    assert logits.shape == (1, 9, 96)


# ---- the training-time-test attention -------------------------------------------------------------


@pytest.fixture(scope="module")
def head_and_target(target_dir):
    target = load_hf(target_dir)
    head = EagleHeadTrainer.from_target(target)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():   # away from the [I, 0] start, so every input matters
        for p in head.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=generator) * (p.std() if p.numel() > p.shape[0] else 1.0))
    return head.eval(), target


def test_the_start_is_the_identity_fc_and_the_targets_last_layer(target_dir):
    target = load_hf(target_dir)
    head = EagleHeadTrainer.from_target(target)
    hidden = target.config.hidden_size
    assert torch.equal(head.fc.weight[:, :hidden], torch.eye(hidden)) and not head.fc.weight[:, hidden:].any()
    last = target.model.layers[-1].state_dict()
    assert all(torch.equal(v, last[k]) for k, v in head.layer.state_dict().items())
    assert sorted(head.state_dict()) == sorted(HEAD_TENSORS)


def test_unroll_one_is_the_plain_causal_forward(head_and_target):
    head, target = head_and_target
    ids = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        features = target.model(input_ids=ids).last_hidden_state
        (step1,) = head.unrolled(features, ids, 1)
        plain = head_logits_teacher_forced(head, target, ids)
        # the target's own features, as the head's contract defines them: lm_head(h) is the target's logits
        torch.testing.assert_close(target.lm_head(features), target(ids).logits)
    torch.testing.assert_close(head.logits(step1[:, :-1]), plain, rtol=1e-5, atol=1e-5)


def _reference_chain(head, features, ids, anchor: int, steps: int) -> list[torch.Tensor]:
    """The head drafting from `anchor` as at inference: a KV list holding positions 0..anchor from
    the true features, then one entry per chain step made from the head's own previous output."""
    from transformers.models.llama.modeling_llama import repeat_kv

    attn = head.layer.self_attn
    keys, values, outs = [], [], []

    def run(u, position):   # u [1, n, H] at positions position..; appends its K/V, attends over the list
        n = u.shape[1]
        cos, sin = head._rope(torch.arange(position, position + n)[None])
        q, k, v = head._qkv(head.layer.input_layernorm(u), cos, sin)
        keys.append(k), values.append(v)
        k_all = repeat_kv(torch.cat(keys, 2), head.num_heads // head.num_kv_heads)
        v_all = repeat_kv(torch.cat(values, 2), head.num_heads // head.num_kv_heads)
        total = k_all.shape[2]
        scores = q @ k_all.transpose(2, 3) * head.scaling
        allowed = torch.arange(total)[None] <= torch.arange(total - n, total)[:, None]
        scores = scores.masked_fill(~allowed, float("-inf"))
        a = (scores.softmax(-1) @ v_all).transpose(1, 2).reshape(1, n, -1)
        x = u + attn.o_proj(a)
        return head.norm(x + head.layer.mlp(head.layer.post_attention_layernorm(x)))

    out = run(head._input(features[:, :anchor + 1], ids[:, 1:anchor + 2]), 0)[:, -1:]
    outs.append(out)
    for j in range(2, steps + 1):
        out = run(head._input(out, ids[:, anchor + j: anchor + j + 1]), anchor + j - 1)
        outs.append(out)
    return outs


def test_unrolled_steps_match_a_step_by_step_kv_cache(head_and_target):
    head, target = head_and_target
    ids = torch.randint(0, 256, (1, 14), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        features = target.model(input_ids=ids).last_hidden_state
        outs = head.unrolled(features, ids, 3)
        for anchor in (0, 4, 10):
            reference = _reference_chain(head, features, ids, anchor, 3)
            for j in range(3):
                torch.testing.assert_close(outs[j][:, anchor], reference[j][:, 0], rtol=1e-5, atol=1e-5)


def test_the_fused_loss_and_its_gradient_match_autograd(monkeypatch):
    import train.eagle as eagle

    monkeypatch.setattr(eagle, "LOSS_CHUNK", 3)   # several chunks
    g = torch.Generator().manual_seed(4)
    hidden = torch.randn(7, 16, generator=g, requires_grad=True)
    weight = torch.randn(50, 16, generator=g)
    teacher_logp = torch.log_softmax(3 * torch.randn(9, 50, generator=g), dim=-1)
    rows = torch.tensor([0, 3, 4, 8, 1, 2, 6])
    fused = eagle.SoftCrossEntropy.apply(hidden, weight, teacher_logp.exp(), rows, torch.float32)
    (grad,) = torch.autograd.grad(2.0 * fused, hidden)
    plain = -(teacher_logp[rows].exp() * torch.log_softmax(hidden @ weight.T, dim=-1)).sum()
    (expected,) = torch.autograd.grad(2.0 * plain, hidden)
    torch.testing.assert_close(fused, plain)
    torch.testing.assert_close(grad, expected)


# ---- errors ---------------------------------------------------------------------------------------


def _fails(argv, head: str = "eagle") -> str:
    from train.distill import main as distill_main

    with pytest.raises(SystemExit) as info:
        distill_main(["--head", head, *argv])
    return str(info.value)


def test_bad_inputs_are_clear_errors(target_dir, chat_data, tmp_path):
    out = str(tmp_path / "o")
    assert "exactly one of --data" in _fails(["--target", str(target_dir), "--out", out])
    assert "exactly one of --data" in _fails(["--target", str(target_dir), "--out", out, "--data", str(chat_data),
                                              "--generate-from", "builtin"])
    msg = _fails(["--target", str(target_dir), "--out", out, "--data", str(tmp_path / "missing.jsonl")])
    assert msg.startswith("specserve distill --head eagle: error:") and "chat data not found" in msg
    assert "target checkpoint not found" in _fails(["--target", str(tmp_path / "nope"), "--out", out,
                                                    "--data", str(chat_data)])
    assert "--unroll must be at least 1" in _fails(["--target", str(target_dir), "--out", out,
                                                    "--data", str(chat_data), "--unroll", "0"])
    assert "the only head is 'eagle'" in _fails(["--target", str(target_dir)], head="medusa")
    with pytest.raises(TrainError, match="silu"):
        target = load_hf(target_dir)
        target.config.hidden_act = "gelu"
        EagleHeadTrainer.from_target(target)
    with pytest.raises(TrainError, match="no EAGLE head"):
        EagleHeadTrainer.load(tmp_path, load_hf(target_dir))


def test_a_fused_feature_head_trains_exports_and_keeps_its_layers(target_dir, chat_data, tmp_path):
    """--feature-layers: the head reads those layers' outputs through `fuse`; it trains, exports fuse
    with the rest, and a run that resumes or starts from it must not name other layers."""
    from safetensors import safe_open

    run = dict(steps=40, unroll=2, ckpt_every=20, feature_layers=[0])
    stats = train_eagle(cfg(target_dir, chat_data, tmp_path / "fused", **run), **QUIET)
    assert stats["after"]["kl"][0] < 0.8 * stats["before"]["kl"][0]
    with safe_open(str(tmp_path / "fused" / "model.safetensors"), "pt") as f:
        assert sorted(f.keys()) == sorted(HEAD_TENSORS + ["fuse.weight"])
        assert f.get_tensor("fuse.weight").shape == (64, 64)
    eagle = json.loads((tmp_path / "fused" / "config.json").read_text())["eagle"]
    assert eagle["feature"] == "fused_layers" and eagle["feature_layers"] == [0]
    with pytest.raises(TrainError, match="--feature-layers 1"):
        train_eagle(cfg(target_dir, chat_data, tmp_path / "again", init_head=str(tmp_path / "fused"),
                        **dict(run, feature_layers=[1])), **QUIET)
    with pytest.raises(TrainError, match="feature layers must be distinct decoder layers"):
        train_eagle(cfg(target_dir, chat_data, tmp_path / "bad", **dict(run, feature_layers=[1])), **QUIET)
