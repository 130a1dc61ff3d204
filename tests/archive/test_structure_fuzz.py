"""A structure-aware fuzzer: fields of real .skv files changed, every CRC signed again.

Bit flips (test_archive_fuzz.py) never get past the checksums; this fuzzer changes what a
crafted file would change (lengths, counts, varints, offsets, codec headers and configs,
ids, JSON shapes), re-signs everything (tests/forge.py) and holds the readers to:

* no traceback: every refusal is a SeqkvError or CodecError;
* no hang: each file is refused or restored within 10 s (SIGALRM);
* no unbounded allocation: the traced peak (tracemalloc: numpy and Python memory; every
  third mutation, since tracing triples the cost) stays under 4x the larger of what
  decoding the unchanged file takes and what the changed header declares, plus 2 MiB;
* no silently wrong output: a session that restores equals the unchanged file's restore,
  bit for bit (tokens, surprisal, every K/V tensor).

Budget: mutations over ten tiny archives (five per-vector codecs, flat and trie), seeded, so
a failure replays. The default run takes the first 1,000 of the sequence; the `slow` test
(bench/slow_tests.sh) all 5,000, 75-150 s on two busy CPU cores. SEQKV_FUZZ_MUTATIONS sets
the budget of both, SEQKV_FUZZ_REPORT=FILE writes every failure to FILE.
"""

from __future__ import annotations

import copy
import json
import math
import os
import random
import signal
import time
import traceback
import tracemalloc
import zlib

import pytest
import torch

from seqkv_cli.errors import SeqkvError
from seqkv_codecs.errors import CodecError
from tests.forge import put_together, read_tables, take_apart

ENV_MUTATIONS = os.environ.get("SEQKV_FUZZ_MUTATIONS")  # when set, the budget of both tests
DEFAULT_MUTATIONS = int(ENV_MUTATIONS or 1000)  # the default run
FULL_MUTATIONS = int(ENV_MUTATIONS or 5000)  # `slow`
SEED = 13
TRACE_EVERY = 3  # every third mutation runs under tracemalloc
HANG_S = 10
CODECS = ("raw", "lossless", "int8", "turbo3", "kivi2")
INTERESTING = (
    0,
    1,
    2,
    7,
    8,
    15,
    16,
    127,
    128,
    255,
    256,
    4095,
    8191,
    65535,
    65536,
    1 << 20,
    (1 << 31) - 1,
    1 << 31,
    (1 << 32) - 1,
    1 << 32,
    1 << 40,
    (1 << 63) - 1,
)
JSON_VALUES = (
    None,
    True,
    False,
    -1,
    0,
    1,
    2,
    1 << 20,
    1 << 40,
    1 << 64,
    0.5,
    1e300,
    "",
    "x",
    "../x",
    "a/b",
    "bf16",
    "fp32",
    "[/x]",
    "\x1b[2J",
    [],
    {},
    [0],
    {"id": "raw"},
)


class Hang(Exception):
    pass


def _alarm(signum, frame):
    raise Hang(f"no answer within {HANG_S} s")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """[(name, header, sections, baseline restore, baseline peak bytes)]."""
    from test_bounded_parsers import _capture

    from seqkv_cli.archive import compress_captures
    from seqkv_cli.kvcapture.capture_file import save_capture

    folder = tmp_path_factory.mktemp("structfuzz")
    first = _capture("s0", [5, 6, 7, 8, 9, 10, 11, 12], 0)
    second = _capture("s1", [5, 6, 7, 8, 20, 21], 1)
    for mine, theirs in ((second.keys, first.keys), (second.values, first.values)):
        for a, b in zip(mine, theirs, strict=True):
            a[:, :4] = b[:, :4]  # K/V depends on the prefix only, as in a real capture
    second.surprisal[:3] = first.surprisal[:3]
    caps = [folder / "s0.safetensors", folder / "s1.safetensors"]
    save_capture(first, caps[0])
    save_capture(second, caps[1])
    out = []
    for codec in CODECS:
        config = {"id": "kivi2", "group_size": 4, "residual": 2} if codec == "kivi2" else codec
        for layout in ("flat", "trie"):
            path = folder / f"{codec}-{layout}.skv"
            compress_captures(caps, path, codec=config, layout=layout)
            header, sections = take_apart(path)
            # the fuzz loop's memory budget reads this claim: it must read here (NoClaim if not)
            assert (_declared(header) > 0) == (layout == "flat"), (path.name, header)
            tracemalloc.start()
            baseline = _restore(path)
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
            assert all(not isinstance(r, Exception) for r in baseline), baseline
            out.append((f"{codec}-{layout}", header, sections, baseline, peak))
    return out


