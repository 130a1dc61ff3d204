"""Near-duplicate prefixes: edit scripts round-trip, damage is refused, clusters and medoids."""

from __future__ import annotations

import struct
import zlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from seqkv_cli.errors import SeqkvError
from seqkv_cli.trie.neardup.alignment import (
    COPY,
    DELETE,
    INSERT,
    Edit,
    align,
    apply_edits,
    common_prefix_len,
)
from seqkv_cli.trie.neardup.clustering import Cluster, cluster, near_prefix, plt_distance
from seqkv_cli.trie.neardup.edits import decode_edits, encode_edits

VOCAB = 50


class Bigram:
    """A `LogitsModel` whose next-token logits depend on the previous token only."""

    vocab_size = VOCAB

    def __init__(self, seed: int = 0) -> None:
        self.table = (np.random.default_rng(seed).standard_normal((VOCAB, VOCAB)) * 3).astype(
            np.float32
        )

    def start(self, capacity: int) -> list:
        return []

    def feed(self, state: list, token_ids: np.ndarray) -> np.ndarray:
        state.extend(token_ids.tolist())
        return self.table[np.asarray(token_ids)]


@st.composite
def pairs(draw):
    """A centroid and a member made from it by random substitutions, inserts and deletes."""
    centroid = draw(st.lists(st.integers(0, VOCAB - 1), max_size=120))
    member = list(centroid)
    for _ in range(draw(st.integers(0, 6))):
        at = draw(st.integers(0, len(member)))
        kind = draw(st.sampled_from(["sub", "ins", "del"]))
        new = draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=5))
        if kind == "ins" or not member:
            member[at:at] = new
        elif kind == "sub":
            member[at : at + len(new)] = new
        else:
            del member[at : at + len(new)]
    tail = draw(st.lists(st.integers(0, VOCAB - 1), max_size=30))
    return np.array(centroid, np.int64), np.array(member + tail, np.int64)


@settings(max_examples=150, deadline=None)
@given(pairs(), st.sampled_from([1, 4, 8]))
def test_align_encode_decode_round_trip(pair, min_copy):
    centroid, member = pair
    edits = align(centroid, member, min_copy=min_copy)
    assert np.array_equal(apply_edits(edits, centroid), member)
    assert all(e.length >= min_copy for e in edits if e.op == COPY)
    for data in (encode_edits(edits), encode_edits(edits, centroid=centroid)):
        assert np.array_equal(decode_edits(data, centroid), member)


@settings(max_examples=40, deadline=None)
@given(pairs())
def test_model_coded_round_trip(pair):
    centroid, member = pair
    edits = align(centroid, member)
    data = encode_edits(edits, centroid=centroid, model=Bigram(), precision_bits=16)
    assert np.array_equal(decode_edits(data, centroid, model=Bigram()), member)


def test_model_coding_costs_about_the_surprisal_of_inserted_tokens():
    model = Bigram(1)
    rng = np.random.default_rng(2)
    centroid = rng.integers(0, VOCAB, 300)
    # A member whose tail follows the model's most likely next token: cheap under the model.
    member = list(centroid[:200])
    for _ in range(150):
        member.append(int(np.argmax(model.table[member[-1]])))
    member = np.array(member)
    edits = align(centroid, member)
    assert [e.op for e in edits] == [COPY, DELETE, INSERT]
    coded = encode_edits(edits, centroid=centroid, model=model)
    plain = encode_edits(edits, centroid=centroid)
    logp = model.table - np.log(np.exp(model.table.astype(np.float64)).sum(1, keepdims=True))
    ideal_bits = -sum(logp[member[p - 1], member[p]] for p in range(200, 350)) / np.log(2)
    framing = 7 + 5 + 3 * 2 + 1 + 8  # head, 3 length varints, 3 ops, payload length, CRCs
    assert len(coded) <= framing + ideal_bits / 8 + 2  # one flush byte, and rounding
    assert len(coded) < len(plain) / 3
    with pytest.raises(SeqkvError, match="wrong centroid or model"):
        decode_edits(coded, centroid, model=Bigram(7))
    with pytest.raises(SeqkvError, match="pass model="):
        decode_edits(coded, centroid)


def _pair():
    rng = np.random.default_rng(3)
    centroid = rng.integers(0, VOCAB, 200)
    member = np.concatenate([centroid[:5], [7, 8], centroid[6:150], rng.integers(0, VOCAB, 40)])
    return centroid, member


def test_every_damaged_byte_and_truncation_is_refused():
    centroid, member = _pair()
    data = encode_edits(align(centroid, member), centroid=centroid)
    for i in range(len(data)):
        bad = bytearray(data)
        bad[i] ^= 0x5A
        with pytest.raises(SeqkvError):
            decode_edits(bytes(bad), centroid)
    for n in range(len(data)):
        with pytest.raises(SeqkvError):
            decode_edits(data[:n], centroid)


def _resealed(body: bytes) -> bytes:
    return body + struct.pack("<I", zlib.crc32(body))


