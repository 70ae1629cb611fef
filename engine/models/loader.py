"""Strict loading of Hugging Face safetensors (or GGUF) checkpoints into our modules.

The model is built on the meta device (no initialisation cost), every
parameter is then allocated once in the target dtype/device and filled from
the checkpoint. Every checkpoint tensor must land in a parameter and every
parameter must be filled: anything else is a ValueError naming the tensors,
raised after reading only the checkpoint's headers. A GGUF file (engine/models/gguf.py) is one
more source of tensors under the same names, checked the same way.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from engine.models.gguf import GGUFCheckpoint, find_gguf, open_gguf
from engine.models.multimodal import text_config, text_view
from engine.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from engine.models.gguf_linear import GGUFLinear, GGUFPart, quantize_blocks, servable
from engine.models.llama import CausalLM, FusedLinear, arrange_rotary_dims
from engine.models.parallel import TensorParallel, build_sharded, shard_plan

SUPPORTED_ARCHITECTURES: dict[str, type[CausalLM]] = {
    "LlamaForCausalLM": CausalLM,
    "MistralForCausalLM": CausalLM,
    "MixtralForCausalLM": CausalLM,
    "Qwen2ForCausalLM": CausalLM,
    "Qwen3ForCausalLM": CausalLM,
    "Qwen3MoeForCausalLM": CausalLM,
    "Phi3ForCausalLM": CausalLM,
    "GptOssForCausalLM": CausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
}

# Checkpoint tensors that some exporters include but that are derived, not learned.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def load_hf_config(path):
    """Read config.json of a local checkpoint directory, or a GGUF file's metadata (never downloads)."""
    from transformers import AutoConfig

    gguf_file = find_gguf(path)
    if gguf_file is not None:
        return open_gguf(gguf_file).config
    directory = Path(path)
    if not directory.is_dir():
        raise ValueError(f"model path {str(path)!r} does not exist or is not a directory")
    if not (directory / "config.json").is_file():
        raise ValueError(f"{str(path)!r} is not a Hugging Face checkpoint: it has no config.json")
    try:
        config = AutoConfig.from_pretrained(str(directory), local_files_only=True)
    except Exception as exc:  # unknown model_type, malformed JSON, ...
        raise ValueError(f"cannot read the config in {str(path)!r}: {exc}") from exc
    return text_config(config)   # a vision-language checkpoint is served as its language model


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
    raise ValueError(f"no model.safetensors, model.safetensors.index.json or pytorch_model.bin in "
                     f"{str(path)!r} (safetensors checkpoints, single-file .bin ones and GGUF files are supported)")


def token_vocabulary(path) -> list[str] | None:
    """The tokenizer's token strings by id (from tokenizer.json or GGUF metadata), or None if absent.

    Read from the files directly, without building a tokenizer: this only decides whether a draft
    and a target share one."""
    gguf_file = find_gguf(path)
    if gguf_file is not None:
        return open_gguf(gguf_file).field("tokenizer.ggml.tokens")
    tokenizer_json = Path(path) / "tokenizer.json"
    if not tokenizer_json.is_file():
        return None
    data = json.loads(tokenizer_json.read_text())
    by_id = {index: token for token, index in (data.get("model", {}).get("vocab") or {}).items()}
    by_id.update({added["id"]: added["content"] for added in data.get("added_tokens", [])})
    return [by_id.get(i) for i in range(max(by_id) + 1)] if by_id else None


def check_same_tokenizer(target_path, target_config, draft_path, draft_config) -> None:
    """A draft must tokenize like its target. Embedding tables may be padded to different sizes
    (Qwen2.5-0.5B has 151936 rows, 7B 152064), so the tokenizers are compared, not the row counts."""
    target_vocab, draft_vocab = token_vocabulary(target_path), token_vocabulary(draft_path)
    if target_vocab is None or draft_vocab is None:
        if draft_config.vocab_size != target_config.vocab_size:
            raise ValueError(f"draft model vocabulary ({draft_config.vocab_size} tokens) differs from the target's "
                             f"({target_config.vocab_size}) and a tokenizer is missing to compare them: the draft "
                             "must share the target's tokenizer")
        return
    n = min(len(target_vocab), len(draft_vocab))
    differing = next((i for i in range(n) if target_vocab[i] != draft_vocab[i]), None)
    if differing is not None:
        raise ValueError(f"the draft's tokenizer differs from the target's (token {differing}: "
                         f"{draft_vocab[differing]!r} vs {target_vocab[differing]!r}): the draft must share "
                         "the target's tokenizer")
    if max(len(target_vocab), len(draft_vocab)) > min(target_config.vocab_size, draft_config.vocab_size):
        raise ValueError(f"the tokenizer has {max(len(target_vocab), len(draft_vocab))} tokens but the "
                         f"{'draft' if draft_config.vocab_size < target_config.vocab_size else 'target'} has only "
                         f"{min(target_config.vocab_size, draft_config.vocab_size)} embedding rows")


