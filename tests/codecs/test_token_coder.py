"""Token coder: round trips, cost vs ideal, desync and damage detection, canonical forward."""

from __future__ import annotations

import hashlib
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from seqkv_codecs.errors import CodecError, CorruptStreamError
from seqkv_codecs.sequential import code_length_bits, frequencies_from_logits
from seqkv_codecs.sequential.batch_decode import decode_tokens
from seqkv_codecs.sequential.logits_model import LogitsModel
from seqkv_codecs.sequential.token_coder import (
    encode_tokens,
    encode_tokens_with_stats,
    read_token_stream_info,
)

VOCAB = 97
HEADER = 24  # fixed header + header CRC; each chunk adds 8 table bytes


class FakeLM:
    """Logits from integer hashes of the last two tokens: the same bits under any chunking.

    ``perturb_from`` adds a small (< 0.1) offset to the logits of positions >= it, standing in
    for a decoder whose numerics differ from the encoder's.
    """

    def __init__(self, vocab: int = VOCAB, perturb_from: int | None = None) -> None:
        self.vocab_size = vocab
        self.perturb_from = perturb_from
        self.feed_sizes: list[int] = []

    def logits(self, cur: np.ndarray, prev: np.ndarray) -> np.ndarray:
        j = np.arange(self.vocab_size)
        h = (cur[:, None] * 7919 + prev[:, None] * 104_729 + j * 31_337) % 1021
        return (h - 510).astype(np.float32) / np.float32(64)

    def start(self, capacity: int) -> dict:
        return {"last": self.vocab_size, "length": 0, "capacity": capacity}

    def feed(self, state: dict, token_ids: np.ndarray) -> np.ndarray:
        ids = np.asarray(token_ids)
        assert ids.dtype == np.int64 and len(ids) > 0
        assert state["length"] + len(ids) <= state["capacity"], "fed past the capacity"
        logits = self.logits(ids, np.concatenate([[state["last"]], ids[:-1]]))
        if self.perturb_from is not None:
            late = state["length"] + np.arange(len(ids)) >= self.perturb_from
            logits[late] += self.logits(ids[late] + 1, ids[late]) / np.float32(100)
        state["last"], state["length"] = int(ids[-1]), state["length"] + len(ids)
        self.feed_sizes.append(len(ids))
        return logits


def sample_tokens(model: LogitsModel, n: int, seed: int = 0) -> np.ndarray:
    """Tokens drawn from the model itself, so they cost about its entropy."""
    rng = np.random.default_rng(seed)
    out = np.zeros(n, dtype=np.int64)
    out[0] = rng.integers(model.vocab_size)
    state = model.start(n - 1)
    for i in range(1, n):
        z = np.asarray(model.feed(state, out[i - 1 : i])[0], dtype=np.float64)
        p = np.exp(z - z.max())
        out[i] = rng.choice(model.vocab_size, p=p / p.sum())
    return out


def random_tokens(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, VOCAB, n)


def test_fake_model_is_chunking_invariant():
    ids = random_tokens(50)
    lm = FakeLM()
    whole = lm.feed(lm.start(50), ids)
    state = lm.start(50)
    pieces = [lm.feed(state, ids[i : i + 7]) for i in range(0, 50, 7)]
    assert np.array_equal(whole, np.concatenate(pieces))
    assert isinstance(lm, LogitsModel)


@pytest.mark.parametrize("n", [0, 1, 2, 255, 256, 257, 1000])
def test_round_trip_fake_model(n):
    tokens = random_tokens(n, seed=n)
    enc_lm, dec_lm = FakeLM(), FakeLM()
    data = encode_tokens(tokens, enc_lm, feed_chunk=100)
    decoded = decode_tokens(data, dec_lm)
    assert decoded.dtype == np.int64
    np.testing.assert_array_equal(decoded, tokens)
    # The encoder prefills (<= feed_chunk per call); the decoder feeds one token per call.
    assert enc_lm.feed_sizes == [min(100, n - 1 - s) for s in range(0, n - 1, 100)]
    assert dec_lm.feed_sizes == [1] * max(n - 1, 0)


