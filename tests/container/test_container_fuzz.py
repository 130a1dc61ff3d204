"""Damage real containers every way we can think of: every byte must be caught by a checksum.

Opening, verifying and reading all sections of a damaged file must raise a ContainerError
(never another exception, never wrong bytes). Files are kept small (~1 KB) so that the
superblock, the index records and the payloads each take thousands of hits.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from seqkv_cli.container import (
    ContainerError,
    NotAContainerError,
    TruncatedContainerError,
    append_sessions,
    open_container,
    write_container,
)
from seqkv_cli.container.format import SLOT_OFFSETS, Slot, crc32c, encode_preamble, encode_slot


def fuzz(examples: int) -> settings:
    """Fixed example counts keep the whole file under ~30 s on two shared cores."""
    return settings(
        max_examples=examples,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture],
    )


def session(sid: str, names: list[str]) -> dict[str, Any]:
    return {"id": sid, "positions": 3, "dtype": "float16", "shapes": [3, 64], "sections": names}


def build(directory: Path, appended: bool, tables: bool = True) -> bytes:
    """A small container with several sections; optionally grown by two appends.

    `tables` False: a format 1.1 file, whose index records are all JSON."""
    path = directory / f"base-{appended}-{tables}.skv"
    header = {
        "pipeline": [{"id": "raw"}],
        "model": {"fingerprint": "sha256:00ff"},
        "sessions": [session("s0", ["s0/tokens", "s0/k"]), session("s1", ["s1/v", "s1/e"])],
        "meta": {"note": "fuzz"},
    }
    sections = [
        ("s0/tokens", bytes(range(40))),
        ("s0/k", bytes(range(255, 55, -1))),
        ("s1/e", b""),
        ("s1/v", b"\x00" * 30),
    ]
    write_container(path, header, sections, tables=tables)
    if appended:
        append_sessions(path, [session("s2", ["s2/t"])], [("s2/t", b"appended" * 8)])
        append_sessions(path, [session("s3", ["s3/t", "s0/k"])], [("s3/t", b"\xff" * 16)])
    return path.read_bytes()


@pytest.fixture(scope="module", params=[False, True], ids=["one-segment", "three-segments"])
def original(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> bytes:
    return build(tmp_path_factory.mktemp("fuzz"), request.param)


@pytest.fixture(scope="module", params=[False, True], ids=["one-segment", "three-segments"])
def json_original(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> bytes:
    return build(tmp_path_factory.mktemp("fuzz"), request.param, tables=False)


@pytest.fixture(scope="module")
def victim(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("victim") / "damaged.skv"


def read_everything(path: Path) -> dict[str, bytes]:
    with open_container(path) as container:
        container.verify()
        return {e.name: container.read_section(e.name) for e in container.sections}


def put(path: Path, data: bytes) -> None:
    """Overwrite in place: truncating to zero first makes ext4 flush on close, 10x slower."""
    with open(path, "r+b" if path.exists() else "wb") as file:
        file.write(data)
        file.truncate()


def assert_refused(path: Path, data: bytes, what: str) -> None:
    put(path, data)
    try:
        read_everything(path)
    except ContainerError:
        return
    pytest.fail(f"damage went undetected: {what}")


def flip(data: bytes, bits: list[int]) -> bytes:
    damaged = bytearray(data)
    for bit in bits:
        damaged[bit // 8] ^= 1 << (bit % 8)
    return bytes(damaged)


def test_the_originals_read_back(original: bytes, victim: Path) -> None:
    put(victim, original)
    assert read_everything(victim)["s0/k"] == bytes(range(255, 55, -1))


def test_every_truncation_is_refused(original: bytes, victim: Path) -> None:
    for size in range(len(original)):
        put(victim, original[:size])
        with pytest.raises((NotAContainerError, TruncatedContainerError)):
            read_everything(victim)


def test_every_single_bit_flip_is_detected(original: bytes, victim: Path) -> None:
    for bit in range(len(original) * 8):
        assert_refused(victim, flip(original, [bit]), f"bit {bit}")


@fuzz(3000)
@given(data=st.data())
def test_random_multi_bit_flips_are_detected(
    original: bytes, victim: Path, data: st.DataObject
) -> None:
    region = data.draw(st.sampled_from(["anywhere", "superblock", "tail"]))
    low, high = {
        "anywhere": (0, len(original) * 8 - 1),
        "superblock": (0, SLOT_OFFSETS[1] * 8 + 255),
        "tail": (len(original) * 4, len(original) * 8 - 1),
    }[region]
    bits = data.draw(st.lists(st.integers(low, high), min_size=1, max_size=8, unique=True))
    assert_refused(victim, flip(original, bits), f"bits {bits}")


@fuzz(1500)
@given(cut=st.integers(0, 10**6), bits=st.lists(st.integers(0, 10**5), max_size=8, unique=True))
def test_truncation_plus_flips_is_refused(
    original: bytes, victim: Path, cut: int, bits: list[int]
) -> None:
    short = original[: cut % len(original)]
    damaged = flip(short, [b % (len(short) * 8) for b in bits]) if short else short
    assert_refused(victim, damaged, f"cut {cut % len(original)}, bits {bits}")


def with_newest_record(original: bytes, slot: Slot, raw: bytes) -> bytes:
    """`original` with its newest index record replaced by `raw` and its slot signed again."""
    forged = Slot(slot.number, slot.generation, slot.index_offset, len(raw), crc32c(raw))
    head = bytearray(original[: slot.index_offset] + raw)
    head[SLOT_OFFSETS[slot.number] : SLOT_OFFSETS[slot.number] + 32] = encode_slot(
        original[:16], forged
    )
    return bytes(head)


JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False)
    | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)  # fmt: skip


@fuzz(600)
@given(data=st.data())
def test_forged_index_records_with_valid_checksums_never_crash(
    json_original: bytes, victim: Path, data: st.DataObject
) -> None:
    """A crafted record passes the CRC, so only the parser stands between it and a crash."""
    original = json_original
    put(victim, original)
    with open_container(victim) as container:
        slot = container.slot
    record = json.loads(original[slot.index_offset :])
    key = data.draw(st.sampled_from(sorted(record)))
    path = data.draw(st.lists(st.integers(0, 5), max_size=3))
    target: Any = record
    for step in path:
        value = target[key]
        if isinstance(value, list) and value:
            target, key = value, step % len(value)
        elif isinstance(value, dict) and value:
            target, key = value, sorted(value)[step % len(value)]
    target[key] = data.draw(JSON)
    raw = json.dumps(record, ensure_ascii=data.draw(st.booleans())).encode()
    put(victim, with_newest_record(original, slot, raw))
    with contextlib.suppress(ContainerError):  # refusing is fine; any other exception is not
        read_everything(victim)


@fuzz(600)
@given(data=st.data())
def test_forged_binary_tables_with_valid_checksums_never_crash(
    original: bytes, victim: Path, data: st.DataObject
) -> None:
    """The newest record's table edited byte-wise (format 1.4), then signed again."""
    put(victim, original)
    with open_container(victim) as container:
        slot = container.slot
    raw = bytearray(original[slot.index_offset :])
    size = int.from_bytes(raw[:4], "little")
    table = raw[4 + size :]
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, len(table)))
        kind = data.draw(st.sampled_from(["set", "insert", "delete"]))
        if kind == "set" and at < len(table):
            table[at] = data.draw(st.integers(0, 255))
        elif kind == "insert":
            table[at:at] = data.draw(st.binary(min_size=1, max_size=6))
        else:
            del table[at : at + data.draw(st.integers(1, 6))]
    raw = bytes(raw[: 4 + size] + table)
    put(victim, with_newest_record(original, slot, raw))
    with contextlib.suppress(ContainerError):  # refusing is fine; any other exception is not
        read_everything(victim)


@fuzz(400)
@given(body=st.binary(max_size=400), valid_preamble=st.booleans())
def test_arbitrary_bytes_only_raise_container_errors(
    victim: Path, body: bytes, valid_preamble: bool
) -> None:
    prefix = encode_preamble() if valid_preamble else b""
    assert_refused(victim, prefix + body, f"{len(body)} random bytes")