class SafetensorsCheckpoint:
    """The tensors of a (possibly sharded) safetensors checkpoint, read lazily file by file."""

    def __init__(self, files: list[Path]):
        self.files = files
        self.where = _checkpoint_keys(files)

    def tensor_names(self):
        return self.where.keys()

    def tensors(self, skip=frozenset(), slices=None):
        """slices: name -> (dim, start, length), the part of that tensor to read (a tensor-parallel shard)."""
        slices = slices or {}
        for file in self.files:
            with safe_open(file, framework="pt", device="cpu") as f:
                for key in f.keys():
                    if key in skip:
                        continue
                    if key not in slices:
                        yield key, f.get_tensor(key)
                        continue
                    dim, start, length = slices[key]
                    index = (slice(None),) * dim + (slice(start, start + length),)
                    yield key, f.get_slice(key)[index]

    def get(self, name: str) -> torch.Tensor | None:
        """One tensor, reading no other; None when the checkpoint has none of that name."""
        if name not in self.where:
            return None
        with safe_open(self.where[name], framework="pt", device="cpu") as f:
            return f.get_tensor(name)


class TorchBinCheckpoint:
    """A single pytorch_model.bin, as some published EAGLE heads ship: read with weights_only, so
    the pickle can hold tensors only."""

    def __init__(self, file: Path):
        self.state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)

    def tensor_names(self):
        return self.state.keys()

    def tensors(self, skip=frozenset()):
        yield from ((key, tensor) for key, tensor in self.state.items() if key not in skip)

    def get(self, name: str) -> torch.Tensor | None:
        return self.state.get(name)


def open_checkpoint(path) -> SafetensorsCheckpoint | GGUFCheckpoint | TorchBinCheckpoint:
    gguf_file = find_gguf(path)
    if gguf_file is not None:
        return open_gguf(gguf_file)
    pickled = Path(path) / "pytorch_model.bin"
    if pickled.is_file() and not list(Path(path).glob("model*.safetensors*")):
        return TorchBinCheckpoint(pickled)
    return text_view(SafetensorsCheckpoint(weight_files(path)))


def load_model(path: str, dtype: torch.dtype, device: torch.device, gguf_blocks: bool = False,
               output_tokens: torch.Tensor | None = None, requantize: str | None = None,
               tensor_parallel: TensorParallel | None = None, random_weights: bool = False) -> CausalLM:
    """The model on device in dtype; with gguf_blocks (`quantization: gguf`), a GGUF file's linears in
    kernel-supported types are served from their blocks (engine/models/gguf_linear.py), never dequantized;
    with `requantize` (a GGUF type name: a draft's `speculative.draft.quantization`), every linear of any
    checkpoint is quantized into that type at load and served by the same kernels.
    output_tokens (token ids): an LM head over those rows only (a draft vocabulary, see
    CausalLM.compute_logits). tensor_parallel: this rank's shard only (engine/models/parallel.py), read
    from a safetensors checkpoint slice by slice. random_weights (`load_format: dummy`): no weight is
    read; the config's shapes get random ones (fill_random)."""
    config = load_hf_config(path)
    model_cls = SUPPORTED_ARCHITECTURES[architecture_of(config)]
    device = torch.device(device)
    sharded = tensor_parallel is not None and tensor_parallel.world_size > 1
    checkpoint = None if random_weights else open_checkpoint(path)
    if sharded and checkpoint is not None and (not isinstance(checkpoint, SafetensorsCheckpoint) or gguf_blocks
                                               or requantize or output_tokens is not None):
        raise ValueError("tensor parallelism loads safetensors checkpoints, unquantized, whole vocabulary")
    with torch.device("meta"):
        model = build_sharded(config, tensor_parallel, model_cls) if sharded else model_cls(config)
    if checkpoint is None:
        fill_random(model, dtype, device)
    elif sharded:
        load_weights(model, checkpoint, dtype, device, shard=shard_plan)
    else:
        served = serve_gguf_linears(model, checkpoint, output_tokens, requantize) \
            if requantize or (gguf_blocks and isinstance(checkpoint, GGUFCheckpoint)) else frozenset()
        load_weights(model, checkpoint, dtype, device, served)
    arrange_rotary_dims(model)
    if output_tokens is not None:
        restrict_output(model, output_tokens.to(device))
    model.init_buffers(device, dtype)
    return model.eval()


