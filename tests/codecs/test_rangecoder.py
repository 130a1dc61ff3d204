"""Range coder and logits->frequency construction: exactness, round trips, cost, corruption."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch

from seqkv_codecs.errors import CodecError, CorruptStreamError
from seqkv_codecs.sequential import (
    RangeDecoder,
    RangeEncoder,
    code_length_bits,
    cumulative,
    decode_symbol,
    decode_with_tables,
    encode_with_tables,
    find_symbol,
    frequencies_from_logits,
    frequencies_from_logits_torch,
    intervals_from_logits,
    rangecoder,
    reference_frequencies,
)
from seqkv_codecs.sequential.probability import exp2_table

VOCAB = 49_152


def _sha(a: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(a, dtype="<i8").tobytes()).hexdigest()


def _fixed_logits(vocab: int = VOCAB) -> np.ndarray:
    """Logits built from integers and one IEEE division: identical on every machine."""
    x = ((np.arange(vocab) * 7919 % 1009) - 500).astype(np.float32) / np.float32(37.0)
    x[::97] = -np.inf
    return x


def _random_table(rng: np.random.Generator, vocab: int, bits: int) -> np.ndarray:
    """Random frequencies >= 1 summing to 2**bits, with a skewed (Dirichlet) shape."""
    spare = (1 << bits) - vocab
    return 1 + rng.multinomial(spare, rng.dirichlet(np.full(vocab, 0.3)))


def _sample(rng: np.random.Generator, rows: np.ndarray) -> np.ndarray:
    u = rng.random(len(rows))
    cdf = cumulative(rows)
    return np.array(
        [np.searchsorted(c, x * c[-1], side="right") - 1 for c, x in zip(cdf, u, strict=True)]
    )


def _round_trip(symbols: np.ndarray, rows: np.ndarray, bits: int) -> bytes:
    data = encode_with_tables(symbols, rows, bits)
    np.testing.assert_array_equal(decode_with_tables(data, rows, bits), symbols)
    return data


# --- frequency construction -------------------------------------------------------------


def test_exp2_table_is_the_format_constant() -> None:
    table = exp2_table()
    assert table[0] == 1 << 32 and table.shape == (1024,)
    assert (np.diff(table) < 0).all() and abs(int(table[512]) - 2**31.5) <= 1
    assert _sha(table) == "4a499ef0c43aa3c5301db5c2be966b9b079109409c2e118d8946b4ba55fad9fa"


def test_frequencies_golden_and_exact_sum() -> None:
    freqs = frequencies_from_logits(_fixed_logits())
    assert freqs.dtype == np.int64 and freqs.sum() == 1 << 24 and freqs.min() == 1
    assert (freqs[::97] == 1).all()  # masked (-inf) tokens keep the floor
    assert _sha(freqs) == "2c7638bf71a591cb170a2260494cb52d23d0da2cec0a084beed8c6d2fa9ceac9"


def test_all_equal_logits_give_uniform_plus_leftover_to_first() -> None:
    # spare = 16 - 3 = 13, each share 13 // 3 = 4, leftover 1 goes to index 0.
    np.testing.assert_array_equal(frequencies_from_logits(np.zeros(3, np.float32), 4), [6, 5, 5])
    freqs = frequencies_from_logits(np.full(VOCAB, 2.5, np.float32), 24, floor=3)
    assert freqs.sum() == 1 << 24 and len(set(freqs[1:].tolist())) == 1


@pytest.mark.parametrize("bits,floor", [(16, 1), (20, 2), (24, 1), (31, 5)])
def test_rows_sum_exactly_with_floor_and_follow_logit_order(bits: int, floor: int) -> None:
    rng = np.random.default_rng(bits)
    logits = (rng.standard_normal((4, VOCAB)) * 5).astype(np.float32)
    freqs = frequencies_from_logits(logits, bits, floor)
    assert (freqs.sum(axis=1) == 1 << bits).all() and freqs.min() >= floor
    order = np.argsort(logits[0], kind="stable")
    assert (np.diff(freqs[0][order]) >= 0).all()  # larger logit never gets a smaller frequency


def test_frequencies_track_softmax_within_floor_cost() -> None:
    rng = np.random.default_rng(7)
    logits = (rng.standard_normal((8, VOCAB)) * 5).astype(np.float32)
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    q = frequencies_from_logits(logits) / 2**24
    overhead = (p * (np.log2(p) - np.log2(q))).sum(1)  # KL(p || q) in bits per token
    assert (overhead < 0.01).all()


def _extreme_logits() -> list[np.ndarray]:
    rng = np.random.default_rng(3)
    gauss = (rng.standard_normal(VOCAB) * 5).astype(np.float32)
    peaked = gauss.copy()
    peaked[123] = 60.0
    masked = gauss.copy()
    masked[rng.integers(0, VOCAB, 20_000)] = -np.inf
    huge = np.array([3e38, -3e38, 0.0, 3e38], np.float32)
    return [gauss, peaked, masked, np.zeros(VOCAB, np.float32), huge, gauss.astype(np.float16)]


@pytest.mark.parametrize("case", range(6))
def test_torch_twin_gives_identical_integers(case: int) -> None:
    logits = _extreme_logits()[case]
    freqs = frequencies_from_logits(logits)
    twin = frequencies_from_logits_torch(torch.from_numpy(logits))
    assert twin.dtype == torch.int64
    np.testing.assert_array_equal(twin.numpy(), freqs)
    assert freqs.sum() == 1 << 24 and freqs.min() >= 1


def test_peaked_and_masked_rows() -> None:
    peaked, masked = _extreme_logits()[1], _extreme_logits()[2]
    freqs = frequencies_from_logits(peaked)
    assert freqs[123] == (1 << 24) - (VOCAB - 1) and (np.delete(freqs, 123) == 1).all()
    assert (frequencies_from_logits(masked)[np.isneginf(masked)] == 1).all()


def test_batch_equals_single_rows_numpy_and_torch() -> None:
    rng = np.random.default_rng(11)
    batch = (rng.standard_normal((6, VOCAB)) * rng.uniform(0.5, 12, (6, 1))).astype(np.float32)
    batch[2, :100] = -np.inf
    together = frequencies_from_logits(batch, 22)
    singles = np.stack([frequencies_from_logits(row, 22) for row in batch])
    np.testing.assert_array_equal(together, singles)
    twin = frequencies_from_logits_torch(torch.from_numpy(batch), 22).numpy()
    np.testing.assert_array_equal(twin, together)


@pytest.mark.parametrize(
    "logits,bits,floor",
    [
        (np.array([0.0, np.nan], np.float32), 24, 1),
        (np.array([0.0, np.inf], np.float32), 24, 1),
        (np.full((2, 4), -np.inf, np.float32), 24, 1),
        (np.arange(4), 24, 1),
        (np.zeros(4, np.float32), 32, 1),
        (np.zeros(4, np.float32), 2, 1),
        (np.zeros(4, np.float32), 24, 0),
    ],
)
def test_bad_logits_raise_codec_error(logits: np.ndarray, bits: int, floor: int) -> None:
    with pytest.raises(CodecError):
        frequencies_from_logits(logits, bits, floor)
    if logits.dtype.kind == "f":
        with pytest.raises(CodecError):
            frequencies_from_logits_torch(torch.from_numpy(logits), bits, floor)


def test_cumulative_and_code_length() -> None:
    freqs = np.array([[1, 3, 4], [4, 2, 2]])
    np.testing.assert_array_equal(cumulative(freqs), [[0, 1, 4, 8], [0, 4, 6, 8]])
    assert code_length_bits(freqs, [0, 1]) == pytest.approx(3 + 2)
    assert code_length_bits(freqs[0], [2, 2, 1]) == pytest.approx(1 + 1 + np.log2(8 / 3))
    with pytest.raises(CodecError):
        code_length_bits(freqs, [0, 3])
    with pytest.raises(CodecError):
        code_length_bits(np.array([0, 8]), [0])


# --- the compiled kernels (row_jit) against the numpy definition ---------------------------


def _kernel_cases() -> list[tuple[np.ndarray, int, int]]:
    """(logits, P, floor): the extreme rows, large vocabularies, ties, tiny vocabularies."""
    rng = np.random.default_rng(36)
    cases = [(x, 24, 1) for x in _extreme_logits()]
    for vocab in (151_936, 256_000, 262_144):
        x = (rng.standard_normal((3, vocab)) * rng.uniform(0.5, 15, (3, 1))).astype(np.float32)
        x[1, rng.integers(0, vocab, vocab // 3)] = -np.inf
        x[2, :: vocab // 7] = x[2].max()  # several symbols share the maximum
        cases.append((x, 24, 1))
    ties = np.round(rng.standard_normal((2, VOCAB)) * 4).astype(np.float64)  # float64 rows
    cases += [(ties, 24, 1), (ties, 20, 3), (ties, 31, 2)]
    # 33,792 steps and the table threshold: just below and at MAX_STEPS + 1 symbols
    for vocab in (33_792, 33_793, 1, 2, 3):
        cases.append(((rng.standard_normal(vocab) * 30).astype(np.float32), 24, 1))
    cases.append((np.array([[0.0, -np.inf, 5e-4, 1e-3]], np.float16), 16, 2))
    return cases


@pytest.mark.parametrize("case", range(len(_kernel_cases())))
def test_compiled_kernels_give_the_definitions_integers(case: int, monkeypatch) -> None:
    import sys

    logits, bits, floor = _kernel_cases()[case]
    want = reference_frequencies(logits, bits, floor)
    got = frequencies_from_logits(logits, bits, floor)
    assert "seqkv_codecs.sequential.row_jit" in sys.modules  # the kernels ran, not numpy
    assert got.dtype == np.int64 and got.shape == logits.shape
    np.testing.assert_array_equal(got, want)
    rows = want.reshape(-1, want.shape[-1])
    cdf = cumulative(rows)
    rng = np.random.default_rng(case)
    symbols = rng.integers(0, rows.shape[1], len(rows))
    low, freq = intervals_from_logits(logits.reshape(rows.shape), symbols, bits, floor)
    index = np.arange(len(rows))
    np.testing.assert_array_equal(low, cdf[index, symbols])
    np.testing.assert_array_equal(freq, rows[index, symbols])
    for row, c in zip(rows, cdf, strict=True):
        for target in [0, (1 << bits) - 1, *rng.integers(0, 1 << bits, 20).tolist()]:
            s = int(np.searchsorted(c, target, side="right")) - 1
            assert find_symbol(row, target) == (s, int(c[s]))
    monkeypatch.setenv("SEQKV_CODER_KERNELS", "off")  # the numpy paths: the same integers
    np.testing.assert_array_equal(frequencies_from_logits(logits, bits, floor), want)
    off = intervals_from_logits(logits.reshape(rows.shape), symbols, bits, floor)
    np.testing.assert_array_equal(off[0], low)
    np.testing.assert_array_equal(off[1], freq)
    assert find_symbol(rows[0], (1 << bits) - 1) == (rows.shape[1] - 1, int(cdf[0, -2]))


def test_find_symbol_skips_zero_frequencies_and_refuses_a_target_past_the_total(
    monkeypatch,
) -> None:
    row = np.array([0, 3, 0, 0, 5, 0], np.int64)
    for kernels in ("on", "off"):
        monkeypatch.setenv("SEQKV_CODER_KERNELS", kernels)
        assert [find_symbol(row, t) for t in (0, 2, 3, 7)] == [(1, 0), (1, 0), (4, 3), (4, 3)]
        with pytest.raises(CorruptStreamError, match="past the frequency row's total"):
            find_symbol(row, 8)


@pytest.mark.parametrize("kernels", ["on", "off"])
def test_kernels_and_numpy_refuse_bad_rows_with_the_same_message(kernels, monkeypatch) -> None:
    monkeypatch.setenv("SEQKV_CODER_KERNELS", kernels)
    good = np.zeros((2, 4), np.float32)
    for bad, message in [
        (np.array([0.0, np.nan], np.float32), "NaN or \\+inf"),
        (np.array([0.0, np.inf], np.float32), "NaN or \\+inf"),
        (np.full((2, 4), -np.inf, np.float32), "entirely -inf"),
    ]:
        with pytest.raises(CodecError, match=message):
            frequencies_from_logits(bad)
        with pytest.raises(CodecError, match=message):
            intervals_from_logits(
                bad.reshape(-1, bad.shape[-1]),
                np.zeros(len(bad.reshape(-1, bad.shape[-1])), np.int64),
                24,
            )
    with pytest.raises(CodecError, match="symbols in"):
        intervals_from_logits(good, np.array([0, 4]), 24)


# --- range coder ------------------------------------------------------------------------


def test_golden_stream() -> None:
    vocab = 256
    rows = np.stack(
        [
            frequencies_from_logits(
                ((np.arange(vocab) * (31 + i) % 257) - 128).astype(np.float32) / np.float32(16),
                16,
            )
            for i in range(12)
        ]
    )
    symbols = np.array([0, 255, 109, 1, 100, 7, 200, 142, 0, 3, 254, 128])
    data = _round_trip(symbols, rows, 16)
    assert data.hex() == "0000ffd0dce116557c30e045b132a4d021"


def test_empty_sequence_is_one_byte() -> None:
    data = encode_with_tables([], np.zeros((0, 4), np.int64))
    assert data == b"\x00"
    assert decode_with_tables(data, []).shape == (0,)


@pytest.mark.parametrize(
    "vocab,bits", [(2, 1), (2, 2), (3, 8), (300, 16), (VOCAB, 24), (VOCAB, 31)]
)
def test_round_trip_random_tables(vocab: int, bits: int) -> None:
    rng = np.random.default_rng(vocab + bits)
    count = 40 if vocab == VOCAB else 500
    rows = np.stack([_random_table(rng, vocab, bits) for _ in range(count)])
    symbols = _sample(rng, rows)
    symbols[:3] = [0, vocab - 1, 0]  # first and last index
    ones = np.flatnonzero(rows[-1] == 1)
    symbols[-1] = ones[0] if ones.size else symbols[-1]  # a freq-1 symbol
    data = _round_trip(symbols, rows, bits)
    ideal = code_length_bits(rows, symbols)
    assert ideal - 64 <= 8 * len(data) <= ideal * 1.01 + 64


@pytest.mark.parametrize("scale", [1.0, 5.0, 20.0])
def test_round_trip_tables_from_logits(scale: float) -> None:
    rng = np.random.default_rng(int(scale))
    logits = (rng.standard_normal((32, VOCAB)) * scale).astype(np.float32)
    rows = frequencies_from_logits(logits)
    symbols = _sample(rng, rows)
    symbols[0], symbols[1] = np.argmin(rows[0]), VOCAB - 1  # improbable symbols too
    data = _round_trip(symbols, rows, 24)
    assert 8 * len(data) <= code_length_bits(rows, symbols) * 1.01 + 64


def test_long_sequence_cost_close_to_ideal() -> None:
    rng = np.random.default_rng(5)
    table = _random_table(rng, 64, 24)
    symbols = _sample(rng, np.broadcast_to(table, (10_000, 64)))
    data = _round_trip(symbols, np.broadcast_to(table, (10_000, 64)), 24)
    ideal = code_length_bits(table, symbols)
    assert ideal - 64 <= 8 * len(data) <= ideal * 1.01 + 64


def test_carry_propagates_through_ff_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    runs: list[int] = []
    carry = RangeEncoder._carry

    def counting(self: RangeEncoder) -> None:
        out = self._out
        runs.append(len(out) - len(bytes(out).rstrip(b"\xff")))
        carry(self)

    monkeypatch.setattr(RangeEncoder, "_carry", counting)
    symbols = np.random.default_rng(2).integers(0, 256, 4000)
    _round_trip(symbols, np.ones((4000, 256), np.int64), 8)
    assert len(runs) > 1000 and max(runs) >= 2


def test_adaptive_generator_drives_both_directions() -> None:
    """Row i depends on symbol i-1, as with a language model; the generator is sent it."""

    def model(count: int):
        counts = np.ones(16, np.int64)
        for _ in range(count):
            row = counts * ((1 << 20) // counts.sum())
            row[0] += (1 << 20) - row.sum()
            symbol = yield row
            counts[symbol] += 50

    symbols = np.random.default_rng(9).choice(4, 300, p=[0.7, 0.1, 0.1, 0.1])
    data = encode_with_tables(symbols, model(300), 20)
    np.testing.assert_array_equal(decode_with_tables(data, model(300), 20), symbols)
    assert len(data) < 300 * 4 / 8 / 2  # adaptation beats a flat 16-symbol code by 2x


def test_low_level_api_queue_order() -> None:
    enc = RangeEncoder()
    intervals = [(0, 1, 3), (7, 1, 3), (100, 5000, 16), (np.int64(5), np.int64(2), 4)]
    for low, freq, bits in intervals:
        enc.encode(low, freq, bits)
    data = enc.finish()
    dec = RangeDecoder(data)
    for low, freq, bits in intervals:
        assert low <= dec.peek(bits) < low + freq
        dec.advance(low, freq, bits)
    dec.finish_check()
    with pytest.raises(CodecError):
        enc.encode(0, 1, 3)  # after finish


@pytest.mark.parametrize("args", [(0, 0, 8), (-1, 2, 8), (250, 7, 8), (0, 1, 0), (0, 1, 32)])
def test_bad_intervals_raise(args: tuple) -> None:
    with pytest.raises(CodecError):
        RangeEncoder().encode(*args)
    with pytest.raises(TypeError):  # floats are refused, not truncated
        RangeEncoder().encode(0.5, 1, 8)


def test_bad_tables_raise_codec_error() -> None:
    with pytest.raises(CodecError):
        encode_with_tables([1], [np.array([3, 4])], 3)  # sums to 7, not 8
    with pytest.raises(CodecError):
        encode_with_tables([2], [np.array([4, 4])], 3)  # symbol outside table
    with pytest.raises(CodecError):
        encode_with_tables([0, 1], [np.array([4, 4])], 3)  # fewer rows than symbols
    with pytest.raises(CodecError):
        encode_with_tables([0], np.full((2, 2), 4), 3)  # more rows than symbols
    with pytest.raises(CodecError):
        encode_with_tables([0], [np.array([0, 4, 4])], 3)  # zero frequency


def test_zero_frequency_entries_are_skipped_when_decoding() -> None:
    row = np.array([0, 3, 0, 0, 5, 0])
    data = encode_with_tables([1, 4, 4, 1], [row] * 4, 3)
    np.testing.assert_array_equal(decode_with_tables(data, [row] * 4, 3), [1, 4, 4, 1])


def test_trailing_and_missing_data_detected() -> None:
    rng = np.random.default_rng(4)
    rows = np.stack([_random_table(rng, 50, 16) for _ in range(200)])
    symbols = _sample(rng, rows)
    data = _round_trip(symbols, rows, 16)
    with pytest.raises(CorruptStreamError, match="trailing"):
        decode_with_tables(data + b"\x00", rows, 16)
    with pytest.raises(CorruptStreamError):
        decode_with_tables(b"", rows, 16)
    with pytest.raises(CorruptStreamError):
        decode_with_tables(data[: len(data) // 2], rows, 16)


def test_corruption_never_escapes_as_another_exception() -> None:
    """Every damaged stream either raises CorruptStreamError or decodes to other symbols."""
    rng = np.random.default_rng(6)
    rows = np.stack([_random_table(rng, 20, 16) for _ in range(60)])
    symbols = _sample(rng, rows)
    data = _round_trip(symbols, rows, 16)
    raised = wrong = 0
    for trial in range(300):
        damaged = bytearray(data)
        if trial % 3 == 0:
            damaged = damaged[: rng.integers(0, len(data))]
        else:
            damaged[rng.integers(0, len(data))] ^= 1 << int(rng.integers(0, 8))
        try:
            decoded = decode_with_tables(bytes(damaged), rows, 16)
        except CorruptStreamError:
            raised += 1
            continue
        assert not np.array_equal(decoded, symbols)  # undetected damage still shows
        wrong += 1
    assert raised + wrong == 300 and raised > 270


def test_decoder_rejects_target_outside_interval() -> None:
    enc = RangeEncoder()
    enc.encode(0, 4, 3)
    dec = RangeDecoder(enc.finish())
    assert dec.peek(3) < 4
    with pytest.raises(CorruptStreamError):
        dec.advance(4, 4, 3)


def test_decode_symbol_matches_module_constant() -> None:
    assert rangecoder.STATE_BYTES == 8
    enc = RangeEncoder()
    enc.encode(5, 1, 3)
    dec = RangeDecoder(enc.finish())
    assert decode_symbol(dec, np.ones(8, np.int64), 3) == 5
    dec.finish_check()
