"""One reading of a model's config: loading, the portable forward and the legacy forward take
the layers, heads and context from the same place, the nested ``text_config`` of a
multimodal config (built offline from transformers' config classes)."""

from __future__ import annotations

import pytest

from conftest import tiny_family_model
from seqkv_cli.errors import SeqkvError
from seqkv_cli.runtime.legacy import CanonicalLM
from seqkv_cli.runtime.loading import LoadedModel
from seqkv_cli.runtime.model_config import ModelShape, text_config
from seqkv_cli.runtime.portable.model import PortableLM

WANT = ModelShape(
    num_layers=3, num_heads=4, num_kv_heads=2, head_dim=24, vocab_size=300, max_context=192
)


def _text_model():
    # head_dim is not hidden_size // heads here: read from the config, not derived.
    return tiny_family_model("llama", num_hidden_layers=3, head_dim=24, max_position_embeddings=192)


def _multimodal(text):
    """A LLaVA config nesting ``text`` (the vision side at its defaults: never built)."""
    from transformers import LlavaConfig

    return LlavaConfig(text_config=text)


def _shape_of(lm) -> ModelShape:
    return ModelShape(
        lm.num_layers,
        lm.num_heads,
        lm.num_kv_heads,
        lm.head_dim,
        lm.vocab_size,
        lm.max_context,
    )


def _loaded(model) -> LoadedModel:
    return LoadedModel(model, None, "tiny", "test", "instance", "fp", "none")


def test_text_config_is_the_nested_one_or_the_config_itself():
    model = _text_model()
    wrapper = _multimodal(model.config)
    assert text_config(wrapper) is model.config
    assert text_config(model.config) is model.config
    assert ModelShape.of(wrapper) == ModelShape.of(model.config) == WANT


def test_loading_and_both_forwards_read_the_same_numbers():
    model = _text_model()
    assert _shape_of(_loaded(model)) == WANT
    assert _shape_of(CanonicalLM(model)) == WANT
    assert _shape_of(PortableLM(model)) == WANT
    # The same decoder seen through a multimodal config: loading and the portable forward
    # read its text_config; the legacy forward runs plain decoders only and says so.
    model.config = _multimodal(model.config)
    assert _shape_of(_loaded(model)) == WANT
    portable = PortableLM(model)
    assert _shape_of(portable) == WANT
    assert portable.model_type == "llama"
    with pytest.raises(SeqkvError, match="not 'llava'"):
        CanonicalLM(model)