def fill_random(model: CausalLM, dtype: torch.dtype, device: torch.device, seed: int = 0) -> None:
    """Every parameter of a (meta) model made on the device: norm weights 1, biases 0, the rest
    N(0, 0.02), so activations stay in range through any depth. The costs of a shape, for benchmarks
    and device checks that cannot carry its weights."""
    generator = torch.Generator(device=device).manual_seed(seed)
    filled = {}
    for name, param in model.named_parameters():
        tensor = filled[name] = torch.empty(param.shape, dtype=dtype, device=device)
        if param.dim() == 1:
            tensor.fill_(1.0 if "norm" in name.rsplit(".", 2)[-2] else 0.0)
        else:
            tensor.normal_(0.0, 0.02, generator=generator)
    set_parameters(model, filled)


def restrict_output(model: CausalLM, token_ids: torch.Tensor) -> None:
    """The LM head over `token_ids` only (a GGUFLinear is built over those rows already)."""
    if isinstance(model.lm_head, nn.Linear):
        head = nn.Linear(model.lm_head.in_features, len(token_ids), bias=False, device=token_ids.device,
                         dtype=model.lm_head.weight.dtype)
        head.weight = nn.Parameter(model.lm_head.weight.detach()[token_ids].clone(), requires_grad=False)
        model.lm_head = head
    model.output_tokens = token_ids


def special_token_ids(path) -> list[int]:
    """The ids of a checkpoint's control / added tokens (chat markers, end of text), from GGUF token types
    or tokenizer.json: a draft vocabulary keeps them whatever their id."""
    gguf_file = find_gguf(path)
    if gguf_file is not None:
        types = open_gguf(gguf_file).field("tokenizer.ggml.token_type") or []
        return [i for i, kind in enumerate(types) if kind in (3, 4)]   # CONTROL, USER_DEFINED
    tokenizer_json = Path(path) / "tokenizer.json"
    if not tokenizer_json.is_file():
        return []
    return [added["id"] for added in json.loads(tokenizer_json.read_text()).get("added_tokens", [])]


def serve_gguf_linears(model: CausalLM, checkpoint, output_tokens: torch.Tensor | None = None,
                       requantize: str | None = None) -> frozenset[str]:
    """Swap each linear of a meta model whose checkpoint tensors all have a kernel type for a GGUFLinear
    over their blocks (the LM head over `output_tokens`' rows only, when given); returns the checkpoint
    names it took (their biases stay for load_weights). With `requantize`, every linear's weights are
    first quantized into that type (from a GGUF file's dequantized blocks or a dense checkpoint)."""
    names = checkpoint.tensor_names()
    names = names if isinstance(names, dict) else {name: name for name in names}   # HF -> the checkpoint's
    served = set()
    for module_name, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear):
            continue
        parent_name, _, child = module_name.rpartition(".")
        if isinstance(module, FusedLinear):
            keys = [f"{parent_name}.{shard}.weight" for shard, _, _ in module.shards()]
        elif module_name == "lm_head" and model.tie_word_embeddings:
            keys = ["model.embed_tokens.weight"]   # the head's blocks; the embedding still loads dense
        else:
            keys = [f"{module_name}.weight"]
        if not all(k in names and servable(requantize or checkpoint.type_name(names[k]), module.in_features)
                   for k in keys):
            continue
        rows = output_tokens if module_name == "lm_head" else None
        parts = []
        for k in keys:
            blocks, type_name = weight_blocks(checkpoint, names[k], requantize)
            parts.append(GGUFPart(blocks if rows is None else blocks[rows], type_name, module.in_features))
        shards = module.shard_names if isinstance(module, FusedLinear) else None
        setattr(model.get_submodule(parent_name) if parent_name else model, child,
                GGUFLinear(module.in_features, parts, module.bias is not None, shards))
        served.update(k for k in keys if k != "model.embed_tokens.weight")
    return frozenset(served)