def test_consistent_crc_but_bad_content_is_refused():
    centroid, member = _pair()
    data = encode_edits(align(centroid, member), centroid=centroid)
    other = centroid.copy()
    other[100] = (other[100] + 1) % VOCAB
    with pytest.raises(SeqkvError, match="wrong centroid"):
        decode_edits(data, other)
    with pytest.raises(SeqkvError, match="expects a 200-token centroid"):
        decode_edits(data, centroid[:-1])
    # Hand-made streams with a valid stream CRC: wrong lengths, unknown op, trailing bytes.
    head = b"SKND\x01\x00\x00"
    with pytest.raises(SeqkvError, match="disagree with the lengths"):
        decode_edits(_resealed(head + bytes([3, 2, 1, 3 << 2])), np.arange(3))
    with pytest.raises(SeqkvError, match="unknown op code"):
        decode_edits(_resealed(head + bytes([3, 3, 1, 3 << 2 | 3])), np.arange(3))
    with pytest.raises(SeqkvError, match="trailing"):
        decode_edits(_resealed(head + bytes([3, 3, 1, 3 << 2, 9])), np.arange(3))
    with pytest.raises(SeqkvError, match="runs past"):
        decode_edits(_resealed(head + bytes([3, 3, 1, 0x80])), np.arange(3))
    with pytest.raises(SeqkvError, match="version 2"):
        decode_edits(_resealed(b"SKND\x02\x00\x00" + bytes([0, 0, 0])), np.arange(0))


def test_cluster_groups_near_duplicates_and_picks_the_medoid():
    rng = np.random.default_rng(4)
    prompt = rng.integers(0, VOCAB, 300)

    def tail():
        return rng.integers(0, VOCAB, 60)

    def edit(a, at, new):
        b = a.copy()
        b[at : at + len(new)] = new
        return b

    helpful = prompt
    friendly = edit(prompt, 5, [1, 2])
    ai = edit(friendly, 40, [3])  # two edits from `helpful`, one from `friendly`
    far = edit(prompt, 10, rng.integers(0, VOCAB, 60))  # 60 of the first 70 tokens differ
    sessions = {
        "helpful-1": np.concatenate([helpful, tail()]),
        "helpful-2": np.concatenate([helpful, tail()]),
        "friendly": np.concatenate([friendly, tail()]),
        "ai": np.concatenate([ai, tail()]),
        "other": rng.integers(0, VOCAB, 300),
        "short": prompt[:20],
    }
    got = cluster(sessions, max_edit_fraction=0.05)
    assert got == sorted(
        [
            Cluster("friendly", ("ai", "helpful-1", "helpful-2")),
            Cluster("other", ()),
            Cluster("short", ()),
        ]
    )
    # `far` edits 60 of its first 70 tokens: the 5% budget is only met at >= 1,200 tokens.
    assert near_prefix(prompt, far)[0] == 10
    assert near_prefix(prompt, far, max_edit_fraction=0.25) == (300, 60)
    assert [c.centroid for c in cluster({"a": prompt, "b": far})] == ["a", "b"]
    with pytest.raises(SeqkvError, match="max_edit_fraction"):
        cluster(sessions, max_edit_fraction=1.5)


def test_near_prefix_and_common_prefix():
    centroid, member = _pair()
    assert common_prefix_len(centroid, member) == 5
    assert near_prefix(centroid, member) == (151, 2)  # 2 tokens replace 1
    assert common_prefix_len(centroid, centroid) == 200


def test_plt_distance_is_the_surprisal_of_the_common_prefix():
    s = np.array([1.0, 2.0, 3.0, 4.0])  # capture layout: bits of tokens 1..4
    assert plt_distance(s, 3) == 3.0
    assert plt_distance(s, 5, first_token_bits=15.5) == 25.5
    assert plt_distance(s, 0) == 0.0
    with pytest.raises(SeqkvError, match="does not fit"):
        plt_distance(s, 6)


def test_bad_edits_and_inputs_are_refused():
    with pytest.raises(SeqkvError, match="does not fit"):
        apply_edits([Edit(COPY, 5)], np.arange(3))
    with pytest.raises(SeqkvError, match="consume 2 centroid tokens"):
        apply_edits([Edit(COPY, 2)], np.arange(3))
    with pytest.raises(SeqkvError, match="1-D array"):
        align(np.arange(4).reshape(2, 2), np.arange(3))
    with pytest.raises(SeqkvError, match="needs the centroid"):
        encode_edits([Edit(INSERT, 1, (3,))], model=Bigram())


def test_model_coded_round_trip_on_the_canonical_path(tiny_lm):
    """Encoder prefills in 256-token chunks, decoder steps: both must see the same rows."""
    from seqkv_cli.kvcapture.engine import canonical_model
    from seqkv_cli.sequential.adapter import CanonicalLogits

    canon = canonical_model(tiny_lm)
    rng = np.random.default_rng(5)
    centroid = rng.integers(0, canon.vocab_size, 300)
    member = np.concatenate([centroid[:3], [9], centroid[4:280], rng.integers(0, 200, 12)])
    edits = align(centroid, member)
    data = encode_edits(edits, centroid=centroid, model=CanonicalLogits(canon))
    assert np.array_equal(decode_edits(data, centroid, model=CanonicalLogits(canon)), member)


