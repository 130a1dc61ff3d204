"""Session codecs are found by id and described by capability flags, built-in or plugged in."""

from __future__ import annotations

import importlib.metadata
import sys
import types

import numpy as np
import pytest

from seqkv_cli import capture
from seqkv_cli.archive import Archive, compress_captures, same_capture
from seqkv_cli.errors import SeqkvError
from seqkv_cli.sequential import registry
from seqkv_cli.sequential.session_codec import SessionCodec
from seqkv_codecs import registry as codec_registry


@pytest.mark.parametrize(
    ("spec", "flags"),
    [
        # needs_canonical, steps_model, trie_capable, takes_residual, lossless
        ("seq", (True, True, True, True, True)),
        ("seq-fast", (True, False, True, True, True)),
        ({"id": "seq", "tolerance": 0.01}, (True, True, True, True, False)),
        (
            {"id": "delta-topk", "numerics": "canonical-fp32-rb8-kb256-v1"},
            (True, True, False, False, False),
        ),
        ("lossless", (False, False, True, False, True)),
        ("turbo3", (False, False, True, False, False)),
    ],
)
def test_capabilities_of_every_kind_of_codec(spec, flags):
    caps = registry.capabilities(registry.resolve_codec(spec))
    got = (caps.needs_canonical, caps.steps_model, caps.trie_capable)
    assert (*got, caps.takes_residual, caps.lossless) == flags


def test_capabilities_by_id_and_unknown_ids():
    assert registry.codec_capabilities("seq").steps_model
    assert not registry.codec_capabilities("seq-fast").steps_model
    assert registry.codec_capabilities("raw").needs_canonical is False
    assert registry.codec_capabilities("quanto-int4") is None  # a report-only baseline
    with pytest.raises(SeqkvError, match=r"unknown codec id 'nope'; available: .*delta-topk.*seq"):
        registry.resolve_codec("nope")


def test_builtins_are_listed_in_order_and_ids_match_their_classes():
    classes = registry.session_codec_classes()
    assert [c.codec_id for c in classes][:3] == ["seq", "seq-fast", "delta-topk"]
    assert {"seq", "seq-fast", "delta-topk", "lossless", "raw"} <= set(registry.codec_ids())


def test_registering_refuses_non_codecs_and_taken_ids():
    with pytest.raises(SeqkvError, match="not a SessionCodec subclass"):
        registry.register_session_codec(int)

    class Impostor(SessionCodec):
        codec_id = "seq"

    with pytest.raises(SeqkvError, match="already taken"):
        registry.register_session_codec(Impostor)


class PlainTokens(SessionCodec):
    """A plug-in: token ids as little-endian u32 (no model), K/V by one prefill + residual."""

    codec_id = "plain-tokens-test"
    description = "test plug-in"

    def encode_tokens(self, tokens, adapter):
        track = adapter.start(len(tokens))
        adapter.feed(track, tokens)
        return np.asarray(tokens, "<u4").tobytes(), 32.0 * len(tokens)

    def decode_tokens_many(self, datas, adapter):
        out = []
        for data in datas:
            tokens = np.frombuffer(data, "<u4").astype(np.int64)
            track = adapter.start(len(tokens))
            adapter.feed(track, tokens)
            out.append((tokens, track))
        return out


@pytest.fixture
def plugin(monkeypatch):
    """PlainTokens published through the `seqkv.session_codecs` entry-point group."""
    module = types.ModuleType("seqkv_test_plugin")
    module.PlainTokens = PlainTokens
    monkeypatch.setitem(sys.modules, "seqkv_test_plugin", module)
    good = importlib.metadata.EntryPoint(
        "plain-tokens-test", "seqkv_test_plugin:PlainTokens", registry.ENTRY_POINT_GROUP
    )
    broken = importlib.metadata.EntryPoint(
        "broken-test", "seqkv_no_such_module:Codec", registry.ENTRY_POINT_GROUP
    )
    installed = codec_registry.entry_points
    monkeypatch.setattr(
        codec_registry,  # the one Registry reads entry points for both kinds of codec
        "entry_points",
        lambda group: (
            [good, broken] if group == registry.ENTRY_POINT_GROUP else installed(group=group)
        ),
    )
    sessions = registry.SESSION_CODECS
    monkeypatch.setattr(sessions, "_entry_points_loaded", False)
    monkeypatch.setattr(sessions, "_classes", dict(sessions._classes))
    return PlainTokens


def test_a_plugged_in_session_codec_round_trips_through_a_flat_container(plugin, tiny_lm, tmp_path):
    (tmp_path / "a.txt").write_text("Rivers carry silt down to the delta, year after year. " * 4)
    [res] = capture([str(tmp_path / "a.txt")], model=tiny_lm, out=tmp_path / "caps")
    with pytest.warns(UserWarning, match="broken-test"):
        assert "plain-tokens-test" in registry.codec_ids()
    caps = registry.capabilities(registry.resolve_codec("plain-tokens-test"))
    assert caps.needs_canonical and not caps.steps_model and caps.trie_capable
    out = tmp_path / "x.skv"
    compress_captures([res.path], out, codec="plain-tokens-test", model=tiny_lm, layout="flat")
    with Archive(out, model=tiny_lm) as arc:
        assert arc.codec.codec_id == "plain-tokens-test"
        restored = arc.restore(arc.sessions[0])
    assert same_capture(res.capture, restored)
    # in a trie its tokens are the trie's (a static table per segment: it does not step)
    trie = tmp_path / "t.skv"
    compress_captures([res.path], trie, codec="plain-tokens-test", model=tiny_lm)
    with Archive(trie, model=tiny_lm) as arc:
        assert arc.trie is not None
        assert same_capture(res.capture, arc.restore(arc.sessions[0]))
