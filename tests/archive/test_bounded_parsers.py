"""Issue 13 A: what runs after a CRC passes is bounded by what the file declares.

Each test here failed on the code before the fix (a traceback, an unbounded allocation, a
whole batch lost to one session, or a decode that ran before its shape was checked).
"""

from __future__ import annotations

import json
import struct
import time
import tracemalloc
import zlib

import numpy as np
import pytest

from seqkv_cli.errors import SeqkvError
from seqkv_cli.trie import tables
from seqkv_cli.trie.tables import (
    FRESH,
    Node,
    SegmentTables,
    SessionRecord,
    decode_tables,
    encode_tables,
)
from seqkv_codecs.errors import CodecError, CorruptStreamError
from seqkv_codecs.varint import encode_varint
from tests.forge import put_together, read_tables, take_apart


def _tables() -> SegmentTables:
    nodes = [Node(-1, 0, 5, 0, 7)]
    return SegmentTables(nodes, [SessionRecord("a", 0, 5)], [{"shapes": {}}])


def _packed() -> bytes:
    names = {"profiles": [{"shapes": {}}], "sessions": [["a"]]}
    return zlib.compress(json.dumps(names, separators=(",", ":")).encode(), 9)


def _with_names(blob: bytes) -> bytes:
    """The table of `_tables()` with its zlib'd names replaced by `blob`."""
    good = encode_tables(_tables(), 0)
    out = bytearray(good[: len(good) - len(_packed()) - 1])  # less the 1-byte varint length
    out += encode_varint(len(blob))
    return bytes(out + blob)


def test_names_table_roundtrips():
    assert _with_names(_packed()) == encode_tables(_tables(), 0)
    assert decode_tables(_with_names(_packed()), 0, "x").sessions[0].id == "a"


def test_zlib_bomb_in_names_stops_at_the_cap():
    bomb = zlib.compress(b" " * (128 << 20), 9)  # 128 KB that inflate to 128 MiB
    tracemalloc.start()
    try:
        with pytest.raises(SeqkvError, match="inflate past"):
            decode_tables(_with_names(bomb), 0, "t1")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2 * tables.MAX_NAMES_BYTES + (4 << 20), peak  # zlib's output buffer


@pytest.mark.parametrize("depth", [40, 100_000])
def test_deeply_nested_names_are_a_clean_refusal(depth):
    deep = "[" * depth + "]" * depth
    text = '{"profiles":[{"shapes":{}}],"sessions":[["a",{"x":' + deep + "}]]}"
    with pytest.raises(SeqkvError, match=r"nest deeper|do not decompress"):
        decode_tables(_with_names(zlib.compress(text.encode())), 0, "t1")


def test_handle_errors_turns_recursion_into_one_line(capsys):
    import typer

    from seqkv_cli.commands._common import handle_errors

    @handle_errors
    def boom():
        raise RecursionError("maximum recursion depth exceeded")

    with pytest.raises(typer.Exit) as exit_info:
        boom()
    assert exit_info.value.exit_code == 2
    err = capsys.readouterr().err
    assert "nested too deeply" in err and "Traceback" not in err


def test_node_decoder_bounds_the_token_count():
    from seqkv_codecs.sequential.node_stream import NodeDecoder

    with pytest.raises(CorruptStreamError, match="more than the 8192 allowed"):
        NodeDecoder(b"\x00", 1 << 40, 0, 24, max_tokens=8192)
    with pytest.raises(CorruptStreamError, match="precision_bits"):
        NodeDecoder(b"\x00", 3, 0, 24.5)


# -- per-vector files, forged ---------------------------------------------------------------


def _capture(session_id: str, tokens, seed: int):
    import torch

    from seqkv_cli.kvcapture.capture_file import Capture

    gen = torch.Generator().manual_seed(seed)
    n = len(tokens)
    keys = [torch.randn(1, n, 8, generator=gen).bfloat16() for _ in range(2)]
    values = [torch.randn(1, n, 8, generator=gen).bfloat16() for _ in range(2)]
    meta = {
        "session_id": session_id,
        "source": "synthetic",
        "model_name": "synthetic",
        "model_fingerprint": "0" * 64,
        "tokenizer_fingerprint": "0" * 64,
        "dtype": "bf16",
        "numeric_path": "synthetic",
        "num_layers": 2,
        "num_kv_heads": 1,
        "head_dim": 8,
        "positions": n,
    }
    surprisal = torch.rand(n - 1, generator=gen, dtype=torch.float64)
    return Capture(torch.tensor(tokens), keys, values, surprisal, meta)


