"""Near-duplicate prefixes: align a member to a centroid session and store only the edits.

Exact-prefix dedup stops at the first differing token, so "You are a helpful …" and "You are
an AI …" share five tokens even when the next 700 agree. Here a member is an edit script
against its cluster's centroid (copy / delete / insert runs, from difflib's alignment), and
only inserted tokens cost real bits: varints, or range-coded under the model conditioned on
the member's own prefix (what `seq` would pay for them). Measured gain: docs/BENCHMARKS.md,
"Near-duplicate prefixes".

Edit stream, little-endian: magic ``b"SKND"``, u8 version (1), u8 flags (bit 0: inserted
tokens range-coded under a model; bit 1: member CRC present), u8 precision P of the range
coder (0 without a model); varints centroid length, member length, op count; per op a varint
``length << 2 | code`` (0 copy, 1 delete, 2 insert), an insert followed by its token ids as
varints unless range-coded; if range-coded, a varint byte count and the range coder payload
(inserted tokens in order, each under the model's row after the member's tokens before it;
a member's first token under the uniform row, as in docs/TOKEN_STREAM.md); if bit 1, u32
CRC32 of the member's token ids, each written as u32 (catches a wrong centroid or model);
u32 CRC32 of every byte before it (catches damage).
"""

from __future__ import annotations

import struct
import zlib
from difflib import SequenceMatcher
from typing import NamedTuple

import numpy as np

from seqkv_cli.errors import SeqkvError

MAGIC = b"SKND"
VERSION = 1
COPY, DELETE, INSERT = "copy", "delete", "insert"
_CODES = (COPY, DELETE, INSERT)
_FLAG_MODEL, _FLAG_CRC = 1, 2  # inserted tokens range-coded; member CRC present
_MAX_TOKENS = 1 << 24  # far beyond any model context; bounds what a stream may claim
_ANCHOR = 8  # a near prefix must end on a run of at least this many equal tokens


class Edit(NamedTuple):
    """One run: copy or delete ``length`` centroid tokens, or insert ``tokens``."""

    op: str
    length: int
    tokens: tuple[int, ...] = ()


def _ids(a, what: str) -> np.ndarray:
    x = np.asarray(a)
    if x.ndim != 1 or (x.size and x.dtype.kind not in "iu") or (x.size and x.min() < 0):
        raise SeqkvError(f"{what} must be a 1-D array of non-negative token ids")
    return x.astype(np.int64)


def _opcodes(centroid: np.ndarray, member: np.ndarray) -> list[tuple]:
    sm = SequenceMatcher(None, centroid.tolist(), member.tolist(), autojunk=False)
    return sm.get_opcodes()


def _fold(raw: list[tuple], min_copy: int) -> list[tuple]:
    """Opcodes with equal runs shorter than ``min_copy`` merged into the edits around them."""
    out: list[list] = []
    for tag, i1, i2, j1, j2 in raw:
        tag = "equal" if tag == "equal" and i2 - i1 >= min_copy else "edit"
        if out and out[-1][0] == tag == "edit":
            out[-1][2], out[-1][4] = i2, j2
        else:
            out.append([tag, i1, i2, j1, j2])
    return [tuple(o) for o in out]


def align(centroid: np.ndarray, member: np.ndarray, *, min_copy: int = 8) -> list[Edit]:
    """Edits turning ``centroid`` into ``member``; equal runs under ``min_copy`` are re-inserted.

    Short coincidental matches (chat-template tokens in unrelated tails) cost an op each as
    copies but nearly nothing when the model codes them, hence ``min_copy``.
    """
    c, m = _ids(centroid, "centroid"), _ids(member, "member")
    edits = []
    for tag, i1, i2, j1, j2 in _fold(_opcodes(c, m), max(1, min_copy)):
        if tag == "equal":
            edits.append(Edit(COPY, i2 - i1))
            continue
        if i2 > i1:
            edits.append(Edit(DELETE, i2 - i1))
        if j2 > j1:
            edits.append(Edit(INSERT, j2 - j1, tuple(m[j1:j2].tolist())))
    return edits


