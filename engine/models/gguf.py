"""GGUF checkpoints (llama.cpp's format) for the Llama family and Gemma 2 / 3: config, tokenizer and weights
from one file.

A `model:` path may name a .gguf file, or a directory holding exactly one .gguf and no config.json.
Weights are dequantized by the `gguf` library (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_x and the
K-quants) into float32 and then cast to the serving dtype by the strict loader, under the Hugging
Face parameter names our modules use. llama.cpp stores a Llama's q/k projections with the rotary
halves interleaved; they are permuted back here, so the result equals the original checkpoint.

Gemma: llama.cpp stores every RMSNorm weight with Gemma's +1 added (its norms multiply by the weight), so
1 is subtracted here; its `ffn_norm` is Gemma's pre_feedforward_layernorm, and the post-norms have names
of their own. What the file does not say, llama.cpp fixes by convention and so does the config here:
layer types (Gemma 2: every other layer slides; Gemma 3: five sliding, then one full), Gemma 3's local
RoPE base (10000, unless the file gives rope.freq_base_swa) and query_pre_attn_scalar (head_dim, but
hidden / heads for the 27B models).
"""
from __future__ import annotations

import argparse
import copy
import json
import re
import warnings
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

# GGUF architecture -> (transformers architecture, model_type)
ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "gemma2": ("Gemma2ForCausalLM", "gemma2"),
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text"),
}
GEMMA = ("gemma2", "gemma3")
# Layer counts of the Gemma 27B models, whose query_pre_attn_scalar is hidden / heads (llama.cpp's rule).
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}

_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GEMMA_LAYER_NAMES = {**_LAYER_NAMES, "ffn_norm": "pre_feedforward_layernorm",
                      "post_attention_norm": "post_attention_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")


def _layer_names(architecture: str) -> dict[str, str]:
    return _GEMMA_LAYER_NAMES if architecture in GEMMA else _LAYER_NAMES


def find_gguf(path) -> Path | None:
    """The GGUF file `path` names (a .gguf file, or a directory with one and no config.json), else None."""
    path = Path(path)
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir() and not (path / "config.json").exists():
        files = sorted(path.glob("*.gguf"))
        if len(files) > 1:
            raise ValueError(f"{str(path)!r} holds several GGUF files ({', '.join(f.name for f in files)}): "
                             "name one of them as the model")
        return files[0] if files else None
    return None


@lru_cache(maxsize=8)
def _open_cached(path: str, mtime_ns: int, size: int) -> "GGUFCheckpoint":
    return GGUFCheckpoint(path)


def open_gguf(path) -> "GGUFCheckpoint":
    """One reader per file version and process: parsing a GGUF's metadata (a 49k-token vocabulary) takes
    seconds, and start-up reads the config, the tokenizer check and the weights of each model."""
    path = Path(path).resolve()
    stat = path.stat() if path.is_file() else None
    return _open_cached(str(path), stat.st_mtime_ns if stat else 0, stat.st_size if stat else 0)


def hf_name(gguf_name: str, architecture: str = "llama") -> str:
    """The Hugging Face parameter name of a GGUF tensor, or a ValueError naming it."""
    stem, _, leaf = gguf_name.rpartition(".")
    if stem in _GLOBAL_NAMES and leaf == "weight":
        return f"{_GLOBAL_NAMES[stem]}.weight"
    match, names = _LAYER_TENSOR.match(gguf_name), _layer_names(architecture)
    if match and match.group(2) in names:
        layer, kind, leaf = match.groups()
        return f"model.layers.{layer}.{names[kind]}.{leaf}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no place in a {architecture} model")


_HF_GLOBAL_NAMES = {f"{hf}.weight": f"{name}.weight" for name, hf in _GLOBAL_NAMES.items()}
_HF_LAYER_TENSOR = re.compile(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)$")


def gguf_name(hf_param: str, architecture: str = "llama") -> str:
    """The GGUF name of a Hugging Face parameter (the inverse of hf_name), or a ValueError naming it."""
    if hf_param in _HF_GLOBAL_NAMES:
        return _HF_GLOBAL_NAMES[hf_param]
    match = _HF_LAYER_TENSOR.match(hf_param)
    by_module = {hf: name for name, hf in _layer_names(architecture).items()}
    if match and match.group(2) in by_module:
        layer, module, leaf = match.groups()
        return f"blk.{layer}.{by_module[module]}.{leaf}"
    raise ValueError(f"tensor {hf_param!r} has no GGUF name")


def is_gemma_norm(architecture: str, name: str) -> bool:
    """A Gemma RMSNorm weight (GGUF or HF name), which llama.cpp stores with +1 added."""
    return architecture in GEMMA and name.endswith("norm.weight")


