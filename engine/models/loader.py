"""Strict loading of Hugging Face safetensors checkpoints into our modules.

The model is built on the meta device (no initialisation cost), every
parameter is then allocated once in the target dtype/device and filled from
the checkpoint. Every checkpoint tensor must land in a parameter and every
parameter must be filled: anything else is a ValueError naming the tensors,
raised after reading only the safetensors headers.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from engine.models.llama import CausalLM, FusedLinear

SUPPORTED_ARCHITECTURES: dict[str, type[CausalLM]] = {
    "LlamaForCausalLM": CausalLM,
    "MistralForCausalLM": CausalLM,
    "Qwen2ForCausalLM": CausalLM,
    "Qwen3ForCausalLM": CausalLM,
}

# Checkpoint tensors that some exporters include but that are derived, not learned.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def load_hf_config(path):
    """Read config.json of a local checkpoint directory (never downloads)."""
    from transformers import AutoConfig

    directory = Path(path)
    if not directory.is_dir():
        raise ValueError(f"model path {str(path)!r} does not exist or is not a directory")
    if not (directory / "config.json").is_file():
        raise ValueError(f"{str(path)!r} is not a Hugging Face checkpoint: it has no config.json")
    try:
        return AutoConfig.from_pretrained(str(directory), local_files_only=True)
    except Exception as exc:  # unknown model_type, malformed JSON, ...
        raise ValueError(f"cannot read the config in {str(path)!r}: {exc}") from exc


def architecture_of(config) -> str:
    """The supported architecture named by the config, or a ValueError listing what is supported."""
    supported = ", ".join(sorted(SUPPORTED_ARCHITECTURES))
    names = list(getattr(config, "architectures", None) or [])
    if not names:
        raise ValueError(f"config.json names no architecture; supported: {supported}")
    if names[0] not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"unsupported architecture {names[0]!r}; supported: {supported}")
    return names[0]


def weight_files(path) -> list[Path]:
    """The safetensors files of a single-file or sharded checkpoint."""
    directory = Path(path)
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [directory / name for name in sorted(set(weight_map.values()))]
        missing = [str(f.name) for f in files if not f.is_file()]
        if missing:
            raise ValueError(f"{index} lists shards that do not exist: {', '.join(missing)}")
        return files
    single = directory / "model.safetensors"
    if single.is_file():
        return [single]
    raise ValueError(f"no model.safetensors or model.safetensors.index.json in {str(path)!r} "
                     "(only safetensors checkpoints are supported)")


def load_model(path: str, dtype: torch.dtype, device: torch.device) -> CausalLM:
    config = load_hf_config(path)
    model_cls = SUPPORTED_ARCHITECTURES[architecture_of(config)]
    files = weight_files(path)
    device = torch.device(device)
    with torch.device("meta"):
        model = model_cls(config)
    load_weights(model, files, dtype, device)
    model.init_buffers(device, dtype)
    return model.eval()


def _checkpoint_plan(model: CausalLM) -> dict[str, tuple[str, int | None, int | None]]:
    """checkpoint tensor name -> (our parameter name, row offset, rows); offset None = whole tensor."""
    plan = {}
    for name, _ in model.named_parameters():  # tied parameters appear once, under embed_tokens
        module_name, _, leaf = name.rpartition(".")
        module = model.get_submodule(module_name)
        if isinstance(module, FusedLinear):
            parent = module_name.rpartition(".")[0]
            for shard, offset, rows in module.shards():
                plan[f"{parent}.{shard}.{leaf}"] = (name, offset, rows)
        else:
            plan[name] = (name, None, None)
    return plan


def _checkpoint_keys(files: list[Path]) -> dict[str, Path]:
    where: dict[str, Path] = {}
    for file in files:
        with safe_open(file, framework="pt", device="cpu") as f:
            for key in f.keys():
                if key in where:
                    raise ValueError(f"tensor {key!r} appears in both {where[key].name} and {file.name}")
                where[key] = file
    return where


def _is_ignorable(key: str, model: CausalLM) -> bool:
    if key.endswith(_IGNORED_SUFFIXES):
        return True
    # Tied embeddings: the head is embed_tokens; a saved copy of it is redundant.
    return model.tie_word_embeddings and key == "lm_head.weight"


def _name_list(names) -> str:
    names = sorted(names)
    shown = ", ".join(names[:10])
    return shown + (f" (and {len(names) - 10} more)" if len(names) > 10 else "")


def load_weights(model: CausalLM, files: list[Path], dtype: torch.dtype, device: torch.device) -> None:
    """Fill every parameter of a (meta) model from the safetensors files, strictly."""
    plan = _checkpoint_plan(model)
    where = _checkpoint_keys(files)
    missing = set(plan) - set(where)
    unexpected = {k for k in set(where) - set(plan) if not _is_ignorable(k, model)}
    if missing:
        raise ValueError(f"checkpoint is missing tensors: {_name_list(missing)}")
    if unexpected:
        raise ValueError(f"checkpoint has unexpected tensors: {_name_list(unexpected)}")

    params = dict(model.named_parameters())
    filled = {name: torch.empty(p.shape, dtype=dtype, device=device) for name, p in params.items()}
    for file in files:
        with safe_open(file, framework="pt", device="cpu") as f:
            for key in f.keys():
                if key not in plan:
                    continue
                name, offset, rows = plan[key]
                target = filled[name] if offset is None else filled[name].narrow(0, offset, rows)
                tensor = f.get_tensor(key)
                if tensor.shape != target.shape:
                    raise ValueError(f"tensor {key!r} has shape {tuple(tensor.shape)}, "
                                     f"expected {tuple(target.shape)}")
                target.copy_(tensor)

    for name, tensor in filled.items():
        module_name, _, leaf = name.rpartition(".")
        model.get_submodule(module_name)._parameters[leaf] = nn.Parameter(tensor, requires_grad=False)
    model.tie_weights()