def apply_edits(edits: list[Edit], centroid: np.ndarray) -> np.ndarray:
    """The member the edits describe; they must consume the centroid exactly."""
    c, out, pos = _ids(centroid, "centroid"), [], 0
    for e in edits:
        if e.op == INSERT:
            out.append(np.asarray(e.tokens, np.int64))
        elif e.op in (COPY, DELETE) and pos + e.length <= len(c):
            if e.op == COPY:
                out.append(c[pos : pos + e.length])
            pos += e.length
        else:
            raise SeqkvError(f"edit {e.op} x{e.length} at centroid token {pos} does not fit it")
    if pos != len(c):
        raise SeqkvError(f"edits consume {pos} centroid tokens, the centroid has {len(c)}")
    return np.concatenate(out) if out else np.zeros(0, np.int64)


def _varint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


class _Reader:
    def __init__(self, buf: bytes, pos: int) -> None:
        self.buf, self.pos = buf, pos

    def varint(self, limit: int, what: str) -> int:
        n, shift = 0, 0
        while True:
            if self.pos >= len(self.buf) or shift > 63:
                raise SeqkvError(f"edit stream is corrupt: {what} runs past the stream")
            b = self.buf[self.pos]
            self.pos += 1
            n |= (b & 0x7F) << shift
            shift += 7
            if not b & 0x80:
                break
        if n > limit:
            raise SeqkvError(f"edit stream is corrupt: {what} {n} exceeds {limit}")
        return n

    def take(self, n: int) -> bytes:
        if self.pos + n > len(self.buf):
            raise SeqkvError("edit stream is truncated")
        self.pos += n
        return self.buf[self.pos - n : self.pos]


def _model_rows(model, member: np.ndarray, positions: list[int], precision_bits: int):
    """Frequency row of each position in ``positions``, conditioned on the member's prefix."""
    from seqkv_codecs.sequential import frequencies_from_logits
    from seqkv_codecs.sequential.logits_model import feed_checked

    wanted, rows = set(positions), {}
    if 0 in wanted:
        rows[0] = frequencies_from_logits(np.zeros(model.vocab_size, np.float32), precision_bits)
    if len(member) > 1 and wanted - {0}:
        state, last = model.start(len(member)), max(positions)
        for s in range(0, last, 256):
            logits = feed_checked(model, state, member[s : min(s + 256, last)])
            for p in range(s + 1, s + 1 + len(logits)):
                if p in wanted:
                    rows[p] = frequencies_from_logits(logits[p - s - 1], precision_bits)
    return [rows[p] for p in positions]


def encode_edits(
    edits: list[Edit], *, centroid=None, model=None, precision_bits: int = 24
) -> bytes:
    """Serialise ``edits``; with ``model`` (a `LogitsModel`) inserted tokens are range-coded.

    Given ``centroid``, the stream also carries the member's CRC, so decoding against the wrong
    centroid or model fails loudly instead of returning other tokens.
    """
    from seqkv_codecs.errors import CodecError
    from seqkv_codecs.sequential import RangeEncoder, encode_symbol

    if model is not None and centroid is None:
        raise SeqkvError("coding inserted tokens under a model needs the centroid tokens")
    n_centroid = sum(e.length for e in edits if e.op != INSERT)
    base = centroid if centroid is not None else np.zeros(n_centroid, np.int64)
    member = apply_edits(edits, base)
    flags = (_FLAG_MODEL if model is not None else 0) | (_FLAG_CRC if centroid is not None else 0)
    body = bytearray(MAGIC + bytes([VERSION, flags, precision_bits if model is not None else 0]))
    body += _varint(n_centroid) + _varint(len(member)) + _varint(len(edits))
    inserted, pos = [], 0
    for e in edits:
        body += _varint(e.length << 2 | _CODES.index(e.op))
        if e.op == INSERT:
            inserted += range(pos, pos + e.length)
            if model is None:
                body += b"".join(_varint(t) for t in e.tokens)
        pos += 0 if e.op == DELETE else e.length
    if model is not None:
        enc = RangeEncoder()
        try:
            for p, row in zip(
                inserted, _model_rows(model, member, inserted, precision_bits), strict=True
            ):
                encode_symbol(enc, row, int(member[p]), precision_bits)
        except CodecError as exc:
            raise SeqkvError(f"cannot code inserted tokens under the model: {exc}") from None
        payload = enc.finish()
        body += _varint(len(payload)) + payload
    if centroid is not None:
        body += struct.pack("<I", zlib.crc32(member.astype("<u4").tobytes()))
    return bytes(body) + struct.pack("<I", zlib.crc32(body))


