"""The numbers seqkv reads from a model's config, read one way for every runtime path.

A multimodal model's config nests its language model's config under ``text_config``; the
layers, heads and context a canonical forward and a capture need are that one's. Loading
(`LoadedModel`), the portable forward and the legacy canonical forward all read them here,
and answer to the same attribute names through `ShapeAttributes`.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_CONTEXT = 2048  # a config that names no context


def text_config(config):
    """The config holding the language model's numbers: the nested ``text_config`` of a
    multimodal config, else ``config`` itself."""
    return getattr(config, "text_config", None) or config


@dataclass(frozen=True)
class ModelShape:
    """The language model's shape, as its (text) config states it."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_context: int

    @classmethod
    def of(cls, config) -> ModelShape:
        cfg = text_config(config)
        heads = cfg.num_attention_heads
        return cls(
            num_layers=cfg.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
            head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
            vocab_size=cfg.vocab_size,
            max_context=getattr(cfg, "max_position_embeddings", None) or DEFAULT_CONTEXT,
        )


def _from_shape(name: str) -> property:
    return property(lambda self: getattr(self.shape, name), doc=f"`ModelShape.{name}`")


class ShapeAttributes:
    """``num_layers``, ``num_heads``, ... of a class whose ``shape`` is its `ModelShape`."""

    num_layers = _from_shape("num_layers")
    num_heads = _from_shape("num_heads")
    num_kv_heads = _from_shape("num_kv_heads")
    head_dim = _from_shape("head_dim")
    vocab_size = _from_shape("vocab_size")
    max_context = _from_shape("max_context")
