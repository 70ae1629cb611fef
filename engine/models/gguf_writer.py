"""Writing GGUF files: a Llama-family or Gemma checkpoint (HF-named tensors, its config, its
tokenizer) as llama.cpp stores it, the inverse of engine/models/gguf.py's reading. The distiller
writes its drafts this way (train/draft_models.py), and the tests round-trip tiny models through it.
"""
from __future__ import annotations

import json

import numpy as np
import torch

from engine.models.gguf import ARCHITECTURES, is_gemma_norm, gguf_name, permute_rotary

def write_gguf(path, tensors: dict[str, torch.Tensor], config, tokenizer, qtype: str = "F32") -> None:
    """Write a Llama-family checkpoint (HF-named tensors, its config, a byte-level BPE tokenizer) as a
    GGUF file; matrices are stored as `qtype` (F32, F16, BF16, Q8_0, Q4_0, Q4_1, ...), vectors as F32."""
    import gguf

    architecture = {arch: gguf_arch for gguf_arch, (arch, _) in ARCHITECTURES.items()}.get(config.architectures[0])
    if architecture is None:
        raise ValueError(f"cannot write architecture {config.architectures[0]!r} as GGUF")
    matrix_type = gguf.GGMLQuantizationType[qtype]
    block = gguf.GGML_QUANT_SIZES[matrix_type][0]
    writer = gguf.GGUFWriter(str(path), architecture)
    _write_metadata(writer, config, matrix_type)
    _write_tokenizer(writer, tokenizer, config.vocab_size)
    for name, tensor in tensors.items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        array = tensor.detach().float().cpu().numpy()
        if is_gemma_norm(architecture, name):
            array = array + 1.0
        if architecture == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config.num_attention_heads if "q_proj" in name else config.num_key_value_heads
            array = permute_rotary(array, heads)
        if array.ndim == 2 and array.shape[-1] % block == 0:
            writer.add_tensor(gguf_name(name, architecture), gguf.quants.quantize(array, matrix_type),
                              raw_dtype=matrix_type)
        else:
            writer.add_tensor(gguf_name(name, architecture), array.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _write_metadata(writer, config, matrix_type) -> None:
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    rope = getattr(config, "rope_parameters", None) or {"rope_theta": getattr(config, "rope_theta", 10000.0)}
    rope = rope.get("full_attention", rope)   # Gemma 3's are per layer type (the local base: _write_gemma_metadata)
    writer.add_rope_freq_base(float(rope.get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    writer.add_vocab_size(config.vocab_size)
    if config.model_type in ("gemma2", "gemma3_text"):
        _write_gemma_metadata(writer, config)
    file_types = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "BF16": 32}
    if matrix_type.name in file_types:
        writer.add_file_type(file_types[matrix_type.name])


def _write_gemma_metadata(writer, config) -> None:
    """The Gemma settings GGUF has keys for; the rest must be llama.cpp's conventions (module docstring)."""
    if config.sliding_window is not None:
        writer.add_sliding_window(config.sliding_window)
    if getattr(config, "final_logit_softcapping", None) is not None:
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
    if getattr(config, "attn_logit_softcapping", None) is not None:
        writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
    writer.add_sliding_window_pattern([kind == "sliding_attention" for kind in config.layer_types])
    if config.model_type == "gemma3_text":
        writer.add_rope_freq_base_swa(float(config.rope_parameters["sliding_attention"]["rope_theta"]))


def _write_tokenizer(writer, tokenizer, vocab_size: int) -> None:
    """A byte-level BPE tokenizer as llama.cpp's "gpt2" tokenizer model, padded to the embedding rows."""
    model = json.loads(tokenizer.backend_tokenizer.to_str())["model"]
    if model.get("type") != "BPE":
        raise ValueError(f"only byte-level BPE tokenizers can be written to GGUF, not {model.get('type')}")
    tokens = {index: token for token, index in model["vocab"].items()}
    special = set()
    for index, added in tokenizer.added_tokens_decoder.items():
        tokens[index] = added.content
        if added.special:
            special.add(index)
    if max(tokens) >= vocab_size:
        raise ValueError(f"the tokenizer has ids up to {max(tokens)}, beyond the model's {vocab_size} embeddings")
    import gguf

    names, types = [], []
    for index in range(vocab_size):
        if index in tokens:
            names.append(tokens[index])
            types.append(gguf.TokenType.CONTROL if index in special else gguf.TokenType.NORMAL)
        else:
            names.append(f"[PAD{index}]")
            types.append(gguf.TokenType.UNUSED)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(names)
    writer.add_token_types(types)
    if merges:
        writer.add_token_merges(merges)
    else:   # a byte-only vocabulary: readers derive (no) merges from scores when the file lists none
        writer.add_token_scores([0.0] * vocab_size)
    for key, token_id in (("bos", tokenizer.bos_token_id), ("eos", tokenizer.eos_token_id),
                          ("pad", tokenizer.pad_token_id), ("unk", tokenizer.unk_token_id)):
        if token_id is not None:
            getattr(writer, f"add_{key}_token_id")(token_id)
    writer.add_add_bos_token(False)
    if getattr(tokenizer, "chat_template", None):
        writer.add_chat_template(tokenizer.chat_template)