def decode_edits(data: bytes, centroid: np.ndarray, *, model=None) -> np.ndarray:
    """The member's token ids from an edit stream and its centroid (and model, if it used one)."""
    from seqkv_codecs.errors import CodecError

    buf, c = bytes(data), _ids(centroid, "centroid")
    if len(buf) < 11 or buf[:4] != MAGIC:
        raise SeqkvError("not a seqkv edit stream (too short or wrong magic)")
    if zlib.crc32(buf[:-4]) != struct.unpack("<I", buf[-4:])[0]:
        raise SeqkvError("edit stream failed its CRC: the stream is damaged")
    version, flags, precision = buf[4], buf[5], buf[6]
    if version != VERSION or flags > 3 or (flags & _FLAG_MODEL and not flags & _FLAG_CRC):
        raise SeqkvError(f"edit stream version {version} / flags {flags} is not supported")
    r = _Reader(buf[:-4], 7)
    n_centroid = r.varint(_MAX_TOKENS, "centroid length")
    if n_centroid != len(c):
        raise SeqkvError(f"edit stream expects a {n_centroid}-token centroid, got {len(c)} tokens")
    n_member = r.varint(_MAX_TOKENS, "member length")
    edits = []
    for _ in range(r.varint(len(buf), "op count")):
        v = r.varint(_MAX_TOKENS << 2 | 3, "op")
        if v & 3 == 3:
            raise SeqkvError("edit stream is corrupt: unknown op code 3")
        op, n = _CODES[v & 3], v >> 2
        tokens = ()
        if op == INSERT and not flags & _FLAG_MODEL:
            tokens = tuple(r.varint((1 << 32) - 1, "token id") for _ in range(min(n, len(buf))))
        edits.append(Edit(op, n, tokens))
    payload = r.take(r.varint(len(buf), "payload length")) if flags & _FLAG_MODEL else b""
    crc = r.take(4) if flags & _FLAG_CRC else None
    if r.pos != len(r.buf):
        raise SeqkvError(f"edit stream has {len(r.buf) - r.pos} bytes of trailing data")
    if (
        sum(e.length for e in edits if e.op != DELETE) != n_member
        or sum(e.length for e in edits if e.op != INSERT) != n_centroid
    ):
        raise SeqkvError("edit stream is corrupt: its ops disagree with the lengths it states")
    if flags & _FLAG_MODEL:
        if model is None:
            raise SeqkvError("this edit stream codes inserted tokens under a model; pass model=")
        try:
            edits = _decode_inserted(edits, c, payload, model, precision)
        except CodecError as exc:
            raise SeqkvError(
                f"edit stream's inserted tokens do not decode (wrong centroid or model?): {exc}"
            ) from None
    elif any(len(e.tokens) != e.length for e in edits if e.op == INSERT):
        raise SeqkvError("edit stream is truncated inside an insert")
    member = apply_edits(edits, c)
    if (
        crc is not None
        and zlib.crc32(member.astype("<u4").tobytes()) != struct.unpack("<I", crc)[0]
    ):
        raise SeqkvError("decoded member fails its CRC: wrong centroid or model for this stream")
    return member


