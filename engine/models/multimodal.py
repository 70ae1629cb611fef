"""Vision-language checkpoints served as their language model (text in, text out).

Gemma 3 from 4B up ships as Gemma3ForConditionalGeneration: a SigLIP vision tower and a projector
beside the Gemma 3 decoder. The server takes text only, so such a checkpoint is read as its
language model: the config's text_config, the decoder's tensors under the names the text model
uses, and the vision tower's and projector's tensors left unread (counted in the log: nothing is
dropped silently, and any other tensor the text model does not use is still an error).
"""
from __future__ import annotations

import logging

logger = logging.getLogger("specserve.engine")

# architecture -> (its language model's architecture, checkpoint prefix renames, prefixes left unread).
# Renames cover the hub's layout (language_model.model.*) and transformers 5's (model.language_model.*).
TEXT_MODELS = {
    "Gemma3ForConditionalGeneration": (
        "Gemma3ForCausalLM",
        (("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."),
         ("model.language_model.", "model.")),
        ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector."),
    ),
}
_RENAMES = tuple(rename for _, renames, _ in TEXT_MODELS.values() for rename in renames)
_UNREAD = tuple(prefix for _, _, unread in TEXT_MODELS.values() for prefix in unread)


def text_config(config):
    """A vision-language config's language-model config (architectures naming the text model); any
    other config as it is."""
    names = getattr(config, "architectures", None) or []
    if not names or names[0] not in TEXT_MODELS:
        return config
    text = config.text_config
    text.architectures = [TEXT_MODELS[names[0]][0]]
    text.tie_word_embeddings = getattr(config, "tie_word_embeddings", text.tie_word_embeddings)
    return text


def _text_name(name: str) -> str:
    for old, new in _RENAMES:
        if name.startswith(old):
            return new + name[len(old):]
    return name


class TextCheckpoint:
    """A vision-language checkpoint seen as its language model's: the decoder's tensors renamed, the
    vision tower's and projector's not listed (the checkpoint interface the strict loader reads)."""

    def __init__(self, checkpoint):
        self.checkpoint = checkpoint
        names = list(checkpoint.tensor_names())
        self.unread = [n for n in names if n.startswith(_UNREAD)]
        self.names = {_text_name(n): n for n in names if not n.startswith(_UNREAD)}   # ours -> theirs
        logger.info("serving the language model of a vision-language checkpoint: %d vision tensors left unread",
                    len(self.unread))

    def tensor_names(self):
        return self.names.keys()

    def tensors(self, skip=frozenset()):
        theirs_skipped = {self.names[n] for n in skip if n in self.names} | set(self.unread)
        for name, tensor in self.checkpoint.tensors(skip=theirs_skipped):
            yield _text_name(name), tensor

    def get(self, name: str):
        return self.checkpoint.get(self.names[name]) if name in self.names else None


def text_view(checkpoint):
    """The checkpoint as its language model's, when it is a vision-language one; else as it is."""
    names = checkpoint.tensor_names()
    if any(n.startswith(_UNREAD) or _text_name(n) != n for n in names):
        return TextCheckpoint(checkpoint)
    return checkpoint
