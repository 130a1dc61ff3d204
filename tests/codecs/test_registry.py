"""The codec framework: KVBlock, the Codec base class and stream header, the registry."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from common import make_block, make_kv

from seqkv_codecs import registry
from seqkv_codecs.base import Codec
from seqkv_codecs.errors import CodecError, CorruptStreamError, UnknownCodecError
from seqkv_codecs.framing import StreamReader
from seqkv_codecs.kvblock import KVBlock, bf16_bits_to_float32, float32_to_bf16_bits
from seqkv_codecs.pervector import LosslessCodec, RawCodec, Turbo3Codec
from seqkv_codecs.registry import available_codecs, get_codec, register_codec


def _torch_bf16_bits(x: np.ndarray) -> np.ndarray:
    return torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def test_bf16_rounding_matches_torch() -> None:
    rng = np.random.default_rng(0)
    random_bits = rng.integers(0, 2**32, 20000, dtype=np.uint32)
    ties = (rng.integers(0, 2**16, 2000, dtype=np.uint32) << 16) | 0x8000  # exactly halfway
    near = rng.integers(0, 2**16, 2000, dtype=np.uint32) << 16
    near |= rng.choice(np.array([0x7FFF, 0x8001], np.uint32), 2000)  # either side of a tie
    specials = np.array([np.inf, -np.inf, 3.4e38, -3.4e38, 0.0, -0.0, 1e-45, 1.0], np.float32)
    x = np.concatenate([random_bits.view(np.float32), ties.view(np.float32), near.view(np.float32)])
    x = np.concatenate([x, specials, rng.standard_normal(2000).astype(np.float32)])
    ours, theirs = float32_to_bf16_bits(x), _torch_bf16_bits(x)
    nan = np.isnan(x)
    assert nan.any() and np.all((ours[nan] & 0x7FFF) > 0x7F80)  # NaN stays NaN
    np.testing.assert_array_equal(ours[~nan], theirs[~nan])
    assert (ours[nan] == 0x7FC0).all()  # torch's scalar path; its vector kernels write 0xFFFF
    widened = torch.from_numpy(theirs[~nan].view(np.int16)).view(torch.bfloat16).float()
    np.testing.assert_array_equal(bf16_bits_to_float32(ours[~nan]), widened.numpy())


def test_kvblock_float32_roundtrip_per_dtype() -> None:
    x = make_kv(seq_len=8)
    for dtype, np_dtype in (("bf16", np.uint16), ("fp16", np.float16), ("fp32", np.float32)):
        block = KVBlock.from_float32(x, dtype, "value")
        assert block.data.dtype == np_dtype and block.shape == x.shape
        assert KVBlock.from_float32(block.to_float32(), dtype, "value") == block
    np.testing.assert_array_equal(KVBlock.from_float32(x, "fp32", "key").to_float32(), x)


def test_kvblock_sizes_and_bit_equality() -> None:
    block = make_block("fp16", "key", heads=2, seq_len=5, head_dim=4)
    assert (block.nbytes, block.num_components) == (80, 40)
    nan = KVBlock(np.full((1, 1, 2), np.nan, np.float32), "fp32", "key")
    assert nan == KVBlock(nan.data.copy(), "fp32", "key")  # bits, not values: NaN == NaN
    zero = KVBlock(np.zeros((1, 1, 2), np.float32), "fp32", "key")
    assert zero != KVBlock(-zero.data, "fp32", "key")  # and 0.0 != -0.0
    assert zero != KVBlock(zero.data, "fp32", "value")


@pytest.mark.parametrize(
    ("data", "dtype", "kind", "message"),
    [
        (np.zeros((1, 2, 3), np.float32), "bf8", "key", "dtype 'bf8'"),
        (np.zeros((1, 2, 3), np.float32), "fp32", "query", "kind 'query'"),
        (np.zeros((1, 2, 3), np.float32), "bf16", "key", "uint16 bit pattern"),
        (np.zeros((2, 3), np.float32), "fp32", "key", "num_kv_heads, seq_len, head_dim"),
        (np.zeros((1, 2, 0), np.float32), "fp32", "key", "one channel"),
        ([[[1.0]]], "fp32", "key", "numpy array"),
    ],
)
def test_kvblock_validation(data: object, dtype: str, kind: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        KVBlock(data, dtype, kind)  # type: ignore[arg-type]


def test_stream_header_is_checked() -> None:
    block = make_block("bf16", "value", seq_len=4)
    stream = RawCodec().encode(block)
    assert stream[:3] == b"RW\x01" and len(stream) == 13 + block.nbytes
    with pytest.raises(CorruptStreamError, match="version 9"):
        RawCodec().decode(stream[:2] + b"\x09" + stream[3:])
    with pytest.raises(CorruptStreamError, match="malformed"):
        RawCodec().decode(stream[:3] + b"\x07" + stream[4:])
    with pytest.raises(CorruptStreamError, match="not a 'lossless' stream"):
        LosslessCodec().decode(stream)


def test_stream_reader_errors_name_the_shortfall() -> None:
    reader = StreamReader(b"\x05\x00\x00\x00abc", "demo")
    with pytest.raises(CorruptStreamError, match="demo stream is truncated: needs 5 bytes"):
        reader.part()
    reader = StreamReader(b"ab", "demo")
    reader.take(1)
    with pytest.raises(CorruptStreamError, match="1 unexpected trailing bytes"):
        reader.finish()


def test_unknown_codec_lists_available_ids() -> None:
    with pytest.raises(UnknownCodecError, match=r"'nope'.*available: .*lossless.*turbo3") as info:
        get_codec("nope")
    assert isinstance(info.value, ValueError)


def test_get_codec_from_config_and_bad_configs() -> None:
    assert get_codec({"id": "turbo3", "seed": 9}) == Turbo3Codec(seed=9)
    assert get_codec("turbo3") != Turbo3Codec(seed=9)
    with pytest.raises(CodecError, match="no string 'id'"):
        get_codec({"seed": 1})
    with pytest.raises(CodecError, match="bad config for codec 'turbo3'"):
        get_codec({"id": "turbo3", "colour": "red"})
    with pytest.raises(CodecError, match="given to codec"):
        Turbo3Codec.from_config({"id": "turbo4"})
    with pytest.raises(ValueError, match="scale_dtype"):
        get_codec({"id": "int8", "scale_dtype": "fp8"})


def test_available_codecs_sorted_and_complete() -> None:
    ids = [cls.codec_id for cls in available_codecs()]
    assert ids == sorted(ids)
    assert {"raw", "lossless", "int8", "kivi2", "kivi4", "turbo3", "turbo4"} <= set(ids)


class _Clash(Codec):
    codec_id = "raw"
    description = "clash"
    lossless = True
    stream_magic = b"XX"

    def encode(self, block: KVBlock) -> bytes:
        return b""

    def decode(self, data: bytes | memoryview) -> KVBlock:
        raise CorruptStreamError("never")


def test_register_refuses_taken_id_and_non_codecs() -> None:
    assert register_codec(RawCodec) is RawCodec  # idempotent
    with pytest.raises(CodecError, match="already taken"):
        register_codec(_Clash)
    with pytest.raises(CodecError, match="not a Codec"):
        register_codec(int)  # type: ignore[arg-type]


@pytest.fixture
def plugin_env(tmp_path, monkeypatch):
    """A fake installed distribution declaring two ``seqkv.codecs`` entry points."""
    (tmp_path / "fake_seqkv_plugin.py").write_text(
        "from seqkv_codecs.pervector.raw import RawCodec\n"
        "class PluginCodec(RawCodec):\n"
        "    codec_id = 'plugin_raw'\n"
    )
    info = tmp_path / "fake_seqkv_plugin-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fake-seqkv-plugin\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(
        "[seqkv.codecs]\nplugin_raw = fake_seqkv_plugin:PluginCodec\n"
        "broken = fake_seqkv_plugin:DoesNotExist\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(registry.CODECS, "_classes", dict(registry.CODECS._classes))
    monkeypatch.setattr(registry.CODECS, "_entry_points_loaded", False)


def test_entry_point_codecs_load_lazily(plugin_env) -> None:
    get_codec("lossless")
    assert not registry.CODECS._entry_points_loaded  # a hit never reads entry points
    with pytest.warns(UserWarning, match="'broken'"):
        codec = get_codec("plugin_raw")
    block = make_block("bf16", "key", seq_len=3)
    assert codec.decode(codec.encode(block)) == block
    assert "plugin_raw" in [cls.codec_id for cls in available_codecs()]