def _decode_inserted(edits, c, payload, model, precision):
    """Fill the inserts, stepping the model through the member as it is rebuilt."""
    from seqkv_codecs.sequential import RangeDecoder, decode_symbol, frequencies_from_logits
    from seqkv_codecs.sequential.logits_model import feed_checked

    dec, out, fed, pos, filled = RangeDecoder(payload), [], 0, 0, []
    state = model.start(sum(e.length for e in edits if e.op != DELETE))
    for e in edits:
        if e.op != INSERT:
            out += c[pos : pos + e.length].tolist() if e.op == COPY else []
            pos += e.length
            filled.append(e)
            continue
        for _ in range(e.length):
            if out:
                logits = feed_checked(model, state, np.asarray(out[fed:], np.int64))[-1]
                fed = len(out)
            else:
                logits = np.zeros(model.vocab_size, np.float32)
            out.append(decode_symbol(dec, frequencies_from_logits(logits, precision), precision))
        filled.append(Edit(INSERT, e.length, tuple(out[-e.length :])))
    dec.finish_check()
    return filled


class Cluster(NamedTuple):
    """Sessions stored as deltas against one centroid (``members`` excludes it)."""

    centroid: str
    members: tuple[str, ...]


def _near_prefix(raw: list[tuple], max_edit_fraction: float) -> tuple[int, int]:
    """(member tokens, edited tokens) of the longest leading span aligned with few edits."""
    lead = raw[:1] if raw and raw[0][0] == "equal" else []  # an exact prefix, however short
    edited, best = 0, (0, 0)
    for tag, i1, i2, j1, j2 in lead + _fold(raw[len(lead) :], _ANCHOR):  # short matches: edits
        if tag != "equal":
            edited += max(i2 - i1, j2 - j1)
        elif edited <= max_edit_fraction * max(i2, j2):
            best = (j2, edited)
    return best


def near_prefix(
    centroid: np.ndarray, member: np.ndarray, *, max_edit_fraction: float = 0.05
) -> tuple[int, int]:
    """Length (in member tokens) of the leading span that aligns with at most that share of
    edited tokens, ending on an equal run of >= 8 tokens; and how many tokens it edits."""
    c, m = _ids(centroid, "centroid"), _ids(member, "member")
    return _near_prefix(_opcodes(c, m), max_edit_fraction)


def _delta_cost(ops: list[tuple], member_side: bool) -> int:
    """Inserted tokens + runs of the folded alignment: what a delta stores beyond copies."""
    edits = [o for o in ops if o[0] != "equal"]
    return len(ops) + sum((o[4] - o[3]) if member_side else (o[2] - o[1]) for o in edits)


SHINGLE = 8  # tokens per shingle: any linking pair shares one (an equal run is >= 8 tokens)
SHINGLE_SPAN = 4096  # leading tokens of a session that are shingled
MAX_CANDIDATES = 32  # partners aligned per session (the ones sharing the most shingles)
MAX_MEDOID_TRIALS = 8  # centroid candidates tried in a cluster larger than that


def _shingles(ids: np.ndarray) -> set[bytes]:
    lead = np.ascontiguousarray(ids[:SHINGLE_SPAN], dtype="<i8")
    return {lead[i : i + SHINGLE].tobytes() for i in range(max(0, len(lead) - SHINGLE + 1))}


def candidate_pairs(ids: dict[str, np.ndarray]) -> list[tuple[str, str]]:
    """Pairs that can link: they share a shingle; at most MAX_CANDIDATES partners each.

    A linking pair always shares an 8-token shingle (its aligned span ends on an equal run of
    >= 8 tokens, or is an exact prefix of >= min_prefix tokens), so with few partners per
    session this finds every pair the all-pairs loop found; beyond that it keeps the partners
    that share the most shingles. Cost: O(total shingles) to index + O(n * MAX_CANDIDATES)
    alignments, instead of O(n^2) alignments.
    """
    names = sorted(ids)
    index: dict[bytes, list[int]] = {}
    for k, n in enumerate(names):
        for sh in _shingles(ids[n]):
            index.setdefault(sh, []).append(k)
    shared: list[dict[int, int]] = [{} for _ in names]
    for posting in index.values():
        if len(posting) > 4 * MAX_CANDIDATES:  # a shingle everyone has (a common prompt) says
            posting = posting[: 4 * MAX_CANDIDATES]  # little; keep the index bounded
        for a in posting:
            for b in posting:
                if a != b:
                    shared[a][b] = shared[a].get(b, 0) + 1
    pairs = set()
    for a, partners in enumerate(shared):
        best = sorted(partners, key=lambda b: (-partners[b], b))[:MAX_CANDIDATES]
        pairs.update((min(a, b), max(a, b)) for b in best)
    return [(names[a], names[b]) for a, b in sorted(pairs)]