@pytest.mark.model
def test_sample_chats_form_one_cluster_with_near_prefix_712(embedded_lm):
    from conftest import SAMPLE_DATA
    from seqkv_cli.kvcapture.engine import tokenize
    from seqkv_cli.kvcapture.inputs import read_inputs

    docs = read_inputs([str(SAMPLE_DATA / "chats.jsonl")])
    ids = {d.id: np.array(tokenize(embedded_lm, d)) for d in docs}
    [only] = cluster(ids)
    assert only.centroid.startswith("chat-") and len(only.members) == 15
    for near in ("near-01", "near-02", "near-03"):
        assert common_prefix_len(ids[only.centroid], ids[near]) in (5, 6)
        end, edited = near_prefix(ids[only.centroid], ids[near])
        assert end == 712 and edited in (1, 2)


def test_clustering_aligns_candidate_pairs_only_and_still_finds_near_duplicates(monkeypatch):
    """Issue 13: --near-dup aligned all n^2 pairs; now O(n * MAX_CANDIDATES) alignments."""
    from seqkv_cli.trie.neardup import clustering as neardup_cluster

    rng = np.random.default_rng(5)
    sessions = {f"s{i:03d}": rng.integers(0, 5000, 120) for i in range(300)}
    prompt = rng.integers(0, 5000, 200)
    for k in range(3):  # three near-duplicates: one token edited early in a shared prompt
        edited = prompt.copy()
        edited[10 + k] = 5001 + k
        sessions[f"near{k}"] = edited
    calls = []
    real = neardup_cluster.opcodes
    monkeypatch.setattr(neardup_cluster, "opcodes", lambda a, b: calls.append(1) or real(a, b))
    clusters = neardup_cluster.cluster(sessions)
    assert len(calls) <= len(sessions) * neardup_cluster.MAX_CANDIDATES
    assert len(calls) < 1000  # random sessions share no shingle: almost nothing is aligned
    grouped = [c for c in clusters if c.members]
    assert len(grouped) == 1 and sorted([grouped[0].centroid, *grouped[0].members]) == [
        "near0",
        "near1",
        "near2",
    ]


def test_stream_bytes_match_the_spec():
    """docs/format/NEARDUP.md, "Example": a hand-checked stream, byte for byte."""
    centroid = np.array([5, 6, 7, 8], np.int64)
    member = np.array([5, 6, 300, 8], np.int64)
    edits = align(centroid, member, min_copy=1)
    assert edits == [Edit(COPY, 2), Edit(DELETE, 1), Edit(INSERT, 1, (300,)), Edit(COPY, 1)]
    plain = bytes.fromhex("534b4e44 01 00 00 04 04 04 08 05 06 ac02 04 d8d49ebc")
    assert encode_edits(edits) == plain == _resealed(plain[:-4])
    with_crc = bytes.fromhex("534b4e44 01 02 00 04 04 04 08 05 06 ac02 04 e167c5b4 42956d94")
    assert with_crc[-8:-4] == struct.pack("<I", zlib.crc32(member.astype("<u4").tobytes()))
    assert encode_edits(edits, centroid=centroid) == with_crc == _resealed(with_crc[:-4])
    assert np.array_equal(decode_edits(with_crc, centroid), member)


def test_limits_of_the_stated_lengths():
    head = b"SKND\x01\x00\x00"
    with pytest.raises(SeqkvError, match=f"centroid length {(1 << 24) + 1} exceeds {1 << 24}"):
        decode_edits(_resealed(head + bytes.fromhex("8180 8008 00 00")), np.arange(3))
    with pytest.raises(SeqkvError, match="token id 4294967296 exceeds 4294967295"):
        decode_edits(_resealed(head + bytes.fromhex("00 01 01 06 8080808010")), np.arange(0))
    with pytest.raises(SeqkvError, match="op runs past the stream"):
        decode_edits(_resealed(head + bytes.fromhex("00 00 01") + b"\x80" * 10 + b"\0"), [])


def test_edits_part_header():
    from seqkv_cli.trie.neardup_store import read_header

    assert read_header(b"\x03\xac\x02rest") == (3, 300, b"rest")
    assert read_header(b"\x80" * 5 + b"\x01\x00") == (1 << 35, 0, b"")  # 6 bytes: accepted
    for bad in (b"", b"\x03", b"\x03\x80", b"\x80" * 6 + b"\x01\x00"):
        with pytest.raises(SeqkvError, match="edits part is damaged"):
            read_header(bad)


def test_near_dup_modules_import_no_private_names():
    import ast
    from pathlib import Path

    from seqkv_cli import trie

    for path in Path(trie.__file__).parent.glob("neardup*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                private = [a.name for a in node.names if a.name.startswith("_")]
                assert not private or node.module == "__future__", (path.name, private)