def unpermute_rotary(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row order (each head's rotary halves interleaved) for a [rows, ...] tensor."""
    rows = weight.shape[0]
    return (weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def permute_rotary(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's q/k row order: the inverse of unpermute_rotary (used to write GGUF files)."""
    rows = weight.shape[0]
    return (weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


class GGUFCheckpoint:
    """Read-only view of a GGUF file: metadata as a transformers config, tensors under HF names."""

    def __init__(self, path):
        import gguf

        self.path = Path(path)
        try:
            self.reader = gguf.GGUFReader(str(self.path))
        except Exception as exc:   # truncated file, bad magic, unknown version
            raise ValueError(f"cannot read GGUF file {str(self.path)!r}: {exc}") from exc
        self.architecture = self.field("general.architecture")
        if self.architecture not in ARCHITECTURES:
            supported = ", ".join(sorted(ARCHITECTURES))
            raise ValueError(f"GGUF architecture {self.architecture!r} is not supported; supported: {supported}")
        if "rope_freqs.weight" in self._tensors:
            raise ValueError("GGUF tensor 'rope_freqs.weight' (llama3 rope scaling) is not supported: "
                             "serve the original safetensors checkpoint instead")

    def field(self, key: str, default=None):
        field = self.reader.fields.get(key)
        return default if field is None else field.contents()

    def arch_field(self, key: str, default=None):
        return self.field(f"{self.architecture}.{key}", default)

    @cached_property
    def _tensors(self) -> dict:
        return {tensor.name: tensor for tensor in self.reader.tensors}

    @cached_property
    def config(self):
        """A transformers config equal to the original checkpoint's config.json."""
        from transformers import AutoConfig

        architecture, model_type = ARCHITECTURES[self.architecture]
        required = {"block_count", "embedding_length", "feed_forward_length", "attention.head_count"}
        missing = sorted(k for k in required if self.arch_field(k) is None)
        if missing:
            raise ValueError(f"GGUF file {self.path.name} lacks metadata: "
                             + ", ".join(f"{self.architecture}.{k}" for k in missing))
        hidden, heads = self.arch_field("embedding_length"), self.arch_field("attention.head_count")
        fields = dict(
            architectures=[architecture],
            vocab_size=int(self._tensors["token_embd.weight"].shape[-1]),
            hidden_size=hidden,
            intermediate_size=self.arch_field("feed_forward_length"),
            num_hidden_layers=self.arch_field("block_count"),
            num_attention_heads=heads,
            num_key_value_heads=self.arch_field("attention.head_count_kv", heads),
            head_dim=self.arch_field("attention.key_length", hidden // heads),
            max_position_embeddings=self.arch_field("context_length", 2048),
            rms_norm_eps=self.arch_field("attention.layer_norm_rms_epsilon", 1e-6),
            rope_theta=self.arch_field("rope.freq_base", 10000.0),
            rope_scaling=self._rope_scaling(),
            tie_word_embeddings="output.weight" not in self._tensors,
            bos_token_id=self.field("tokenizer.ggml.bos_token_id"),
            eos_token_id=self.field("tokenizer.ggml.eos_token_id"),
            pad_token_id=self.field("tokenizer.ggml.padding_token_id"),
            torch_dtype="bfloat16",
        )
        if self.architecture == "qwen2":
            fields["use_sliding_window"] = False
        if self.architecture in GEMMA:
            fields.update(self._gemma_fields(fields))
        return AutoConfig.for_model(model_type, **fields)

    def _gemma_fields(self, fields: dict) -> dict:
        """What a Gemma config needs beyond the Llama family's (see the module's docstring)."""
        layers, hidden, heads = fields["num_hidden_layers"], fields["hidden_size"], fields["num_attention_heads"]
        scalar = hidden // heads if layers == _GEMMA_27B_LAYERS[self.architecture] else fields["head_dim"]
        extra = dict(query_pre_attn_scalar=scalar, sliding_window=self.arch_field("attention.sliding_window"),
                     final_logit_softcapping=self.arch_field("final_logit_softcapping"))
        pattern = self.arch_field("attention.sliding_window_pattern")
        if isinstance(pattern, list):   # per layer: whether it slides
            extra["layer_types"] = ["sliding_attention" if s else "full_attention" for s in pattern]
        elif isinstance(pattern, int) and pattern > 0:   # every pattern-th layer is a full one
            extra["layer_types"] = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                                    for i in range(layers)]
        if self.architecture == "gemma2":
            extra["attn_logit_softcapping"] = self.arch_field("attn_logit_softcapping")
        else:
            extra["rope_local_base_freq"] = self.arch_field("rope.freq_base_swa", 10000.0)
        # Instruction-tuned Gemmas end a turn with <end_of_turn> (llama.cpp stops there too).
        tokens = self.field("tokenizer.ggml.tokens") or []
        if "<end_of_turn>" in tokens and fields["eos_token_id"] is not None:
            extra["eos_token_id"] = [fields["eos_token_id"], tokens.index("<end_of_turn>")]
        return extra

    def _rope_scaling(self) -> dict | None:
        kind = self.arch_field("rope.scaling.type")
        if kind in (None, "none"):
            return None
        if kind not in ("linear", "yarn"):
            raise ValueError(f"GGUF rope scaling {kind!r} is not supported (linear, yarn)")
        scaling = {"rope_type": kind, "factor": float(self.arch_field("rope.scaling.factor", 1.0))}
        if kind == "yarn":
            scaling["original_max_position_embeddings"] = self.arch_field("rope.scaling.original_context_length")
        return scaling

    def tensor_names(self) -> dict[str, str]:
        """HF parameter name -> GGUF tensor name, for every tensor in the file."""
        return {hf_name(name, self.architecture): name for name in self._tensors}

    def tensor(self, gguf_name: str) -> torch.Tensor:
        """One tensor, dequantized to float32 in PyTorch's [out, in] layout under HF conventions."""
        import gguf

        tensor = self._tensors[gguf_name]
        array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        array = array.reshape([int(d) for d in reversed(tensor.shape)])   # GGUF lists dims innermost first
        if is_gemma_norm(self.architecture, gguf_name):
            array = array - 1.0
        return torch.from_numpy(np.array(self._hf_rows(gguf_name, array), dtype=np.float32, order="C"))   # a writable copy

    def _hf_rows(self, gguf_name: str, array: np.ndarray) -> np.ndarray:
        """A tensor's rows in Hugging Face order: llama.cpp stores a Llama's q/k rows with each head's
        rotary halves interleaved (unpermute_rotary); every other tensor as is."""
        kind = gguf_name.split(".")[2] if gguf_name.startswith("blk.") else ""
        if self.architecture != "llama" or kind not in ("attn_q", "attn_k"):
            return array
        heads = self.config.num_attention_heads if kind == "attn_q" else self.config.num_key_value_heads
        return unpermute_rotary(array, heads)

    def tensors(self, skip=frozenset()) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, dequantized tensor) for every tensor but those named in `skip` (never dequantized)."""
        for hf, name in self.tensor_names().items():
            if hf not in skip:
                yield hf, self.tensor(name)

    def type_name(self, gguf_name: str) -> str:
        return self._tensors[gguf_name].tensor_type.name

    def raw(self, gguf_name: str) -> torch.Tensor:
        """A matrix's blocks as stored, uint8 [rows, bytes a row], rows in HF order (a Llama's q/k rows
        in HF order as in `tensor`): what engine/models/gguf_linear.py repacks."""
        tensor = self._tensors[gguf_name]
        array = self._hf_rows(gguf_name, np.asarray(tensor.data).reshape(int(tensor.shape[-1]), -1))
        with warnings.catch_warnings():   # the file's read-only mapping: read, never written
            warnings.simplefilter("ignore", UserWarning)
            return torch.from_numpy(np.ascontiguousarray(array))

    def tokenizer(self):
        """The file's tokenizer (with its chat template), built by transformers from the GGUF vocabulary."""
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(self.path.parent), gguf_file=self.path.name)
        template = self.field("tokenizer.chat_template")
        if not template and self.architecture in GEMMA and "<start_of_turn>" in tokenizer.get_vocab():
            template = GEMMA_CHAT_TEMPLATE   # a GGUF converted without one: Gemma's turn format
        if template and not getattr(tokenizer, "chat_template", None):
            tokenizer.chat_template = template
        return tokenizer

    def export(self, out_dir, dtype: torch.dtype = torch.float32) -> Path:
        """Write a Hugging Face checkpoint directory (safetensors, config, tokenizer, chat template)."""
        from safetensors.torch import save_file

        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        tensors = {name: tensor.to(dtype) for name, tensor in self.tensors()}
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt", "source": self.path.name})
        config = copy.deepcopy(self.config)   # the cached config stays as read
        config.dtype = str(dtype).replace("torch.", "")
        config.save_pretrained(out)
        (out / "generation_config.json").write_text(json.dumps(
            {"bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id,
             "pad_token_id": config.pad_token_id}, indent=2) + "\n")
        self.tokenizer().save_pretrained(out)
        return out


# Gemma's turns: <start_of_turn>{user|model}\n...<end_of_turn>\n; a system message opens the first user turn.
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}{% set system = messages[0]['content'] ~ '\n\n' if messages and messages[0]['role'] == 'system' "
    "else '' %}{% for message in messages if message['role'] != 'system' %}"
    "<start_of_turn>{{ 'model' if message['role'] == 'assistant' else message['role'] }}\n"
    "{{ (system if loop.first else '') ~ message['content'] | trim }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="specserve convert-gguf",
                                     description="Write a safetensors checkpoint directory from a GGUF file "
                                                 "(weights dequantized; config, tokenizer and chat template kept).")
    parser.add_argument("gguf", help="the .gguf file")
    parser.add_argument("out", help="output directory")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                        help="dtype of the written weights (float32 keeps the dequantized values exactly)")
    args = parser.parse_args(argv)
    try:
        out = GGUFCheckpoint(args.gguf).export(args.out, getattr(torch, args.dtype))
    except ValueError as exc:
        raise SystemExit(f"specserve convert-gguf: error: {exc}") from None
    print(f"wrote {out}")
    return 0