def cluster(
    sessions: dict[str, np.ndarray],
    max_edit_fraction: float = 0.05,
    *,
    min_prefix: int = 32,
    min_copy: int = 8,
) -> list[Cluster]:
    """Group sessions whose leading ``min_prefix``+ tokens align with few edits; pick medoids.

    Two sessions link when `near_prefix` of the pair is at least ``min_prefix`` tokens; a
    cluster is a connected component (single linkage). Its centroid is the medoid: the session
    whose delta costs (inserted tokens + runs, summed over the others) are smallest, ties to
    the first name. Only `candidate_pairs` are aligned (O(n * 32) difflib runs); a cluster of
    more than 8 sessions tries its first 8 names as centroids (O(8 * size) more). Singletons
    come back as clusters without members.
    """
    if not 0 <= max_edit_fraction < 1:
        raise SeqkvError(f"max_edit_fraction must be in [0, 1), got {max_edit_fraction}")
    names = sorted(sessions)
    ids = {n: _ids(sessions[n], f"session {n!r}") for n in names}
    parent = {n: n for n in names}

    def root(n: str) -> str:
        while parent[n] != n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    cost: dict[tuple[str, str], int] = {}

    def align_pair(a: str, b: str) -> list[tuple]:
        raw = _opcodes(ids[a], ids[b])
        folded = _fold(raw, max(1, min_copy))
        cost[a, b], cost[b, a] = _delta_cost(folded, True), _delta_cost(folded, False)
        return raw

    for a, b in candidate_pairs(ids):
        if _near_prefix(align_pair(a, b), max_edit_fraction)[0] >= min_prefix:
            parent[root(b)] = root(a)
    groups: dict[str, list[str]] = {}
    for n in names:
        groups.setdefault(root(n), []).append(n)

    def total_cost(c: str, group: list[str]) -> int:
        for m in group:
            if m != c and (c, m) not in cost:
                align_pair(*sorted((c, m)))
        return sum(cost[c, m] for m in group if m != c)

    out = []
    for group in groups.values():
        trials = group if len(group) <= MAX_MEDOID_TRIALS else group[:MAX_MEDOID_TRIALS]
        medoid = min(trials, key=lambda c: total_cost(c, group))
        out.append(Cluster(medoid, tuple(m for m in group if m != medoid)))
    return sorted(out)


def common_prefix_len(a: np.ndarray, b: np.ndarray) -> int:
    """Tokens shared from the start: where an exact-prefix trie branches."""
    x, y = _ids(a, "a"), _ids(b, "b")
    n = min(len(x), len(y))
    diff = np.flatnonzero(x[:n] != y[:n])
    return int(diff[0]) if diff.size else n


def plt_distance(
    surprisal_bits: np.ndarray, common_prefix_len: int, *, first_token_bits: float = 0.0
) -> float:
    """d_T = -log2 P_M(common prefix): the bits a trie saves by storing that prefix once.

    ``surprisal_bits`` follows the capture layout: entry i is the cost of token i + 1 (the
    first token has none; pass ``first_token_bits``, e.g. log2 V, to count it).
    """
    s = np.asarray(surprisal_bits, dtype=np.float64)
    if s.ndim != 1 or not 0 <= common_prefix_len <= len(s) + 1:
        raise SeqkvError(
            f"common prefix of {common_prefix_len} tokens does not fit a session of "
            f"{len(s) + 1} tokens"
        )
    if common_prefix_len == 0:
        return 0.0
    return float(first_token_bits + s[: common_prefix_len - 1].sum())