@settings(max_examples=30, deadline=None)
@given(
    n=st.integers(0, 90),
    precision=st.integers(8, 31),
    chunk_size=st.integers(1, 40),
    feed_chunk=st.integers(1, 40),
    seed=st.integers(0, 2**16),
)
def test_round_trip_any_parameters(n, precision, chunk_size, feed_chunk, seed):
    tokens = random_tokens(n, seed)
    data = encode_tokens(
        tokens, FakeLM(), precision_bits=precision, chunk_size=chunk_size, feed_chunk=feed_chunk
    )
    np.testing.assert_array_equal(decode_tokens(data, FakeLM()), tokens)
    # How the encoder feeds the model never changes the bytes.
    assert data == encode_tokens(
        tokens, FakeLM(), precision_bits=precision, chunk_size=chunk_size, feed_chunk=n + 1
    )


def test_size_is_close_to_ideal_and_stats_are_exact():
    lm = FakeLM()
    tokens = sample_tokens(lm, 1000)
    data, stats = encode_tokens_with_stats(tokens, lm, precision_bits=24, chunk_size=256)
    assert stats.n_chunks == 4
    assert stats.overhead_bytes == HEADER + 8 * stats.n_chunks
    assert len(data) == stats.total_bytes == stats.payload_bytes + stats.overhead_bytes
    # The range coder adds at most ~1 byte per chunk (its flush) to the ideal code length.
    assert stats.ideal_bits / 8 - 1 <= stats.payload_bytes <= stats.ideal_bits / 8 + 2 * 4
    # Ideal bits are those of the frequency tables: uniform first token, model after that.
    freqs = frequencies_from_logits(lm.logits(tokens[:-1], np.r_[VOCAB, tokens[:-2]]), 24)
    expected = code_length_bits(freqs, tokens[1:])
    assert math.isclose(stats.position_bits[1:].sum(), expected, rel_tol=1e-12)
    assert abs(stats.position_bits[0] - math.log2(VOCAB)) < 1e-4
    # Sampled from the model: far below the uniform cost log2(97) = 6.6 bits per token.
    assert stats.ideal_bits / 1000 < 4.5
    info = read_token_stream_info(data)
    assert (info.vocab_size, info.n_tokens, info.precision_bits, info.chunk_size) == (
        VOCAB,
        1000,
        24,
        256,
    )
    assert (info.payload_bytes, info.overhead_bytes) == (stats.payload_bytes, HEADER + 32)


def test_golden_stream():
    """Pins the format: docs/format/TOKEN_STREAM.md quotes this vector."""
    tokens = (np.arange(40) * np.arange(40) * 7 + 3 * np.arange(40)) % VOCAB
    data = encode_tokens(tokens, FakeLM(), precision_bits=16, chunk_size=16)
    assert data[:20].hex() == "534b544b011000006100000028000000" + "10000000"
    assert len(data) == 106
    assert hashlib.sha256(data).hexdigest() == (
        "653e3ca8847359a9e2f1db8f6656c04b2d1a1be29eff48b60b392a79abdda599"
    )


def test_decoder_with_different_numerics_names_the_chunk():
    tokens = sample_tokens(FakeLM(), 600, seed=3)
    data = encode_tokens(tokens, FakeLM(), chunk_size=256)
    exact, perturbed = FakeLM(), FakeLM(perturb_from=300)
    good = exact.feed(exact.start(599), tokens[:-1])
    delta = perturbed.feed(perturbed.start(599), tokens[:-1]) - good
    assert not delta[:300].any() and 0 < np.abs(delta[300:]).max() <= 0.08  # slightly off
    with pytest.raises(CorruptStreamError, match=r"token chunk 1 \(positions 256\.\.511\)"):
        decode_tokens(data, FakeLM(perturb_from=300))
    with pytest.raises(CorruptStreamError, match=r"token chunk 2 \(positions 512\.\.599\)"):
        decode_tokens(data, FakeLM(perturb_from=590))


