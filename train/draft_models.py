"""The models of a distillation: the frozen target, and the draft (new, from the target's own
layers, or an existing checkpoint), and the draft's export for serving."""
from __future__ import annotations

import math
from pathlib import Path

import torch

from engine.models.gguf import find_gguf, open_gguf
from train.common import TrainError, copy_tokenizer_files, export_model

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
SAVE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def hf_model(path, dtype: torch.dtype = torch.float32):
    """A transformers model of a checkpoint directory or GGUF file (GGUF dequantized by our reader)."""
    from transformers import AutoModelForCausalLM

    gguf_file = find_gguf(path)
    if gguf_file is None:
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    checkpoint = open_gguf(gguf_file)
    model = AutoModelForCausalLM.from_config(checkpoint.config, dtype=dtype)
    model.load_state_dict(dict(checkpoint.tensors()), strict=not checkpoint.config.tie_word_embeddings)
    model.tie_weights()
    return model


def model_config(path):
    """The checkpoint's config (config.json or GGUF metadata), read by the engine's own loader."""
    from engine.models.loader import load_hf_config

    try:
        return load_hf_config(path)
    except ValueError as exc:
        raise TrainError(str(exc)) from None


def load_target(path: str, device: torch.device = torch.device("cpu")):
    """The frozen target; bf16 weights on CUDA, fp32 on CPU (where bf16 runs under autocast)."""
    target_dir = Path(path)
    if not target_dir.exists():
        raise TrainError(f"target checkpoint not found: {target_dir}")
    if find_gguf(target_dir) is None and not (target_dir / "config.json").exists():
        raise TrainError(f"target {target_dir} is not a Hugging Face model directory (no config.json) or GGUF file")
    config = model_config(target_dir)
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise TrainError(f"target model type {config.model_type!r} is not supported "
                         f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = hf_model(target_dir, dtype).to(device)
    return model.eval().requires_grad_(False)


def new_draft(target, layers: int, hidden: int, heads: int, kv_heads: int, intermediate: int | None,
              init_embeddings: str, seed: int):
    """A fresh Llama draft sharing the target's vocabulary and special ids."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tc = target.config
    if hidden % heads or heads % kv_heads:
        raise TrainError(f"draft hidden {hidden} / heads {heads} / kv heads {kv_heads}: "
                         "hidden must divide by heads, heads by kv heads")
    config = LlamaConfig(
        vocab_size=tc.vocab_size, hidden_size=hidden,
        intermediate_size=intermediate or 32 * math.ceil(hidden * 8 / 3 / 32),
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=getattr(tc, "max_position_embeddings", 2048), rms_norm_eps=1e-5,
        tie_word_embeddings=True, bos_token_id=tc.bos_token_id, eos_token_id=tc.eos_token_id,
        pad_token_id=getattr(tc, "pad_token_id", None),
    )
    torch.manual_seed(seed)
    draft = LlamaForCausalLM(config)
    if init_embeddings == "pca":
        init_embeddings_from_target(draft, target)
    return draft


def draft_from_target_layers(target, layers: list[int]):
    """A draft of the target's own architecture keeping only the given decoder layers (plus its
    embeddings, final norm and head): it starts out agreeing with the target far more than a
    random model, and shares its tokenizer by construction."""
    import copy

    num_layers = target.config.num_hidden_layers
    bad = [i for i in layers if not 0 <= i < num_layers]
    if bad or not layers:
        raise TrainError(f"--draft-from-target-layers needs layer indices in 0..{num_layers - 1}, got {layers}")
    config = copy.deepcopy(target.config)
    config.num_hidden_layers = len(layers)
    if getattr(config, "layer_types", None):
        config.layer_types = [config.layer_types[i] for i in layers]
    draft = type(target)(config).to(torch.float32)
    state = {}
    for name, tensor in target.state_dict().items():
        parts = name.split(".")
        if len(parts) > 3 and parts[1] == "layers":
            if int(parts[2]) not in layers:
                continue
            parts[2] = str(layers.index(int(parts[2])))
        state[".".join(parts)] = tensor.float()
    draft.load_state_dict(state, strict=True)
    return draft


@torch.no_grad()
def init_embeddings_from_target(draft, target) -> None:
    """Start the draft's (tied) embeddings from the target's, projected onto
    their top principal directions: similar tokens start close together."""
    source = target.get_input_embeddings().weight.float().cpu()
    dest = draft.get_input_embeddings().weight
    dim = dest.shape[1]
    if dim > min(source.shape):
        return
    centered = source - source.mean(0, keepdim=True)
    u, s, _ = torch.linalg.svd(centered, full_matrices=False)
    projected = u[:, :dim] * s[:dim]
    projected *= dest.std() / projected.std()
    dest.copy_(projected.to(dest.dtype))


def load_existing_draft(path: str, target, target_path: str):
    """A draft checkpoint to keep training; it must tokenize like the target."""
    draft_dir = Path(path)
    if find_gguf(draft_dir) is None and not (draft_dir / "config.json").exists():
        raise TrainError(f"draft checkpoint not found: {draft_dir} (no config.json)")
    from engine.models.loader import check_same_tokenizer

    try:   # tokenizers compared, so tables padded to different sizes (Qwen2.5 0.5B vs 7B) are fine
        check_same_tokenizer(target_path, target.config, draft_dir, model_config(draft_dir))
    except ValueError as exc:
        raise TrainError(str(exc)) from None
    return hf_model(draft_dir, torch.float32)


def export_draft(draft, out_dir: Path, target_dir: Path, save_format: str, save_dtype: str, gguf_type: str) -> Path:
    """The serving copy: a Hugging Face directory (safetensors in save_dtype, the target's tokenizer
    files), or one GGUF file carrying the target's tokenizer (quantized weights fit where bf16 would not)."""
    from engine.models.gguf_writer import write_gguf
    from engine.tokenizer import load_tokenizer

    out_dir.mkdir(parents=True, exist_ok=True)
    if save_format == "gguf":
        path = out_dir / "draft.gguf"
        state = {k: v.detach().float().cpu() for k, v in draft.state_dict().items()}
        write_gguf(path, state, draft.config, load_tokenizer(str(target_dir)), gguf_type)
        return path
    export_model(draft, out_dir, None, SAVE_DTYPES[save_dtype])
    if find_gguf(target_dir) is None:
        copy_tokenizer_files(target_dir, out_dir)
    else:
        load_tokenizer(str(target_dir)).save_pretrained(out_dir)
    return out_dir
