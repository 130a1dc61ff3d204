"""Every registered codec through the same checks (kvpress-style matrix), then per-codec bounds."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from common import (
    DTYPES,
    KINDS,
    check_config,
    check_corrupt,
    check_lossless,
    check_roundtrip,
    half_ulp,
    make_block,
    make_kv,
    special_block,
)

from seqkv_codecs.entropy import encode_symbols
from seqkv_codecs.errors import CodecError, CorruptStreamError
from seqkv_codecs.framing import part
from seqkv_codecs.kvblock import KVBlock
from seqkv_codecs.pervector import PERVECTOR_CODECS
from seqkv_codecs.pervector._lloydmax import distortion
from seqkv_codecs.pervector._rotation import Rotation, fwht
from seqkv_codecs.registry import available_codecs, get_codec

# defaults of every registered codec, plus settings that exercise other paths on small blocks
CONFIGS = [{"id": cls.codec_id} for cls in available_codecs()] + [
    {"id": "int8", "scale_dtype": "fp32"},
    {"id": "kivi2", "group_size": 8, "residual": 8},
    {"id": "kivi4", "group_size": 8, "residual": 8},
    {"id": "turbo3", "seed": 5, "norm_dtype": "fp32"},
    {"id": "turbo4", "qjl": True},
]
CONFIG_IDS = [",".join(f"{v}" for v in c.values()) for c in CONFIGS]


def _int8_bound(block: KVBlock, decoded: KVBlock, config: dict) -> None:
    x, y = block.to_float32().astype(np.float64), decoded.to_float32().astype(np.float64)
    scale = np.abs(x).max(axis=2, keepdims=True) / 127 * (1 + 2.0**-10)  # fp16 scale rounds up
    assert np.all(np.abs(x - y) <= scale / 2 + half_ulp(y, block.dtype) + 1e-30)


def _kivi_bound(block: KVBlock, decoded: KVBlock, config: dict) -> None:
    bits = 2 if config["id"] == "kivi2" else 4
    g, residual = config.get("group_size", 32), config.get("residual", 128)
    x, y = block.to_float32().astype(np.float64), decoded.to_float32().astype(np.float64)
    n_q = max(0, x.shape[1] - residual)
    window = KVBlock.from_float32(x[:, n_q:].astype(np.float16), block.dtype, block.kind)
    np.testing.assert_array_equal(decoded.bits()[:, n_q:], window.bits())  # exact to fp16
    xq, yq = x[:, :n_q], y[:, :n_q]
    if block.kind == "key":  # groups of g tokens per channel
        xq, yq = xq.transpose(0, 2, 1), yq.transpose(0, 2, 1)
    for start in range(0, xq.shape[2], g):
        xs, ys = xq[..., start : start + g], yq[..., start : start + g]
        lo = xs.min(axis=2, keepdims=True)
        lo16 = np.abs(lo) * 2.0**-10 + 2.0**-24  # minimum rounded down to fp16
        scale = (xs.max(axis=2, keepdims=True) - lo + lo16) / (2**bits - 1) * (1 + 2.0**-10)
        assert np.all(np.abs(xs - ys) <= scale / 2 + half_ulp(ys, block.dtype) + 2.0**-24)


def _turbo_bound(block: KVBlock, decoded: KVBlock, config: dict) -> None:
    x, y = block.to_float32().astype(np.float64), decoded.to_float32().astype(np.float64)
    rel = np.square(x - y).sum() / np.square(x).sum()
    bits = 3 if config["id"] == "turbo3" else 4
    # KV-like small blocks: a loose check; the Gaussian bound is tested below at 1.2x
    limit = 4.0 if config.get("qjl") else 2.0
    assert rel <= limit * distortion(bits)


BOUNDS = {
    "int8": _int8_bound,
    "kivi2": _kivi_bound,
    "kivi4": _kivi_bound,
    "turbo3": _turbo_bound,
    "turbo4": _turbo_bound,
}


def test_every_builtin_codec_is_registered() -> None:
    registered = {cls.codec_id for cls in available_codecs()}
    assert {cls.codec_id for cls in PERVECTOR_CODECS} <= registered


@pytest.mark.parametrize("config", CONFIGS, ids=CONFIG_IDS)
def test_config(config: dict) -> None:
    check_config(get_codec(config))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("config", CONFIGS, ids=CONFIG_IDS)
def test_roundtrip(config: dict, dtype: str, kind: str) -> None:
    codec = get_codec(config)
    block = make_block(dtype, kind, seed=len(CONFIG_IDS))
    encoded, decoded = check_roundtrip(codec, block)
    if codec.lossless:
        check_lossless(codec, block)
    else:
        assert config["id"] in BOUNDS, f"lossy codec {config['id']!r} needs a bound check here"
        BOUNDS[config["id"]](block, decoded, config)
    if dtype == "bf16":
        check_corrupt(codec, encoded)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("codec_id", ["raw", "lossless"])
def test_lossless_special_values(codec_id: str, dtype: str) -> None:
    check_lossless(get_codec(codec_id), special_block(dtype))


@pytest.mark.parametrize("codec_id", ["int8", "kivi2", "turbo3"])
def test_lossy_refuses_non_finite(codec_id: str) -> None:
    with pytest.raises(CodecError, match="NaN or inf"):
        get_codec(codec_id).encode(special_block("bf16"))


@pytest.mark.parametrize("config", CONFIGS, ids=CONFIG_IDS)
def test_empty_sequence(config: dict) -> None:
    block = KVBlock(np.zeros((2, 0, 8), np.uint16), "bf16", "key")
    _, decoded = check_roundtrip(get_codec(config), block)
    assert decoded.shape == (2, 0, 8)


@pytest.mark.parametrize("dtype", DTYPES)
def test_lossless_compresses_kv_like_data(dtype: str) -> None:
    """Channel-referenced modelling must beat the raw size clearly on KV-shaped data."""
    block = make_block(dtype, "key", heads=2, seq_len=256, head_dim=64, seed=3)
    encoded, _ = check_roundtrip(get_codec("lossless"), block)
    bits = 8 * len(encoded) / block.num_components
    assert bits < {"bf16": 11.0, "fp16": 14.0, "fp32": 28.0}[dtype]


def test_lossless_drops_mantissa_bits_that_are_always_zero() -> None:
    """bf16 data captured as fp32 costs about what it costs as bf16 (16 zero bits dropped)."""
    x = make_block("bf16", "key", heads=2, seq_len=64, head_dim=32, seed=4).to_float32()
    codec = get_codec("lossless")
    as_bf16 = len(codec.encode(KVBlock.from_float32(x, "bf16", "key")))
    as_fp32 = KVBlock.from_float32(x, "fp32", "key")
    check_lossless(codec, as_fp32)
    assert len(codec.encode(as_fp32)) <= as_bf16 + 8


def test_lossless_escapes_far_outliers() -> None:
    x = make_kv(seq_len=24, head_dim=8, seed=2)
    x[0, 5, 3], x[1, 9, 0], x[1, 10, 0] = 3e30, -1e-30, 0.0  # exponents far from the channel
    check_lossless(get_codec("lossless"), KVBlock.from_float32(x, "bf16", "value"))


def test_lossless_references_repeated_vectors() -> None:
    """First-layer values repeat whole vectors with their token: stored once, restored exactly."""
    x = make_kv(heads=2, seq_len=64, head_dim=32, seed=5)
    tokens = np.random.default_rng(5).integers(0, 8, 64)  # 8 distinct "tokens", many repeats
    block = KVBlock.from_float32(x[:, tokens], "bf16", "value")
    fresh = KVBlock.from_float32(x, "bf16", "value")
    codec = get_codec("lossless")
    check_lossless(codec, block)
    assert len(codec.encode(block)) < len(codec.encode(fresh)) / 3


def test_lossless_rejects_a_copy_of_an_uncoded_vector() -> None:
    x = make_kv(heads=1, seq_len=3, head_dim=4, seed=1)
    good = get_codec("lossless").encode(KVBlock.from_float32(x[:, [0, 0, 1]], "bf16", "value"))
    flags_at = 13 + 4 + 1  # header, ref (H*D bytes), majority bits
    ordinals_at = flags_at + 4 + int(np.frombuffer(good, "<u4", 1, flags_at)[0])
    old_end = ordinals_at + 4 + int(np.frombuffer(good, "<u4", 1, ordinals_at)[0])
    # the one copy refers to ordinal 0; point it at ordinal 1, which is not coded before it
    bad = good[:ordinals_at] + part(encode_symbols(np.array([1]), 2)) + good[old_end:]
    with pytest.raises(CorruptStreamError, match="not coded yet"):
        get_codec("lossless").decode(bad)


def test_int8_scale_overflow_names_the_fix() -> None:
    block = KVBlock.from_float32(np.full((1, 2, 4), 1e8, np.float32), "fp32", "key")
    with pytest.raises(CodecError, match="scale_dtype='fp32'"):
        get_codec("int8").encode(block)
    check_roundtrip(get_codec({"id": "int8", "scale_dtype": "fp32"}), block)


@pytest.mark.parametrize(("codec_id", "bits"), [("turbo3", 3), ("turbo4", 4)])
@pytest.mark.parametrize("head_dim", [64, 48])
def test_turbo_gaussian_distortion(codec_id: str, bits: int, head_dim: int) -> None:
    """Relative MSE on Gaussian vectors stays within 1.2x the Lloyd-Max distortion."""
    x = np.random.default_rng(11).standard_normal((4, 256, head_dim)).astype(np.float32)
    block = KVBlock.from_float32(x, "fp32", "key")
    _, decoded = check_roundtrip(get_codec(codec_id), block)
    y = decoded.to_float32().astype(np.float64)
    rel = np.square(x - y).sum() / np.square(x.astype(np.float64)).sum()
    assert distortion(bits) * 0.8 <= rel <= 1.2 * distortion(bits)
    assert distortion(bits) == pytest.approx({3: 0.03455, 4: 0.009501}[bits], rel=1e-3)


def test_turbo_qjl_makes_inner_products_unbiased() -> None:
    rng = np.random.default_rng(4)
    x = rng.standard_normal((8, 256, 32)).astype(np.float32)
    block = KVBlock.from_float32(x, "fp32", "key")
    xs = x.astype(np.float64)
    ratio = {}
    for qjl in (False, True):
        y = get_codec({"id": "turbo3", "qjl": qjl}).decode(
            get_codec({"id": "turbo3", "qjl": qjl}).encode(block)
        )
        ratio[qjl] = (xs * y.to_float32()).sum() / np.square(xs).sum()
    assert ratio[False] < 1 - distortion(3) / 2  # centroids are cell means: x̂ shrinks toward 0
    assert ratio[True] == pytest.approx(1.0, abs=0.01)


def test_rotation_is_orthogonal() -> None:
    x = np.random.default_rng(0).standard_normal((5, 64))
    for dim in (64, 48):
        rot = Rotation(dim, seed=3)
        y = rot.apply(x[:, :dim])
        np.testing.assert_allclose(np.linalg.norm(y, axis=1), np.linalg.norm(x[:, :dim], axis=1))
        np.testing.assert_allclose(rot.invert(y), x[:, :dim], atol=1e-12)
    hadamard = [[1, 1, 1, 1], [1, -1, 1, -1], [1, 1, -1, -1], [1, -1, -1, 1]]
    assert fwht(np.eye(4)).tolist() == hadamard


def test_kivi_bits_on_long_block() -> None:
    """Past the fp16 window, kivi2 spends about 2 bits plus group parameters per component."""
    block = make_block("bf16", "value", heads=2, seq_len=512, head_dim=64, seed=1)
    encoded = get_codec({"id": "kivi2", "residual": 0}).encode(block)
    assert 8 * len(encoded) / block.num_components < 2 + 2 * 16 / 32


def test_decode_rejects_parameters_out_of_range() -> None:
    block = make_block("bf16", "key", seq_len=16)
    encoded = bytearray(get_codec("turbo3").encode(block))
    encoded[13] = 7  # bits
    with pytest.raises(CorruptStreamError):
        get_codec("turbo3").decode(bytes(encoded))


# sha256 of each codec's stream for the block below (the entropy coder's bytes included): a
# change here means the layout changed, so the codec's stream_version must be bumped with it
GOLDEN = {
    "raw": "1216232f6989de3d8058d08f48e52be20f3a2369036251b059de8e6cc11f4acd",
    "lossless": "eaa90e7a171fc2be59a70ce2ff8319a90675a13635928d80fe6b4bd25b352338",
    "int8": "5d8f1f04f00608575838dd72b1a10e9b767455518fc0de9541947cb5af896dd3",
    "kivi2": "c2af8108076f75766debfc7dbec9eaf8e0b02c10c5736e8dce29c3dc2d89c0e1",
    "kivi4": "aac1ec87493daefbba6ad0a82330ace79e6da32b9d74298a4c69f49d9569a55c",
    "turbo3": "1a218e4d07e5d928acd8d0e89cf9fdd79337c08f51e401d9b51f433c78b18e77",
    "turbo4": "bdda916869eeba277d2895cb6a921b980dfd3f834f61539efda2603b9788ca7f",
}


@pytest.mark.parametrize("codec_id", sorted(GOLDEN))
def test_golden_stream_digest(codec_id: str) -> None:
    block = make_block("bf16", "key", heads=2, seq_len=40, head_dim=16, seed=123)
    config = {"id": codec_id, "residual": 8, "group_size": 8} if "kivi" in codec_id else codec_id
    digest = hashlib.sha256(get_codec(config).encode(block)).hexdigest()
    assert digest == GOLDEN[codec_id], f"{codec_id} stream bytes changed: bump stream_version"
