"""Train the default model pair's tokenizer: byte-level BPE on the Python
standard library (training files only; the held-out files are never seen).

    python -m train.tokenizer --out runs/default/tokenizer [--vocab-size 8192]

Writes tokenizer.json, tokenizer_config.json (eos/bos/pad, chat template) and
the rest of what ``transformers.AutoTokenizer.from_pretrained`` needs offline.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from train.common import read_text, split_files, stdlib_files

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
# A plain template: this is a code model, so chat turns are just labelled text.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '# ' + message['role'] + ':\\n' + message['content'] + '\\n\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '# assistant:\\n' }}{% endif %}"
)


def train_tokenizer(files: list[Path], vocab_size: int = 8192):
    """Byte-level BPE over ``files`` (deterministic for a given file list)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS_TOKEN, PAD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator((read_text(f) for f in files), trainer=trainer, length=len(files))
    return tok


def save_tokenizer(tok, out_dir: Path, model_max_length: int = 1024) -> None:
    """Save as a transformers fast tokenizer directory."""
    from transformers import PreTrainedTokenizerFast

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=EOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        unk_token=None,
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )
    hf.chat_template = CHAT_TEMPLATE
    hf.save_pretrained(out_dir)
    # Older transformers read the template from tokenizer_config.json only; keep it there too.
    cfg_path = out_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.setdefault("chat_template", CHAT_TEMPLATE)
    cfg_path.write_text(json.dumps(cfg, indent=2))


def build_default_tokenizer(out_dir: Path, vocab_size: int = 8192) -> Path:
    out_dir = Path(out_dir)
    if (out_dir / "tokenizer.json").exists():
        return out_dir
    train_files, _ = split_files(stdlib_files())
    tok = train_tokenizer(train_files, vocab_size)
    save_tokenizer(tok, out_dir)
    return out_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/default/tokenizer")
    parser.add_argument("--vocab-size", type=int, default=8192)
    args = parser.parse_args(argv)
    out = build_default_tokenizer(Path(args.out), args.vocab_size)
    print(f"tokenizer in {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
