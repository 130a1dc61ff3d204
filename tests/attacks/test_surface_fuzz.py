"""The structure-aware fuzzer, extended to the surfaces added since the first hardening:
llama.cpp state files, session metadata (a stored llama.cpp layout, `add(meta=...)`), shard
manifests and dataset rows. Each fuzzer changes what a crafted input would change, seeded (a
failure replays), and holds the reader to:

* no traceback: every refusal is a SeqkvError;
* no hang: every input answered within 10 s (SIGALRM);
* no over-allocation: traced peak (tracemalloc, every third input) under 4x the input plus
  2 MiB; the tokenizer (Rust, untraced) never sees a text past the model's bound;
* no wrong output: what is accepted is what the input says (a state file writes back to the
  same bytes; an exported layout parses back to itself; a manifest's rows are its shards'
  sessions; metadata reads back equal), and no file is written that its reader refuses.

SEQKV_FUZZ_MUTATIONS sets the budget of each (default 2,000).
"""

from __future__ import annotations

import copy
import json
import os
import random
import signal
import struct
import traceback
import tracemalloc
import zlib
from dataclasses import replace

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from seqkv_cli.errors import SeqkvError

MUTATIONS = int(os.environ.get("SEQKV_FUZZ_MUTATIONS") or 2000)
HANG_S = 10
TRACE_EVERY = 3
INTERESTING = (0, 1, 2, 3, 7, 8, 255, 256, 4095, 4096, 4097, 65535, (1 << 31) - 1, 1 << 31,
               (1 << 32) - 1, -1, -(1 << 31))  # fmt: skip
JSON_VALUES = (None, True, False, -1, 0, 1, 2, 4096, 1 << 31, 1 << 40, 1 << 64, 0.5, 1e300,
               float("nan"), float("inf"), "", "x", "llama", "llämä", "f16", "bf16", "q4_0",
               "session", "sequence", "plain", "server-v1", "../x", "[/x]", "\x1b[2J", [], {},
               [0], {"a": 1})  # fmt: skip


def _label(value) -> str:
    try:
        return repr(value)[:120]
    except RecursionError:
        return "(nested past repr's depth)"


class Hang(Exception):
    pass


def _alarm(signum, frame):
    raise Hang(f"no answer within {HANG_S} s")


def run_fuzz(name: str, mutations: int, make_input, check) -> None:
    """Feed `mutations` inputs from `make_input(rng)` -> (label, input, size) to `check`,
    which raises SeqkvError to refuse, returns on acceptance (after checking the result),
    and raises AssertionError for a wrong output."""
    rng = random.Random(zlib.crc32(name.encode()))  # str hash() differs per process
    failures, outcomes = [], {"refused": 0, "accepted": 0}
    old = signal.signal(signal.SIGALRM, _alarm)
    try:
        for i in range(mutations):
            label, value, size = make_input(rng)
            traced = i % TRACE_EVERY == 0
            if traced:
                tracemalloc.start()
            signal.alarm(HANG_S)
            try:
                check(value)
                outcomes["accepted"] += 1
            except SeqkvError:
                outcomes["refused"] += 1
            except Hang as exc:
                failures.append(f"#{i} {label}: hang ({exc})")
            except AssertionError as exc:
                failures.append(f"#{i} {label}: wrong output: {exc}")
            except Exception:
                failures.append(f"#{i} {label}: traceback\n{traceback.format_exc(limit=4)}")
            finally:
                signal.alarm(0)
                if traced:
                    peak = tracemalloc.get_traced_memory()[1]
                    tracemalloc.stop()
                    if peak > 4 * size + (2 << 20):
                        failures.append(f"#{i} {label}: allocated {peak} B for {size} B")
    finally:
        signal.signal(signal.SIGALRM, old)
    print(f"{name}: {mutations} inputs, {outcomes}, {len(failures)} failures")
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures[:20])
    assert outcomes["refused"] > mutations // 20 and outcomes["accepted"] > mutations // 20


# -- llama.cpp state files ------------------------------------------------------------------


def _state(kind, form, v_trans, k_type, seed):
    from seqkv_cli.llamacpp.state_file import LayerKV, LlamaState

    rng = random.Random(seed)
    width, size, n = 8, {0: 4, 1: 2, 30: 2}[k_type], 5
    layers = []
    for _ in range(2):
        k = rng.randbytes(n * width * size)
        v = rng.randbytes(n * width * size)
        unit, w = (size, width) if v_trans else (width * size, 0)
        layers.append(LayerKV(k_type, width * size, k, k_type, unit, w, v))
    arch = "llama" if kind == "session" else None
    tokens = [rng.randrange(300) for _ in range(n)]
    return LlamaState(kind, tokens, form, arch, 1, 0, 0, v_trans, layers)


