"""specserve distill on tiny random models: the loss drops, acceptance rises,
runs resume from their checkpoint, and bad inputs fail with clear messages."""

from __future__ import annotations

import json
import random

import pytest
import torch

from train import distill as distill_mod
from train.distill import DistillConfig, distill, expected_tokens_per_step, main
from helpers import run_requests, train_bpe_tokenizer

pytestmark = pytest.mark.slow   # training

WORDS = ["def", "return", "self", "value", "index", "None", "for", "in", "if", "else", "import",
         "class", "print", "range", "len", "items", "key", "data", "result", "True", "False"]


def write_corpus(root, num_files=12, lines=60, seed=0):
    """Small synthetic Python-like corpus, deterministic."""
    rng = random.Random(seed)
    root.mkdir(parents=True, exist_ok=True)
    for i in range(num_files):
        body = []
        for _ in range(lines):
            a, b, c = rng.sample(WORDS, 3)
            body.append(rng.choice([f"def {a}_{b}({c}):", f"    return {a}.{b}({c})",
                                    f"    {a} = {b}[{c}]", f"for {a} in {b}:", f"    if {a}: {b}({c})"]))
        (root / f"mod{i:02d}.py").write_text("\n".join(body) + "\n")
    return root


def make_tiny_target(path, corpus_dir, vocab_size=320, hidden=64, layers=2, seed=0):
    """A random tiny Llama checkpoint with a byte-level BPE tokenizer trained on the corpus."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = train_bpe_tokenizer(sorted(corpus_dir.glob("*.py")), path, vocab_size)
    config = LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, tie_word_embeddings=False,
                         bos_token_id=0, eos_token_id=0, pad_token_id=1)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # sharper random logits, so the target has a clear argmax to imitate
        model.lm_head.weight.mul_(20.0)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("distill")
    corpus = write_corpus(root / "corpus")
    target = make_tiny_target(root / "target", corpus)
    return root, corpus, target


def tiny_cfg(root, corpus, target, out, **overrides):
    base = dict(target=str(target), corpus=[str(corpus)], out=str(out), draft_layers=1, draft_hidden=32,
                draft_heads=2, draft_kv_heads=1, steps=40, batch_size=8, seq_len=32, lr=1e-2, warmup=4,
                eval_windows=16, held_out_every=4, precision="fp32", threads=1, ckpt_every=10,
                progress=False, seed=0)
    base.update(overrides)
    return DistillConfig(**base)


def test_distill_lowers_kl_and_raises_acceptance(setup):
    root, corpus, target = setup
    out = root / "run"
    stats = distill(tiny_cfg(root, corpus, target, out), log=lambda *_: None)
    before, after = stats["before"], stats["after"]
    assert after["kl"] < 0.8 * before["kl"]
    assert after["acceptance"] > before["acceptance"] + 0.1
    assert after["expected_tokens_per_step"] > before["expected_tokens_per_step"]
    # the result is a plain HF directory with the target's tokenizer
    for name in ("config.json", "model.safetensors", "tokenizer.json", "distill_stats.json"):
        assert (out / name).exists(), name
    from transformers import AutoModelForCausalLM, AutoTokenizer

    draft = AutoModelForCausalLM.from_pretrained(out)
    assert draft.config.vocab_size == AutoModelForCausalLM.from_pretrained(target).config.vocab_size
    assert AutoTokenizer.from_pretrained(out).eos_token_id == 0


def test_resume_continues_from_checkpoint(setup):
    root, corpus, target = setup
    full = distill(tiny_cfg(root, corpus, target, root / "full", steps=20), log=lambda *_: None)
    # interrupted after 10 of 20 steps, then resumed: same batches (seeded per step), same result
    partial_dir = root / "partial"
    stopped = distill(tiny_cfg(root, corpus, target, partial_dir, steps=20, stop_at=10), log=lambda *_: None)
    assert stopped["stopped"] and not (partial_dir / "model.safetensors").exists()
    state = json.loads((partial_dir / "checkpoint" / "state.json").read_text())
    assert state["step"] == 10
    messages = []
    resumed = distill(tiny_cfg(root, corpus, target, partial_dir, steps=20, resume=True), log=messages.append)
    assert any("resumed" in m and "step 10" in m for m in messages)
    assert resumed["steps"] == 20 and resumed["train_tokens"] == full["train_tokens"]
    assert resumed["before"] == full["before"]
    assert resumed["after"]["kl"] == pytest.approx(full["after"]["kl"], rel=1e-3)
    assert resumed["after"]["acceptance"] == pytest.approx(full["after"]["acceptance"], abs=0.01)


def test_expected_tokens_per_step():
    assert expected_tokens_per_step(0.0, 4) == 1.0
    assert expected_tokens_per_step(1.0, 4) == 5.0
    assert expected_tokens_per_step(0.5, 4) == pytest.approx(1.9375)


def _fails(argv, capsys=None):
    with pytest.raises(SystemExit) as info:
        main(argv)
    return str(info.value)


def test_missing_corpus_is_a_clear_error(setup, tmp_path):
    root, corpus, target = setup
    msg = _fails(["--target", str(target), "--corpus", str(tmp_path / "nope"), "--out", str(tmp_path / "o")])
    assert "corpus path does not exist" in msg


def test_empty_corpus_is_a_clear_error(setup, tmp_path):
    root, corpus, target = setup
    (tmp_path / "empty").mkdir()
    msg = _fails(["--target", str(target), "--corpus", str(tmp_path / "empty"), "--out", str(tmp_path / "o")])
    assert "corpus is empty" in msg


def test_missing_target_is_a_clear_error(setup, tmp_path):
    root, corpus, target = setup
    msg = _fails(["--target", str(tmp_path / "no-model"), "--corpus", str(corpus), "--out", str(tmp_path / "o")])
    assert "target checkpoint not found" in msg


def test_draft_with_other_vocab_is_a_clear_error(setup, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    root, corpus, target = setup
    other = LlamaForCausalLM(LlamaConfig(vocab_size=500, hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1))
    other.save_pretrained(tmp_path / "other")
    msg = _fails(["--target", str(target), "--corpus", str(corpus), "--out", str(tmp_path / "o"),
                  "--draft", str(tmp_path / "other")])
    assert "draft model vocabulary (500 tokens) differs from the target's" in msg


def test_unknown_target_type_is_rejected(tmp_path):
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(distill_mod.TrainError, match="not supported"):
        distill_mod.load_target(str(tmp_path / "t"))


def test_time_budget_run_finishes_and_exports(setup):
    root, corpus, target = setup
    out = root / "timed"
    stats = distill(tiny_cfg(root, corpus, target, out, steps=10**6, time_budget_min=0.02), log=lambda *_: None)
    assert "stopped" not in stats and 0 < stats["steps"] < 10**6
    assert stats["train_seconds"] >= 1.2
    assert (out / "model.safetensors").exists()


# ---- chat data and self-distillation (the default draft's recipe, on tiny models) ----------------


@pytest.fixture(scope="module")
def chat_target(tmp_path_factory):
    from helpers import make_tiny_checkpoint

    root = tmp_path_factory.mktemp("chat")
    return make_tiny_checkpoint(root / "target", arch="llama", num_layers=3, seed=2, tie_word_embeddings=True)


def write_chat_jsonl(path, count=60, seed=0):
    rng = random.Random(seed)
    with open(path, "w") as f:
        for i in range(count):
            question = " ".join(rng.sample(WORDS, 4))
            answer = " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 20)))
            f.write(json.dumps({"messages": [{"role": "user", "content": question},
                                             {"role": "assistant", "content": answer}]}) + "\n")
    return path


def test_chat_examples_train_on_the_answer_only(chat_target):
    from helpers import IM_END_ID

    from engine.tokenizer import load_tokenizer
    from train.chat_data import IGNORE, collate, render

    tokenizer = load_tokenizer(str(chat_target))
    messages = [{"role": "user", "content": "what is up"}, {"role": "assistant", "content": "all good"}]
    example = render(tokenizer, messages)
    prompt = tokenizer.encode(tokenizer.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True),
                              add_special_tokens=False)
    assert example.answer_start == len(prompt) and list(example.token_ids[:len(prompt)]) == prompt
    answer = example.token_ids[example.answer_start:]
    assert tokenizer.decode(answer[:-1]) == "all good" and answer[-1] == IM_END_ID   # the end of turn is learned
    inputs, labels = collate([example], seq_len=64, pad_id=0)
    trained = labels[0] != IGNORE
    assert trained.sum() == len(answer) and labels[0][trained].tolist() == answer.tolist()
    # too long: the prompt is cut from the left, the answer survives
    inputs, labels = collate([example], seq_len=len(answer) + 2, pad_id=0)
    assert labels[0][labels[0] != IGNORE].tolist() == answer.tolist()


def test_distill_chat_data_from_target_layers_into_a_gguf_draft(chat_target, tmp_path):
    from engine import SamplingParams
    from engine.config import EngineConfig
    from engine.engine import Engine

    data = write_chat_jsonl(tmp_path / "chat.jsonl")
    out = tmp_path / "draft"
    stats = distill(DistillConfig(target=str(chat_target), out=str(out), data=str(data),
                                  draft_from_target_layers=[0], steps=30, batch_size=8, seq_len=64, lr=5e-3,
                                  warmup=3, eval_windows=8, held_out_every=5, precision="fp32", threads=1,
                                  save_format="gguf", gguf_type="F32", progress=False), log=lambda *_: None)
    assert stats["data"]["conversations"] == 60 and stats["data"]["held_out_conversations"] == 12
    assert stats["after"]["kl"] < stats["before"]["kl"]
    assert 0 < stats["after"]["sampled_acceptance"] <= 1
    assert (out / "draft.gguf").exists() and not (out / "model.safetensors").exists()
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    outputs = {}
    for name, spec in (("plain", None), ("draft", {"method": "draft", "draft": {"model": str(out)}, "num_speculative_tokens": 3, "adaptive": False})):
        engine = Engine(EngineConfig(model=str(chat_target), dtype="float32", **({"speculative": spec} if spec else {})))
        outputs[name] = run_requests(engine, [[1, 2, 3, 4, 5]], params)[0]
    assert outputs["draft"] == outputs["plain"]


def test_generate_then_distill_resumes_the_answers(chat_target, tmp_path):
    from train.common import read_jsonl
    from train.generate import main as generate_main

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "messages": [{"role": "user", "content": f"say {w}"}]}) + "\n"
                               for i, w in enumerate(WORDS[:10])))
    answers = tmp_path / "answers.jsonl"
    argv = ["--target", str(chat_target), "--out", str(answers), "--prompts", str(prompts), "--max-tokens", "6"]
    assert generate_main(argv) == 0
    rows = read_jsonl(answers)
    assert [r["id"] for r in rows] == [f"p{i}" for i in range(10)]
    for row in rows:
        assert row["messages"][-1]["role"] == "assistant" and 1 <= len(row["response_token_ids"]) <= 6
    assert generate_main(argv) == 0 and len(read_jsonl(answers)) == 10   # nothing answered twice
    stats = distill(DistillConfig(target=str(chat_target), out=str(tmp_path / "d"), generate_from=str(prompts),
                                  draft_layers=1, draft_hidden=32, draft_heads=2, steps=5, batch_size=4, seq_len=32,
                                  warmup=1, eval_windows=4, held_out_every=5, precision="fp32", threads=1,
                                  generate_max_tokens=6, progress=False), log=lambda *_: None)
    assert stats["data"]["conversations"] == 10 and (tmp_path / "d" / "responses.jsonl").exists()


def test_generate_self_instruct_keeps_the_turns_the_target_ended_and_resumes(chat_target, tmp_path, monkeypatch):
    """--prompts self: the target writes user turns after the template's user prefix (scripted here:
    the sampling itself is the engine's); turns it did not end, too short, or already written are
    dropped; the kept ones are answered, a quarter get a follow-up written after the answer, and a
    rerun writes and answers nothing twice."""
    from transformers import AutoTokenizer

    from train import generate
    from train.common import read_jsonl

    texts = {"self-0-0": ("How do I bake rye bread at home?", True),
             "self-0-1": ("Write a haiku about the sea and the wind", True),
             "self-0-2": ("Tell me everything about everything and then", False),   # not ended
             "self-0-3": ("hi there", True),                                        # too short
             "self-0-4": ("How do I bake rye bread at home?", True),                # written already
             "self-0-5": ("Explain how a bicycle gear works", True),
             "self-0-6": ("What should I pack for a rainy hike?", True),
             "self-0-7": ("List three uses of vinegar in cleaning", True)}
    calls = []

    def scripted(self, prefixes, row_ids):
        calls.append((prefixes, row_ids))
        return [texts.get(row_id, ("And what about winter instead?", True)) for row_id in row_ids]
    monkeypatch.setattr(generate.Generator, "_sample_user_turns", scripted)
    answers = tmp_path / "answers.jsonl"
    argv = ["--target", str(chat_target), "--out", str(answers), "--prompts", "self", "--count", "8",
            "--max-tokens", "5"]
    assert generate.main(argv) == 0

    rows = {row["id"]: row for row in read_jsonl(answers)}
    kept = ["self-0-0", "self-0-1", "self-0-5", "self-0-6", "self-0-7"]
    assert [i for i in rows if i.startswith("self-")] == kept
    for row_id in kept:
        assert rows[row_id]["messages"][0] == {"role": "user", "content": texts[row_id][0]}
        assert [m["role"] for m in rows[row_id]["messages"]] == ["user", "assistant"]
    followups = [i for i in rows if i.startswith("followup-")]
    assert len(followups) == 1 and followups[0].removeprefix("followup-") in kept
    conversation = rows[followups[0]]["messages"]
    assert [m["role"] for m in conversation] == ["user", "assistant", "user", "assistant"]
    assert conversation[:2] == rows[followups[0].removeprefix("followup-")]["messages"]
    assert conversation[2]["content"] == "And what about winter instead?"

    tokenizer = AutoTokenizer.from_pretrained(str(chat_target))
    assert calls[0][0][0] == generate.user_turn_prefix(tokenizer, [])
    assert calls[1][0][0] == generate.user_turn_prefix(tokenizer, conversation[:2])

    before = (answers.read_text(), answers.with_name("answers.prompts.jsonl").read_text())
    calls.clear()
    assert generate.main(argv) == 0
    assert not any(ids for _, ids in calls)
    assert (answers.read_text(), answers.with_name("answers.prompts.jsonl").read_text()) == before


def test_the_user_turn_prefix_is_the_template_up_to_the_users_text(chat_target):
    from transformers import AutoTokenizer

    from train.generate import user_turn_prefix
    tokenizer = AutoTokenizer.from_pretrained(str(chat_target))
    context = [{"role": "user", "content": "first question"}, {"role": "assistant", "content": "an answer"}]
    full = tokenizer.apply_chat_template(context + [{"role": "user", "content": "the request"}], tokenize=False)
    prefix = tokenizer.decode(user_turn_prefix(tokenizer, context))
    assert full.startswith(prefix) and full[len(prefix):].startswith("the request")
    assert "an answer" in prefix


def test_prompts_file_without_a_user_turn_is_a_clear_error(chat_target, tmp_path):
    from train.generate import main as generate_main

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": [{"role": "assistant", "content": "hi"}]}) + "\n")
    with pytest.raises(SystemExit, match="line 1 needs \"messages\" ending in a user turn"):
        generate_main(["--target", str(chat_target), "--out", str(tmp_path / "o.jsonl"), "--prompts", str(bad)])


def test_exactly_one_data_source(setup, tmp_path):
    root, corpus, target = setup
    msg = _fails(["--target", str(target), "--out", str(tmp_path / "o"), "--corpus", str(corpus),
                  "--data", str(tmp_path / "x.jsonl")])
    assert "exactly one of --corpus, --data and --generate-from" in msg


def test_existing_draft_with_a_padded_table_keeps_training(chat_target, tmp_path):
    """One tokenizer, embedding tables padded to different sizes: distillation compares the shared rows."""
    import shutil

    from helpers import make_tiny_checkpoint

    padded = make_tiny_checkpoint(tmp_path / "padded", arch="llama", vocab_size=300, num_layers=1, seed=5)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(chat_target / name, padded / name)
    data = write_chat_jsonl(tmp_path / "chat.jsonl", count=20)
    stats = distill(DistillConfig(target=str(chat_target), out=str(tmp_path / "d"), data=str(data), draft=str(padded),
                                  steps=8, batch_size=4, seq_len=48, lr=5e-3, warmup=1, eval_windows=4,
                                  held_out_every=5, precision="fp32", threads=1, progress=False), log=lambda *_: None)
    assert stats["after"]["kl"] < stats["before"]["kl"]