def test_every_truncation_and_bit_flip_raises_corrupt_stream():
    tokens = random_tokens(40, seed=7)
    data = encode_tokens(tokens, FakeLM(), precision_bits=16, chunk_size=16)
    lm = FakeLM()
    for size in range(len(data)):
        with pytest.raises(CorruptStreamError):
            decode_tokens(data[:size], lm)
    with pytest.raises(CorruptStreamError, match="trailing"):
        decode_tokens(data + b"\0", lm)
    for bit in range(8 * len(data)):
        damaged = bytearray(data)
        damaged[bit // 8] ^= 1 << (bit % 8)
        with pytest.raises(CorruptStreamError):
            decode_tokens(bytes(damaged), lm)


def test_wrong_model_and_bad_arguments_raise_codec_errors():
    data = encode_tokens(random_tokens(20), FakeLM())
    with pytest.raises(CodecError, match="97-token vocabulary"):
        decode_tokens(data, FakeLM(vocab=98))
    bad = [
        (random_tokens(6).reshape(2, 3), {}, "1-D integer"),
        (np.array([0.0, 1.0]), {}, "1-D integer"),
        (np.array([0, VOCAB]), {}, r"\[0, 97\)"),
        (np.array([-1, 0]), {}, r"\[0, 97\)"),
        (random_tokens(5), {"precision_bits": 6}, "97-symbol vocabulary does not fit 6-bit"),
        (random_tokens(5), {"chunk_size": 0}, "chunk_size"),
        (random_tokens(5), {"feed_chunk": 0}, "feed_chunk"),
    ]
    for tokens, kwargs, message in bad:
        with pytest.raises(CodecError, match=message):
            encode_tokens(tokens, FakeLM(), **kwargs)

    class Flat(FakeLM):
        def feed(self, state, token_ids):
            return super().feed(state, token_ids)[:, :-1]

    with pytest.raises(CodecError, match="shape"):
        encode_tokens(random_tokens(5), Flat())


@pytest.mark.parametrize("vocab", [151_936, 256_000, 262_144])
def test_large_vocabularies_round_trip_at_24_bits(vocab):
    """Ids past 65,536 under 24-bit tables: exact, and the payload within the range coder's
    flush of the ideal bits (the floors cost V / 2**24 of the mass: 1.6% at 262,144)."""
    model = FakeLM(vocab)
    tokens = np.random.default_rng(vocab).integers(0, vocab, 300)
    tokens[:3] = [vocab - 1, 65_536, 0]
    data, stats = encode_tokens_with_stats(tokens, model, chunk_size=128)
    np.testing.assert_array_equal(decode_tokens(data, model), tokens)
    assert read_token_stream_info(data).vocab_size == vocab
    assert stats.payload_bytes <= stats.ideal_bits / 8 + stats.n_chunks
    # the first token is uniform: 1 + (2**24 - V) // V for every id but 0 (which has the rest)
    assert stats.position_bits[0] == 24 - np.log2(1 + ((1 << 24) - vocab) // vocab)


def test_vocabulary_past_the_tables_is_refused_in_one_line():
    """24-bit tables hold at most 2**24 - 1 symbols (each keeps a frequency of at least 1)."""
    with pytest.raises(CodecError, match=r"^a 16,777,216-symbol vocabulary does not fit 24-bit "):
        encode_tokens(np.array([0, 1]), FakeLM(1 << 24))
    with pytest.raises(CodecError) as refusal:
        encode_tokens(np.array([0]), FakeLM(1 << 25), precision_bits=24)
    assert "\n" not in str(refusal.value) and "at most 16,777,215 symbols" in str(refusal.value)


# --- the canonical forward on a tiny random llama ------------------------------------------


class CanonicalAdapter:
    """CanonicalLM as a LogitsModel (the lead's seqkv_cli wrapper does the same)."""

    def __init__(self, lm) -> None:
        self.lm = lm
        self.vocab_size = lm.vocab_size

    def start(self, capacity: int):
        return self.lm.new_state(capacity)

    def feed(self, state, token_ids: np.ndarray) -> np.ndarray:
        import torch

        return self.lm.forward(state, torch.from_numpy(np.asarray(token_ids))).numpy()


@pytest.fixture(scope="module")
def canonical(tmp_path_factory) -> CanonicalAdapter:
    from transformers import AutoModelForCausalLM

    from conftest import build_tiny_model
    from seqkv_cli.runtime.legacy import CanonicalLM

    folder = build_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", context=512)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype="float32").eval()
    return CanonicalAdapter(CanonicalLM(hf))


def test_round_trip_canonical_lm(canonical):
    tokens = sample_tokens(canonical, 320, seed=1)  # crosses the 256-position key block
    data, stats = encode_tokens_with_stats(tokens, canonical)
    np.testing.assert_array_equal(decode_tokens(data, canonical), tokens)
    assert stats.n_chunks == 2
    assert stats.payload_bytes <= stats.ideal_bits / 8 + 2 * stats.n_chunks
    assert data == encode_tokens(tokens, canonical, feed_chunk=37)  # prefill chunking


class RowsFakeLM(FakeLM):
    """The fake model with a batched entry point, as the canonical adapter has."""

    def __init__(self) -> None:
        super().__init__()
        self.row_calls = 0

    def feed_rows(self, states: list, token_ids: np.ndarray) -> np.ndarray:
        self.row_calls += 1
        return np.concatenate([self.feed(s, token_ids[i : i + 1]) for i, s in enumerate(states)])


def test_batch_decode_matches_single_decode_and_isolates_damage():
    from seqkv_codecs.sequential.batch_decode import decode_tokens_batch

    model = FakeLM()
    tokens = [random_tokens(n, seed=n) for n in (300, 1, 0, 77, 513)]
    streams = [encode_tokens(t, model, chunk_size=128) for t in tokens]
    damaged = bytearray(streams[3])
    damaged[-2] ^= 0x21
    rows = RowsFakeLM()
    results = decode_tokens_batch([*streams[:3], bytes(damaged), streams[4]], rows)
    for k in (0, 1, 2, 4):
        assert np.array_equal(results[k], tokens[k])
    assert isinstance(results[3], CorruptStreamError) and "token chunk 0" in str(results[3])
    assert rows.row_calls == 512  # one batched pass per position after the first
    plain = decode_tokens_batch(streams, FakeLM())  # no feed_rows: fed one by one
    assert all(np.array_equal(a, b) for a, b in zip(plain, tokens, strict=True))


class DraftsFakeLM(RowsFakeLM):
    """The fake model with the draft-and-verify entry points of the canonical adapter:
    several tokens per sequence in one pass, and a roll-back of the guesses that failed."""

    def __init__(self, room: int | None = None) -> None:
        super().__init__()
        self.passes: list[int] = []
        self.room = room  # tokens a pass may carry per sequence (None: all it is given)

    def start(self, capacity: int) -> dict:
        return {**super().start(capacity), "fed": []}

    def feed(self, state: dict, token_ids: np.ndarray) -> np.ndarray:
        state["fed"].extend(int(t) for t in token_ids)
        return super().feed(state, token_ids)

    def feed_drafts(self, states: list, lists: list) -> list:
        cut = [ids[: self.room] if self.room else ids for ids in lists]
        self.passes.append(sum(len(ids) for ids in cut))
        return [
            self.feed(s, np.asarray(ids, dtype=np.int64))
            for s, ids in zip(states, cut, strict=True)
        ]

    def accept(self, state: dict, ids, logits, n: int) -> None:
        del state["fed"][len(state["fed"]) - (len(logits) - n) :]
        state["length"] = len(state["fed"])
        state["last"] = state["fed"][-1]


def repetitive_tokens(n: int, seed: int = 0) -> np.ndarray:
    """Phrases that recur, as in code and agent transcripts: n-gram guesses find them."""
    rng = np.random.default_rng(seed)
    phrases = [rng.integers(0, VOCAB, int(rng.integers(4, 12))) for _ in range(6)]
    out = np.concatenate([phrases[int(rng.integers(6))] for _ in range(n)])[:n]
    return out.astype(np.int64)


@pytest.mark.parametrize("room", [None, 2])
def test_decoding_with_guesses_gives_the_same_tokens_in_fewer_passes(room):
    from seqkv_codecs.sequential.batch_decode import decode_tokens_batch

    model = FakeLM()
    tokens = [repetitive_tokens(n, seed=n) for n in (400, 2, 1, 130)]
    streams = [encode_tokens(t, model, chunk_size=64) for t in tokens]
    damaged = bytearray(streams[3])
    damaged[-3] ^= 0x10
    guessing = DraftsFakeLM(room)
    results = decode_tokens_batch([*streams[:3], bytes(damaged)], guessing, with_states=True)
    for k in (0, 1, 2):
        got, state = results[k]
        assert np.array_equal(got, tokens[k])
        if state is not None:  # what it fed: every token but the last, guesses rolled back
            assert state["fed"] == tokens[k][:-1].tolist()
    assert isinstance(results[3][0], CorruptStreamError)
    assert guessing.row_calls + len(guessing.passes) < 399  # one pass per token without
    off = DraftsFakeLM()
    plain = decode_tokens_batch(streams[:3], off, drafts=False)
    assert not off.passes and off.row_calls == 399
    assert all(np.array_equal(a, b) for a, b in zip(plain, tokens, strict=False))