@pytest.fixture(scope="module")
def small_files(tmp_path_factory):
    """{(codec, layout): path} of tiny archives of two sessions sharing a prefix. Their seeds
    differ, so their surprisal and K/V over the prefix differ: a trie archive keeps one
    session's as the shared node and stores the other's as parts of its own (the tests of
    those parts need them)."""
    from seqkv_cli.archive import compress_captures
    from seqkv_cli.kvcapture.capture_file import save_capture

    folder = tmp_path_factory.mktemp("bounded")
    caps = []
    for k, tokens in enumerate(([5, 6, 7, 8, 9, 10], [5, 6, 7, 11, 12])):
        caps.append(folder / f"s{k}.safetensors")
        save_capture(_capture(f"s{k}", tokens, k), caps[-1])
    out = {}
    for codec in ("lossless", "turbo3"):
        for layout in ("flat", "trie"):
            out[codec, layout] = folder / f"{codec}-{layout}.skv"
            compress_captures(caps, out[codec, layout], codec=codec, layout=layout)
    return out


def _restore_all(path):
    from seqkv_cli.archive import Archive

    with Archive(path) as arc:
        return [result for _, result in arc.restore_many(arc.sessions)]


def test_decode_checked_refuses_before_decoding(monkeypatch):
    from seqkv_codecs.kvblock import KVBlock
    from seqkv_codecs.pervector import LosslessCodec

    codec = LosslessCodec()
    block = KVBlock(np.zeros((1, 4, 8), np.uint16), "bf16", "key")
    data = codec.encode(block)
    assert codec.decode_checked(data, (1, 4, 8), "bf16", "key") == block
    monkeypatch.setattr(LosslessCodec, "decode", lambda *a: pytest.fail("decoded anyway"))
    with pytest.raises(CodecError, match=r"expected bf16 \(1, 5, 8\)"):
        codec.decode_checked(data, (1, 5, 8), "bf16")
    with pytest.raises(CodecError, match="not values"):
        codec.decode_checked(data, (1, 4, 8), "bf16", "value")


def test_turbo_block_with_a_huge_dense_head_dim_is_refused_at_once():
    from seqkv_codecs.kvblock import KVBlock
    from seqkv_codecs.pervector import Turbo3Codec

    block = KVBlock.from_float32(np.ones((1, 2, 8), np.float32), "bf16", "key")
    data = bytearray(Turbo3Codec().encode(block))
    struct.pack_into("<H", data, 11, 8191)  # head_dim: 110 s and 2.9 GB before the fix
    start = time.perf_counter()
    with pytest.raises(CodecError, match="head_dim 8191"):
        Turbo3Codec().decode(bytes(data))
    assert time.perf_counter() - start < 1


def test_flat_block_of_another_shape_is_refused_before_decoding(small_files, tmp_path, monkeypatch):
    from seqkv_codecs.pervector import LosslessCodec

    header, sections = take_apart(small_files["lossless", "flat"])
    header["sessions"][0]["positions"] = 5  # tokens are checked later; the blocks say 6
    sections["s0/tokens"] = sections["s0/tokens"][:20]
    sections["s0/surprisal"] = sections["s0/surprisal"][:32]
    path = tmp_path / "f.skv"
    path.write_bytes(put_together(header, sections))
    calls = []
    real = LosslessCodec.decode
    monkeypatch.setattr(LosslessCodec, "decode", lambda self, d: calls.append(1) or real(self, d))
    results = _restore_all(path)
    assert isinstance(results[0], SeqkvError) and "expected bf16 (1, 5, 8)" in str(results[0])
    assert not isinstance(results[1], Exception)  # the other session still restores
    assert len(calls) == 4  # only session s1's four blocks were decoded


def test_trie_node_claiming_a_huge_length_is_refused_at_open(small_files, tmp_path):
    from seqkv_cli.archive import Archive

    header, sections = take_apart(small_files["lossless", "trie"])
    t = read_tables(sections["t1/index"])
    t.nodes[-1].n_tokens = 1 << 40
    sections["t1/index"] = encode_tables(t, 0, FRESH) + (t.tokens or b"")
    path = tmp_path / "t.skv"
    path.write_bytes(put_together(header, sections))
    with pytest.raises(SeqkvError, match="impossible length"):
        Archive(path)


def test_trie_kv_block_of_another_shape_is_refused(small_files, tmp_path):
    header, sections = take_apart(small_files["turbo3", "trie"])
    kv = bytearray(sections["t1/kv"])
    struct.pack_into("<H", kv, 11, 8191)  # first block's head_dim, the profile says 8
    sections["t1/kv"] = bytes(kv)
    path = tmp_path / "t.skv"
    path.write_bytes(put_together(header, sections))
    results = _restore_all(path)
    assert all(isinstance(r, SeqkvError) for r in results)
    assert "expected bf16 (1, " in str(results[0]) and "8191" in str(results[0])


def test_flat_session_with_too_many_positions_is_refused(small_files, tmp_path):
    from seqkv_cli.archive import Archive

    header, sections = take_apart(small_files["lossless", "flat"])
    header["sessions"][1]["positions"] = 1 << 40
    path = tmp_path / "f.skv"
    path.write_bytes(put_together(header, sections))
    with pytest.raises(SeqkvError, match="over the limit"):
        Archive(path)