def _restore(path) -> list:
    from seqkv_cli.archive import Archive

    with Archive(path) as arc:
        results = [None] * len(arc.sessions)
        for entry, result in arc.restore_many(arc.sessions):
            results[arc.sessions.index(entry)] = result
        return results


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def _same(a, b) -> bool:
    def same_list(xs, ys):
        return len(xs) == len(ys) and all(
            x.dtype == y.dtype and _bits(x) == _bits(y) for x, y in zip(xs, ys, strict=True)
        )

    return (
        torch.equal(a.tokens.long(), b.tokens.long())
        and _bits(a.surprisal.double()) == _bits(b.surprisal.double())
        and same_list(a.keys, b.keys)
        and same_list(a.values, b.values)
    )


class NoClaim(Exception):
    """A header whose K/V claim cannot be read: a field missing, not a count, or past 16 GiB."""


def _declared(header) -> int:
    """Bytes of K/V the header's sessions claim (a trie file's header lists none). Raises
    NoClaim rather than answering 0, so that only a caller expecting broken headers (the
    fuzz loop) budgets without the claim; an unchanged file's header must always read."""
    try:
        claims = [
            (s["positions"], *(s["shapes"][k] for k in ("num_layers", "num_kv_heads", "head_dim")))
            for s in header["sessions"]
        ]
    except (KeyError, TypeError, IndexError) as exc:
        raise NoClaim(repr(exc)) from exc
    total = 0
    for fields in claims:
        if not all(type(f) is int and f >= 0 for f in fields):  # bool, float, str: no count
            raise NoClaim(f"not counts: {fields!r}")
        total += 8 * math.prod(fields)
    if total >= 1 << 34:
        raise NoClaim(f"{total} bytes")
    return total


# -- mutators: each changes one structural field and returns a description ------------------


def _paths(value, prefix=()):
    yield prefix
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _paths(v, (*prefix, i))


def mutate_header(rng, header, sections):
    path = rng.choice([p for p in _paths(header) if p])
    target = header
    for step in path[:-1]:
        target = target[step]
    old = target[path[-1]]
    if isinstance(old, int) and not isinstance(old, bool) and rng.random() < 0.5:
        new = old + rng.choice((-1, 1, -old - 1, old, 1 << 20))
    elif rng.random() < 0.1:
        new = copy.deepcopy(header["sessions"][0]) if header.get("sessions") else {}
    else:
        new = rng.choice(JSON_VALUES)
    target[path[-1]] = new
    return f"header {list(path)} = {str(new)[:40]}"


def _streams(header, sections):
    """(section name, offset of a codec stream inside it) of every per-vector block."""
    if "trie" not in header:
        return [(n, 0) for n in sections if "/layers." in n]
    out = []
    for name in sections:
        if name.endswith("/index"):
            seg = name.split("/")[0]
            at = 0
            for node in read_tables(sections[name]).nodes:
                for length in node.kv_lengths:
                    out.append((f"{seg}/kv", at))
                    at += length
    return out


# (offset, width) of the structural fields of each codec's stream: the 13-byte header, then
# the codec's own parameters (docs/format/CODEC_STREAMS.md). Payload bytes (scales, seeds,
# codes) are left alone: changed and re-signed, they decode to other values that no reader can
# tell.
HEADER_FIELDS = ((0, 2), (2, 1), (3, 1), (4, 1), (5, 2), (7, 4), (11, 2))
CODEC_FIELDS = {
    "raw": (),
    "lossless": (),
    "int8": ((13, 1),),
    "turbo3": ((13, 1), (14, 1)),
    "kivi2": ((13, 1), (16, 4), (20, 4)),  # not group_size: another one can fit the shapes
}


def mutate_stream(rng, header, sections):
    streams = _streams(header, sections)
    if not streams:
        return mutate_header(rng, header, sections)
    name, at = rng.choice(streams)
    offset, width = rng.choice(HEADER_FIELDS + CODEC_FIELDS[header["pipeline"][0]["id"]])
    data = bytearray(sections[name])
    if at + offset + width > len(data):
        return mutate_sections(rng, header, sections)
    value = rng.choice(INTERESTING) & ((1 << (8 * width)) - 1)
    data[at + offset : at + offset + width] = value.to_bytes(width, "little")
    sections[name] = bytes(data)
    return f"stream {name}@{at}+{offset} = {value}"