def _state_bases():
    from seqkv_cli.llamacpp.state_file import write_state

    return [
        write_state(_state(kind, form, v_trans, k_type, seed))
        for seed, (kind, form, v_trans, k_type) in enumerate(
            [("session", "plain", False, 1), ("sequence", "server-v1", True, 0),
             ("sequence", "plain", False, 30), ("session", "server-v1", True, 1)]
        )
    ]  # fmt: skip


def _mutate_state(rng, data: bytes) -> tuple[str, bytes]:
    out = bytearray(data)
    choice = rng.randrange(6)
    if choice == 0:  # one aligned u32 field set to an interesting value
        at = 4 * rng.randrange(len(out) // 4)
        value = rng.choice(INTERESTING) & 0xFFFFFFFF
        struct.pack_into("<I", out, at, value)
        return f"u32 at {at} = {value}", bytes(out)
    if choice == 1:  # a u64 (row sizes) anywhere
        at = rng.randrange(len(out) - 8)
        value = rng.choice((0, 1, 2, 16, 1 << 32, 1 << 62, (1 << 64) - 1))
        struct.pack_into("<Q", out, at, value)
        return f"u64 at {at} = {value}", bytes(out)
    if choice == 2:
        cut = rng.randrange(len(out))
        return f"truncated at {cut}", bytes(out[:cut])
    if choice == 3:
        at = rng.randrange(len(out))
        extra = rng.randbytes(rng.choice((1, 4, 8, 64)))
        return f"{len(extra)} bytes inserted at {at}", bytes(out[:at] + extra + out[at:])
    if choice == 4:  # the header fields: magic/version/token count/arch length
        at = rng.choice((0, 4, 8, 12, 16))
        value = rng.choice(INTERESTING) & 0xFFFFFFFF
        struct.pack_into("<I", out, at, value)
        return f"header u32 at {at} = {value}", bytes(out)
    at = rng.randrange(len(out))
    out[at] = rng.randrange(256)
    return f"byte at {at}", bytes(out)


def test_llama_state_files_fuzz():
    from types import SimpleNamespace

    from seqkv_cli.llamacpp.convert import to_capture_kv
    from seqkv_cli.llamacpp.state_file import parse_state, write_state
    from seqkv_cli.llamacpp.transfer import check_state_against_model

    bases = _state_bases()
    lm = SimpleNamespace(
        num_layers=2, vocab_size=300, max_context=64, name="tiny",
        config=SimpleNamespace(model_type="llama"),
    )  # fmt: skip

    def make(rng):
        label, data = _mutate_state(rng, rng.choice(bases))
        return label, data, len(data)

    def check(data):
        state = parse_state(data, "fuzzed")
        assert write_state(state) == data, "parsed, but writes back to other bytes"
        check_state_against_model(state, lm, "fuzzed")
        keys, values = to_capture_kv(state, 2, 4, True)
        assert all(t.shape == (2, state.cells, 4) for t in keys + values)

    run_fuzz("llama.cpp states", MUTATIONS, make, check)


# -- session metadata -----------------------------------------------------------------------


def _mutate_json(rng, value, depth=0):
    """A copy of `value` with one field replaced, removed or added somewhere inside it."""
    value = copy.deepcopy(value)
    if isinstance(value, dict) and value and rng.random() < 0.8:
        key = rng.choice(sorted(value, key=str))  # keys may be int and str
        what = rng.randrange(4)
        if what == 0:
            del value[key]
        elif what == 1 and depth < 3:
            value[key] = _mutate_json(rng, value[key], depth + 1)
        elif what == 2:
            value[rng.choice(("extra", "kind", "n_stream", 7, "é"))] = rng.choice(JSON_VALUES)
        else:
            value[key] = rng.choice(JSON_VALUES)
        return value
    if rng.random() < 0.1:  # deep nesting
        for _ in range(rng.choice((10, 40, 200, 5000))):
            value = {"x": value}
        return value
    return rng.choice(JSON_VALUES)


def test_stored_llama_layout_fuzz():
    """Layouts as any archive or `add(meta=...)` can store them: export either refuses in
    one line or writes a file that parses back to that very layout."""
    from seqkv_cli.llamacpp.convert import from_capture_kv
    from seqkv_cli.llamacpp.state_file import parse_state, write_state
    from seqkv_cli.llamacpp.transfer import default_layout, export_layout

    base = {**default_layout(), "sha256": "00" * 32, "file_bytes": 100}
    gen = torch.Generator().manual_seed(0)
    keys = [torch.randn(2, 3, 4, generator=gen) for _ in range(2)]
    values = [torch.randn(2, 3, 4, generator=gen) for _ in range(2)]

    def make(rng):
        stored = _mutate_json(rng, base) if rng.random() < 0.9 else rng.choice(JSON_VALUES)
        options = {
            "kind": rng.choice((None, None, "session", "sequence")),
            "flash_attn": rng.choice((None, True, False)),
            "cache_type": rng.choice((None, None, "f32", "f16", "bf16")),
        }
        return f"{_label(stored)} {options}", (stored, options), 4096

    def check(case):
        stored, options = case
        layout = export_layout(stored, "llama", "fuzzed", **options)
        data = write_state(from_capture_kv(keys, values, [1, 2, 3], layout, True))
        back = parse_state(data, "exported").layout()
        assert {k: v for k, v in back.items()} == {k: layout[k] for k in back}, "other layout"

    run_fuzz("stored layouts", MUTATIONS, make, check)


def test_user_metadata_fuzz(tiny_model_dir, tmp_path):
    """`add(meta=...)`: the check refuses in one line or keeps a JSON-equal copy; a sample
    goes through a real archive and reads back equal."""
    from seqkv_cli.api import check_meta, open_archive

    base = {"agent": "a", "turn": 3, "tags": {"k": "v", "n": {"deep": 1}}, "score": 0.5}
    accepted = []

    def make(rng):
        meta = _mutate_json(rng, base) if rng.random() < 0.9 else rng.choice(JSON_VALUES)
        return _label(meta), meta, 65536 * 4

    def check(meta):
        kept = check_meta(meta)
        assert kept == ({} if meta is None else meta), "kept other metadata than given"
        accepted.append(kept)

    run_fuzz("user metadata", MUTATIONS, make, check)
    # a sample of what was accepted, through a real archive: it reads back equal
    with open_archive(tmp_path / "meta.skv", model=str(tiny_model_dir)) as archive:
        for i, meta in enumerate(accepted[:: max(len(accepted) // 5, 1)][:5]):
            archive.add(f"s{i}", [5, 6, 7, 8], meta=meta)
            assert archive.meta(f"s{i}") == meta


# -- shard manifests ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def shards(tiny_lm, tmp_path_factory):
    from seqkv_cli.scale.common import DatasetOptions
    from seqkv_cli.scale.local import compress_dataset

    root = tmp_path_factory.mktemp("fuzz-shards")
    rows = [{"id": f"s{i}", "token_ids": [5, 6, 7 + i % 2, 20 + i]} for i in range(4)]
    data = root / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = root / "out"
    compress_dataset([data], out, tiny_lm, options=DatasetOptions(shard_sessions=2))
    return out


def _mutate_table(rng, table: pa.Table) -> tuple[str, pa.Table]:
    names = table.column_names
    name = rng.choice(names)
    column = table.column(name).to_pylist()
    what = rng.randrange(6)
    if what == 0:  # one cell
        column[rng.randrange(len(column))] = rng.choice((*JSON_VALUES[:13], *INTERESTING))
        try:
            array = pa.array(column, type=table.schema.field(name).type)
        except (pa.ArrowException, OverflowError, TypeError, ValueError):
            array = pa.array([str(c) for c in column])
        label = f"{name} cell changed"
    elif what == 1:  # the column's type
        array = pa.array([str(c) for c in column]) if rng.random() < 0.5 else pa.nulls(len(column))
        label = f"{name} retyped"
    elif what == 2:
        return "a row dropped", table.slice(1)
    elif what == 3:
        return "a row doubled", pa.concat_tables([table, table.slice(0, 1)])
    elif what == 4:
        return f"{name} dropped", table.drop_columns([name])
    else:  # the schema metadata's JSON
        try:  # an earlier mutation may have left it unreadable
            meta = json.loads(table.schema.metadata[b"seqkv_manifest"])
        except (ValueError, RecursionError):
            meta = {}
        meta = _mutate_json(rng, meta)
        try:
            raw = json.dumps(meta)
        except (TypeError, ValueError, RecursionError):
            raw = "{"
        return "metadata changed", table.replace_schema_metadata({b"seqkv_manifest": raw})
    return label, table.set_column(names.index(name), name, array)


def test_manifest_fuzz(shards, tmp_path):
    from seqkv_cli.archive import MANIFEST_NAME, Archive, read_manifest

    table = pq.read_table(shards / MANIFEST_NAME)
    truth = set()
    for shard in shards.glob("*.skv"):
        (tmp_path / shard.name).write_bytes(shard.read_bytes())
        with Archive(shard) as arc:
            truth |= {(shard.name, e["id"], e["positions"]) for e in arc.sessions}
    target = tmp_path / MANIFEST_NAME

    def make(rng):
        label, changed = _mutate_table(rng, table)
        if rng.random() < 0.2:
            label, changed = _mutate_table(rng, changed)
        if changed.schema.metadata is None or b"seqkv_manifest" not in changed.schema.metadata:
            changed = changed.replace_schema_metadata(table.schema.metadata)
        pq.write_table(changed, target)
        return label, None, target.stat().st_size * 8

    def check(_):
        man = read_manifest(tmp_path)
        listed = {(r.shard, r.session_id, r.tokens) for r in man.rows.itertuples()}
        assert listed == truth, f"the manifest lists {sorted(listed)}"

    run_fuzz("manifests", MUTATIONS, make, check)


# -- dataset rows ---------------------------------------------------------------------------


class _Watched:
    """The model's tokenizer, recording the longest text it was asked to tokenize."""

    def __init__(self, tok) -> None:
        self.tok, self.longest = tok, 0

    def __len__(self) -> int:
        return len(self.tok)

    def __call__(self, text, **kw):
        self.longest = max(self.longest, len(text))
        return self.tok(text, **kw)

    def __getattr__(self, name):
        return getattr(self.tok, name)


def _row(rng) -> tuple[str, bytes]:
    row = {"id": "r", "text": "hello there"}
    what = rng.randrange(7)
    if what == 0:
        row = {"id": rng.choice(JSON_VALUES), rng.choice(("text", "messages", "token_ids")):
               rng.choice(JSON_VALUES)}  # fmt: skip
    elif what == 1:  # one huge word, or many
        size = rng.choice((12_000, 12_289, 50_000, 400_000))
        row["text"] = rng.choice(("w", "word ", "é", "<|im_start|>")) * (size // 5 + 1)
    elif what == 2:
        content = "y" * rng.choice((10, 5000, 200_000))
        row = {"id": 1, "messages": [{"role": rng.choice(("user", 5, None)), "content": content}]}
    elif what == 3:
        row = {"id": "t", "token_ids": [rng.choice(INTERESTING) for _ in range(rng.randrange(9))]}
    elif what == 4:
        row = _mutate_json(rng, row)
    elif what == 5:  # bytes that are not JSON or not UTF-8
        raw = json.dumps(row).encode()
        at = rng.randrange(len(raw))
        return "raw bytes", raw[:at] + bytes([rng.choice((0x80, 0xFF, 0x22, 0x7B, 0x0A))]) + raw[
            at:
        ]
    else:
        row["id"] = rng.choice(("a\x1b[2J", "x" * 2000, "../../etc", "[/x]", "ok"))
    try:
        return _label(row), json.dumps(row).encode()
    except (ValueError, RecursionError):
        return "unencodable", b"{"


def test_dataset_rows_fuzz(tiny_lm, tmp_path):
    from seqkv_cli.kvcapture.engine import max_token_chars, tokenize
    from seqkv_cli.kvcapture.inputs import Document
    from seqkv_cli.kvcapture.rows import iter_rows

    watched = _Watched(tiny_lm.tokenizer)
    lm = replace(tiny_lm, tokenizer=watched)
    bound = 2 * max_token_chars(tiny_lm.tokenizer) * tiny_lm.max_context
    path = tmp_path / "rows.jsonl"

    def make(rng):
        label, line = _row(rng)
        path.write_bytes(line + b"\n")
        return label, None, 64 * len(line)

    def check(_):
        for row in iter_rows(path):
            doc = Document(row.id, row.where, row.text, row.messages, row.token_ids)
            ids = tokenize(lm, doc)
            if row.text is not None:
                assert ids == list(tiny_lm.tokenizer(row.text, add_special_tokens=False).input_ids)
            assert all(0 <= t < tiny_lm.vocab_size for t in ids)
        assert watched.longest <= bound, f"the tokenizer saw {watched.longest} characters"

    run_fuzz("dataset rows", MUTATIONS, make, check)