@pytest.mark.parametrize("precision", [24.5, "24", None, True, 0, 40])
def test_non_integer_precision_is_a_clean_refusal(small_files, tmp_path, precision):
    from seqkv_cli.archive import Archive

    header, sections = take_apart(small_files["lossless", "flat"])
    header["pipeline"] = [
        {"id": "seq", "precision_bits": precision, "chunk_size": 1024, "residual": "lossless"}
    ]
    path = tmp_path / "f.skv"
    path.write_bytes(put_together(header, sections))
    with pytest.raises(SeqkvError, match="precision_bits"):
        Archive(path)


# -- seq batches: one damaged stream fails alone ----------------------------------------------


class _FakeLM:
    """Deterministic logits from the last token (enough for the range coder)."""

    def __init__(self, vocab: int = 50, max_context: int | None = None) -> None:
        self.vocab_size = vocab
        if max_context is not None:
            self.max_context = max_context

    def start(self, capacity: int):
        if capacity > 10_000:
            raise RuntimeError(f"{capacity} positions do not fit")
        return []

    def feed(self, state, token_ids):
        state.extend(int(t) for t in token_ids)
        rows = np.zeros((len(token_ids), self.vocab_size), np.float32)
        rows[np.arange(len(token_ids)), (np.asarray(token_ids) * 7 + 3) % self.vocab_size] = 4
        return rows


def test_a_damaged_stream_does_not_abort_the_batch():
    from seqkv_codecs.sequential.batch_decode import decode_tokens_batch
    from seqkv_codecs.sequential.token_coder import encode_tokens

    tokens = np.arange(12) % 50
    good = encode_tokens(tokens, _FakeLM())
    other_vocab = encode_tokens(tokens, _FakeLM(vocab=60))
    long = encode_tokens(np.arange(30) % 50, _FakeLM(), chunk_size=1024)
    results = decode_tokens_batch([other_vocab, good, long], _FakeLM(max_context=20))
    assert isinstance(results[0], CodecError) and "60-token vocabulary" in str(results[0])
    assert np.array_equal(results[1], tokens)
    assert isinstance(results[2], CorruptStreamError) and "past the model's 20" in str(results[2])


# -- found by the structure-aware fuzzer (test_structure_fuzz.py) ----------------------------


def _forged(tmp_path, source, change):
    header, sections = take_apart(source)
    change(header, sections)
    path = tmp_path / "forged.skv"
    path.write_bytes(put_together(header, sections))
    return path


def test_flat_surprisal_of_a_wrong_length_is_refused(small_files, tmp_path):
    def change(header, sections):
        sections["s0/surprisal"] = sections["s0/surprisal"][:-3]  # ValueError before

    results = _restore_all(_forged(tmp_path, small_files["lossless", "flat"], change))
    assert isinstance(results[0], SeqkvError) and "inconsistent lengths" in str(results[0])


def test_header_claiming_fewer_layers_than_the_file_holds_is_refused(small_files, tmp_path):
    def change(header, sections):
        header["sessions"][0]["shapes"]["num_layers"] = 1  # restored 1 of 2 layers before

    results = _restore_all(_forged(tmp_path, small_files["turbo3", "flat"], change))
    assert isinstance(results[0], SeqkvError) and "other layers" in str(results[0])
    assert not isinstance(results[1], Exception)


def test_non_dict_capture_meta_is_refused(small_files, tmp_path):
    from seqkv_cli.archive import Archive

    def change(header, sections):
        header["sessions"][0]["capture_meta"] = 2  # TypeError before

    with pytest.raises(SeqkvError, match="malformed session entry"):
        Archive(_forged(tmp_path, small_files["lossless", "flat"], change))


def test_trie_session_whose_end_was_changed_is_refused(small_files, tmp_path):
    def change(header, sections):
        t = read_tables(sections["t1/index"])
        t.sessions[0].end -= 1  # restored a shorter session, silently, before
        sections["t1/index"] = encode_tables(t, 0, FRESH) + (t.tokens or b"")

    results = _restore_all(_forged(tmp_path, small_files["turbo3", "trie"], change))
    # the table's log2 PP, or the session's own surprisal part, no longer fits the path
    assert isinstance(results[0], SeqkvError)
    assert "log2 PP" in str(results[0]) or "stored surprisal" in str(results[0])


def test_trie_session_surprisal_of_a_wrong_length_is_refused(small_files, tmp_path):
    _, sections = take_apart(small_files["lossless", "trie"])
    own = [n for n in sections if n.endswith("/surprisal") and n.count("/") == 2]
    # small_files' sessions differ over their shared prefix, so one stores its own surprisal
    assert own, f"the fixture's trie archive stores no session surprisal: {sorted(sections)}"

    def change(header, sections):
        sections[own[0]] = sections[own[0]][:-3]  # ValueError before

    results = _restore_all(_forged(tmp_path, small_files["lossless", "trie"], change))
    assert any(isinstance(r, SeqkvError) and "stored surprisal" in str(r) for r in results)