def mutate_tables(rng, header, sections):
    names = [n for n in sections if n.endswith("/index")]
    if not names:
        return mutate_header(rng, header, sections)
    name = rng.choice(names)
    tables = read_tables(sections[name])
    choice = rng.randrange(4)
    value = rng.choice(INTERESTING[:12]) if rng.random() < 0.7 else rng.choice(INTERESTING)
    if choice == 0:
        node = rng.choice(tables.nodes)
        field = rng.choice(("attach", "n_tokens", "payload", "check", "parent", "kv"))
        if field == "kv" and node.kv_lengths:
            lengths = list(node.kv_lengths)
            lengths[rng.randrange(len(lengths))] = value
            node.kv_lengths = tuple(lengths)
        elif field == "parent":
            node.parent = rng.choice((-1, 0, 1, 2))
        elif field == "check":
            node.check = value & 0xFFFF
        else:
            setattr(node, field if field != "kv" else "n_tokens", value)
        what = f"node {field} = {value}"
    elif choice == 1:
        rec = rng.choice(tables.sessions)
        field = rng.choice(("end_node", "end", "profile", "log2_ppl_milli"))
        setattr(rec, field, value & 0xFFFF if field == "log2_ppl_milli" else value)
        what = f"session {field} = {value}"
    elif choice == 2:
        tables.kv_blocks = value
        for node in tables.nodes:
            node.kv_lengths = (node.kv_lengths + (0,) * value)[:value] if value < 64 else ()
        what = f"kv_blocks = {value}"
    else:
        return mutate_names(rng, header, sections)
    try:
        from seqkv_cli.trie.tables import FRESH, encode_tables

        sections[name] = encode_tables(tables, 0, FRESH) + (tables.tokens or b"")
    except (SeqkvError, OverflowError, IndexError, MemoryError):
        return mutate_raw_index(rng, header, sections)
    return f"tables {what}"