def weight_blocks(checkpoint, name: str, requantize: str | None) -> tuple[torch.Tensor, str]:
    """A matrix's GGUF blocks (uint8 [rows, bytes a row]) and their type: as a GGUF file stores them, or
    quantized into `requantize` from the float weight."""
    if requantize is None:
        return checkpoint.raw(name), checkpoint.type_name(name)
    weight = checkpoint.tensor(name) if isinstance(checkpoint, GGUFCheckpoint) else checkpoint.get(name)
    return quantize_blocks(weight, requantize), requantize


def _checkpoint_plan(model: CausalLM, names=frozenset()) -> dict[str, tuple[str, int | None, int | None]]:
    """checkpoint tensor name -> (our parameter name, row offset, rows); offset None = whole tensor, rows
    of a 3-D parameter counted in its [E * rows, cols] view. Mixtures of experts plan their own tensors
    from the checkpoint's `names` (per-expert or fused: SparseMoeBlock.checkpoint_plan)."""
    plan = {}
    for module_name, module in model.named_modules():
        if hasattr(module, "checkpoint_plan"):
            plan.update(module.checkpoint_plan(module_name, names))
    planned = {name for name, _, _ in plan.values()}
    for name, _ in model.named_parameters():  # tied parameters appear once, under embed_tokens
        if name in planned:
            continue
        module_name, _, leaf = name.rpartition(".")
        module = model.get_submodule(module_name)
        if getattr(module, "shard_names", None):   # a FusedLinear, or a GGUFLinear in its place
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
    if key.endswith(_IGNORED_SUFFIXES) or key in getattr(model, "extra_tensors", ()):
        return True
    # Tied embeddings: the head is embed_tokens; a saved copy of it is redundant.
    return model.tie_word_embeddings and key == "lm_head.weight"


def _name_list(names) -> str:
    names = sorted(names)
    shown = ", ".join(names[:10])
    return shown + (f" (and {len(names) - 10} more)" if len(names) > 10 else "")


def load_weights(model: CausalLM, checkpoint, dtype: torch.dtype, device: torch.device,
                 served: frozenset[str] = frozenset(), shard=None) -> None:
    """Fill every parameter of a (meta) model from a checkpoint (safetensors or GGUF), strictly; `served`
    names the checkpoint tensors already taken by GGUFLinears. shard(model, plan) -> (plan, slices): a
    tensor-parallel rank's plan and the slice of each tensor it reads (parallel.shard_plan)."""
    where = set(checkpoint.tensor_names()) - served
    plan = _checkpoint_plan(model, where)
    slices = None
    if shard is not None:
        plan, slices = shard(model, plan)
    missing = set(plan) - set(where)
    unexpected = {k for k in set(where) - set(plan) if not _is_ignorable(k, model)}
    if missing:
        raise ValueError(f"checkpoint is missing tensors: {_name_list(missing)}")
    if unexpected:
        raise ValueError(f"checkpoint has unexpected tensors: {_name_list(unexpected)}")

    params = dict(model.named_parameters())
    filled = {name: torch.empty(p.shape, dtype=dtype, device=device) for name, p in params.items()}
    tensors = checkpoint.tensors(slices=slices) if slices else \
        checkpoint.tensors(skip=served) if served else checkpoint.tensors()
    for key, tensor in tensors:
        if key not in plan:
            continue
        name, offset, rows = plan[key]
        target = filled[name]
        if offset is not None:   # rows of a fused 2-D weight, or of the [E * rows, cols] view of 3-D experts
            target = (target.flatten(0, 1) if target.dim() == 3 else target).narrow(0, offset, rows)
        if tensor.shape != target.shape:
            raise ValueError(f"tensor {key!r} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}")
        target.copy_(tensor)

    set_parameters(model, filled)


def set_parameters(model: CausalLM, tensors: dict[str, torch.Tensor]) -> None:
    """The (meta) model's parameters replaced by these tensors (name -> tensor), then tied."""
    for name, tensor in tensors.items():
        module_name, _, leaf = name.rpartition(".")
        model.get_submodule(module_name)._parameters[leaf] = nn.Parameter(tensor, requires_grad=False)
    model.tie_weights()