def mutate_raw_index(rng, header, sections):
    """One byte of the binary tables (before the names) replaced: varints change shape."""
    names = [n for n in sections if n.endswith("/index")]
    if not names:
        return mutate_header(rng, header, sections)
    name = rng.choice(names)
    data = bytearray(sections[name])
    at = rng.randrange(6, max(7, len(data) // 2))
    data[min(at, len(data) - 1)] = rng.choice((0x00, 0x01, 0x7F, 0x80, 0xFF))
    sections[name] = bytes(data)
    return f"index byte {at}"


def mutate_names(rng, header, sections):
    names = [n for n in sections if n.endswith("/index")]
    if not names:
        return mutate_header(rng, header, sections)
    name = rng.choice(names)
    tables = read_tables(sections[name])
    strings = {
        "profiles": tables.profiles,
        "sessions": [[r.id, r.extra] if r.extra else [r.id] for r in tables.sessions],
    }
    kind = rng.randrange(5)
    if kind == 0:
        strings["sessions"][0][0] = rng.choice(("", "s1", "../x", "a/b", "x" * 300, "[/x]"))
    elif kind == 1:
        depth = rng.choice((33, 1000, 50_000))
        strings["sessions"][0] = [
            "s0",
            json.loads("[" * min(depth, 900) + "]" * min(depth, 900)) if depth < 900 else {},
        ]
        if depth >= 900:
            raw = json.dumps(strings).replace("{}", "[" * depth + "]" * depth, 1)
            return _put_names(sections, name, tables, raw.encode(), f"names depth {depth}")
    elif kind == 2:
        path = rng.choice([p for p in _paths(strings) if p])
        target = strings
        for step in path[:-1]:
            target = target[step]
        target[path[-1]] = rng.choice(JSON_VALUES)
    elif kind == 3:
        return _put_names(sections, name, tables, b" " * (rng.choice((1, 20)) << 20), "bomb")
    else:
        strings["sessions"] = strings["sessions"][:-1]
    return _put_names(sections, name, tables, json.dumps(strings).encode(), f"names {kind}")


def _put_names(sections, name, tables, raw: bytes, what: str):
    from seqkv_cli.trie.tables import encode_tables

    good = encode_tables(tables, 0)
    packed = zlib.compress(raw, 9)
    old = good[-_names_length(good) :]
    head = bytearray(good[: len(good) - len(old)])
    value = len(packed)
    while value >= 0x80:
        head.append((value & 0x7F) | 0x80)
        value >>= 7
    head.append(value)
    sections[name] = bytes(head + packed)
    return what


def _names_length(table: bytes) -> int:
    """Bytes of the varint length plus the zlib'd names at the end of an encoded table."""
    for start in range(len(table) - 1, -1, -1):
        value, shift, pos = 0, 0, start
        while pos < len(table):
            byte = table[pos]
            value |= (byte & 0x7F) << shift
            pos += 1
            shift += 7
            if byte < 0x80:
                break
        if pos + value == len(table) and value and table[pos : pos + 1] == b"\x78":
            return len(table) - start
    raise AssertionError("no names in the table")


def mutate_sections(rng, header, sections):
    name = rng.choice(list(sections))
    kind = rng.randrange(4)
    if kind < 2 and name.count("/") > 1:
        kind += 2  # a trie session's own parts are optional: only their presence says so
    if kind == 0:
        del sections[name]
        return f"drop {name}"
    if kind == 1:
        data = sections.pop(name)
        sections[rng.choice(("s9/tokens", name + "x", "t2/index", "s0/layers.9.key"))] = data
        return f"rename {name}"
    if kind == 2:
        sections[name] = sections[name][: max(0, len(sections[name]) - rng.choice((1, 2, 4, 8)))]
        return f"truncate {name}"
    sections[name] = sections[name] + bytes(rng.choice((1, 4, 8)))
    return f"extend {name}"


MUTATORS = (
    mutate_header,
    mutate_stream,
    mutate_stream,
    mutate_tables,
    mutate_tables,
    mutate_raw_index,
    mutate_names,
    mutate_sections,
)


def _keep_header_consistent(header, sections):
    """Section lists in the header follow renamed/dropped sections half of the time."""
    sessions = header.get("sessions") if isinstance(header, dict) else None
    for s in sessions if isinstance(sessions, list) else []:
        if isinstance(s, dict) and isinstance(s.get("sections"), list):
            s["sections"] = [n for n in s["sections"] if isinstance(n, str) and n in sections]


# The default run fuzzes the first 1,000 mutations of the same seeded sequence; the full
# 5,000 (162 s in CI) run under `slow`. Both hold every mutation to the same checks.
def test_structure_aware_fuzz(corpus, tmp_path):
    fuzz(corpus, tmp_path, DEFAULT_MUTATIONS)


@pytest.mark.slow
def test_structure_aware_fuzz_full_budget(corpus, tmp_path):
    fuzz(corpus, tmp_path, FULL_MUTATIONS)


def fuzz(corpus, tmp_path, mutations: int) -> None:
    rng = random.Random(SEED)
    path = tmp_path / "mutated.skv"
    failures, outcomes = [], {"refused": 0, "identical": 0, "skipped": 0}
    old_handler = signal.signal(signal.SIGALRM, _alarm)
    started = time.perf_counter()
    try:
        for i in range(mutations):
            name, header0, sections0, baseline, base_peak = corpus[i % len(corpus)]
            header, sections = copy.deepcopy(header0), dict(sections0)
            what = rng.choice(MUTATORS)(rng, header, sections)
            if rng.random() < 0.5:
                _keep_header_consistent(header, sections)
            try:
                blob = put_together(header, sections)
            except (ValueError, TypeError, OverflowError, RecursionError):
                outcomes["skipped"] += 1  # not even JSON: the container fuzzer covers that
                continue
            path.write_bytes(blob)
            label = f"#{i} {name}: {what}"
            traced = i % TRACE_EVERY == 0  # tracemalloc triples a decode's cost: sample it
            if traced:
                tracemalloc.start()
            tick = time.perf_counter()
            signal.alarm(HANG_S)
            try:
                results = _restore(path)
            except (SeqkvError, CodecError):
                outcomes["refused"] += 1
                continue
            except Hang as exc:
                failures.append(f"{label}: hang ({exc})")
                continue
            except Exception:
                failures.append(f"{label}: traceback\n{traceback.format_exc(limit=4)}")
                continue
            finally:
                signal.alarm(0)
                if traced:
                    peak = tracemalloc.get_traced_memory()[1]
                    tracemalloc.stop()
                    try:
                        declared = _declared(header)
                    except NoClaim:
                        declared = 0  # the mutation broke the claim: it allows nothing more
                    budget = 4 * max(base_peak, declared) + (2 << 20)
                    if peak > budget:
                        failures.append(f"{label}: allocated {peak} B, budget {budget} B")
            elapsed = time.perf_counter() - tick
            if elapsed > HANG_S:
                failures.append(f"{label}: took {elapsed:.1f} s")
            for k, result in enumerate(results):
                if isinstance(result, (SeqkvError, CodecError)):
                    outcomes["refused"] += 1
                elif isinstance(result, Exception):
                    failures.append(f"{label}: session {k} failed with {result!r}")
                elif k >= len(baseline) or not _same(result, baseline[k]):
                    failures.append(f"{label}: session {k} restored silently different")
                else:
                    outcomes["identical"] += 1
    finally:
        signal.signal(signal.SIGALRM, old_handler)
    took = time.perf_counter() - started
    print(f"{mutations} mutations in {took:.1f} s: {outcomes}, {len(failures)} failures")
    if failures and os.environ.get("SEQKV_FUZZ_REPORT"):
        with open(os.environ["SEQKV_FUZZ_REPORT"], "w") as report:
            report.write("\n".join(failures))
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures[:30])
    assert outcomes["skipped"] < mutations // 10
