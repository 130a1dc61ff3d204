"""Reliability, round 2 (issue 31): the surfaces added since the first hardening trust nothing
they read. One test per class of what an outside pass got through: each failed on the code
before the fix (a traceback, an exit 0 with a wrong file, or an abort) and is refused now in
one line, exit 2, with nothing written."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from cli_run import assert_error, invoke
from seqkv_cli.errors import SeqkvError
from seqkv_cli.llamacpp.transfer import default_layout

GOOD_LAYOUT = default_layout()  # llama.cpp's defaults: a sequence file, f16, one stream
# (stored llama.cpp layout, what the one error line must name)
HOSTILE_LAYOUTS = [
    ({}, "has no 'kind'"),
    ({**GOOD_LAYOUT, "k_type": "q4_0"}, "'k_type' is 'q4_0'"),
    ({**GOOD_LAYOUT, "n_stream": 10**6}, "'n_stream' is 1000000, outside 1..4096"),
    ({**GOOD_LAYOUT, "stream": 7}, "'stream' is 7, outside 0..0"),
    ({**GOOD_LAYOUT, "n_stream": "2"}, "'n_stream' is '2', not a whole number"),
    ({**GOOD_LAYOUT, "n_stream": True}, "'n_stream' is True, not a whole number"),
    ({**GOOD_LAYOUT, "seq_id": 1 << 40}, "'seq_id' is 1099511627776, outside"),
    ({**GOOD_LAYOUT, "kind": "session", "arch": "llämä"}, "is not a llama.cpp name"),
    ({**GOOD_LAYOUT, "kind": "session", "arch": 7}, "needs an arch name"),
    ({**GOOD_LAYOUT, "token_form": "server-v9"}, "'token_form' is 'server-v9'"),
    (5, "metadata is int, not the layout"),
]
TOKENS = [5 + (j * 7) % 200 for j in range(12)]


@pytest.fixture(scope="module")
def hostile_archive(tiny_model_dir, tmp_path_factory):
    """One session a hostile stored layout, plus one with none (llama.cpp's defaults)."""
    from seqkv_cli.api import open_archive

    path = tmp_path_factory.mktemp("round2") / "meta.skv"
    with open_archive(path, model=str(tiny_model_dir)) as arc:
        arc.add("plain", TOKENS)
        for i, (layout, _) in enumerate(HOSTILE_LAYOUTS):
            arc.add(f"h{i}", TOKENS, meta={"llama_state": layout})
    return path


@pytest.mark.parametrize("case", range(len(HOSTILE_LAYOUTS)))
def test_export_checks_the_stored_layout_before_writing(case, hostile_archive, tiny_model_dir):
    out = hostile_archive.parent / f"h{case}.bin"
    result = invoke(
        "export", "llama-state", hostile_archive, f"h{case}", "-o", out, "--model", tiny_model_dir
    )
    assert_error(result, HOSTILE_LAYOUTS[case][1])
    assert not out.exists()
    assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}")]


def test_export_options_repair_what_they_replace(hostile_archive, tiny_model_dir):
    """--cache-type replaces a stored unknown type: the file is written and reads back."""
    from seqkv_cli.llamacpp.state_file import parse_state

    case = next(
        i for i, (lay, _) in enumerate(HOSTILE_LAYOUTS) if lay == {**GOOD_LAYOUT, "k_type": "q4_0"}
    )
    out = hostile_archive.parent / "repaired.bin"
    result = invoke(
        "export", "llama-state", hostile_archive, f"h{case}", "-o", out,
        "--cache-type", "bf16", "--model", tiny_model_dir,
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    state = parse_state(out.read_bytes())
    assert state.tokens == TOKENS and state.layout()["k_type"] == "bf16"


def _capture_file(lm, folder: Path) -> Path:
    from seqkv_cli.kvcapture.capture_file import save_capture
    from seqkv_cli.kvcapture.engine import run_capture

    cap = run_capture(lm, TOKENS, dtype="bf16")
    cap.meta["session_id"] = "c"
    path = folder / "c.safetensors"
    save_capture(cap, path)
    return path


def test_every_output_file_option_refuses_a_directory(tmp_path, tiny_lm, tiny_model_dir):
    """-o EXISTING_DIR where a file is written: one line, exit 2 (the rename used to raise)."""
    capture = _capture_file(tiny_lm, tmp_path)
    archive = tmp_path / "a.skv"
    made = invoke("compress", capture, "-o", archive, "--model", tiny_model_dir)
    assert made.exit_code == 0, made.output
    state = tmp_path / "s.bin"
    done = invoke("export", "llama-state", archive, "c", "-o", state, "--model", tiny_model_dir)
    assert done.exit_code == 0, done.output
    folder = tmp_path / "a-directory"
    folder.mkdir()
    runs = [
        ("export", "llama-state", archive, "c", "-o", folder, "--model", tiny_model_dir),
        ("import", "llama-state", state, "-o", folder, "--model", tiny_model_dir),
        ("compress", capture, "-o", folder, "--model", tiny_model_dir),
        ("archive", "extract", archive, "c", "-o", folder, "--model", tiny_model_dir),
        ("report", archive, "--json", folder, "--model", tiny_model_dir),
    ]
    for args in runs:
        result = invoke(*args)
        assert_error(result, "is a directory; give a file name")
    assert list(folder.iterdir()) == []


def _compact_archive(tmp_path, lm, model_dir) -> Path:
    capture = _capture_file(lm, tmp_path)
    path = tmp_path / "one.skv"
    made = invoke("compress", capture, "-o", path, "--layout", "compact", "--model", model_dir)
    assert made.exit_code == 0, made.output
    return path


@pytest.mark.parametrize("field", ["num_layers", "num_kv_heads", "head_dim"])
def test_a_compact_header_contradicting_its_tensors_is_refused(
    field, tmp_path, tiny_lm, tiny_model_dir
):
    from seqkv_cli.container.compact import TOKENS_SECTION, encode_compact
    from seqkv_cli.container.compact_reader import CompactReader

    path = _compact_archive(tmp_path, tiny_lm, tiny_model_dir)
    reader = CompactReader(path)
    session, payload = reader.compact, reader.read_section(TOKENS_SECTION)
    reader.close()
    forged = replace(session, **{field: getattr(session, field) + 1})
    path.write_bytes(encode_compact(forged, payload))  # every CRC signed again
    out = tmp_path / "out"
    result = invoke("decompress", path, "-o", out, "--model", tiny_model_dir)
    assert_error(result, f"metadata says {field}={getattr(session, field) + 1}")
    assert not out.exists() or list(out.iterdir()) == []
    checked = invoke("verify", path, "--model", tiny_model_dir)
    assert checked.exit_code != 0 and "Traceback" not in checked.output


def test_a_trie_profile_contradicting_its_tensors_is_refused(tmp_path, tiny_lm, tiny_model_dir):
    from forge import put_together, read_tables, take_apart
    from seqkv_cli.trie.tables import FRESH, encode_tables

    capture = _capture_file(tiny_lm, tmp_path)
    path = tmp_path / "trie.skv"
    made = invoke("compress", capture, "-o", path, "--layout", "trie", "--model", tiny_model_dir)
    assert made.exit_code == 0, made.output
    header, sections = take_apart(path)
    name = next(n for n in sections if n.endswith("/index"))
    tables = read_tables(sections[name])
    tables.profiles[0]["shapes"]["num_kv_heads"] += 3
    sections[name] = encode_tables(tables, 0, FRESH) + (tables.tokens or b"")
    path.write_bytes(put_together(header, sections))
    out = tmp_path / "out"
    result = invoke("decompress", path, "-o", out, "--model", tiny_model_dir)
    assert_error(result, "metadata says num_kv_heads=")
    assert not out.exists() or list(out.iterdir()) == []


def test_the_one_capture_writer_refuses_what_its_reader_would(tmp_path, tiny_lm):
    from seqkv_cli.kvcapture.capture_file import load_capture, save_capture
    from seqkv_cli.kvcapture.engine import run_capture

    cap = run_capture(tiny_lm, TOKENS, dtype="bf16")
    cap.meta["num_layers"] = 9
    with pytest.raises(SeqkvError, match="metadata says num_layers=9, the tensors have 2"):
        save_capture(cap, tmp_path / "bad.safetensors")
    assert list(tmp_path.iterdir()) == []
    cap.meta["num_layers"] = 2
    save_capture(cap, tmp_path / "good.safetensors")
    assert load_capture(tmp_path / "good.safetensors").meta["num_layers"] == 2


@pytest.fixture(scope="module")
def sharded(tiny_lm, tmp_path_factory):
    from seqkv_cli.scale.common import DatasetOptions
    from seqkv_cli.scale.local import compress_dataset

    root = tmp_path_factory.mktemp("shards")
    rows = [{"id": f"s{i}", "token_ids": [5, 6, 7, 8 + i % 3, 20 + i]} for i in range(6)]
    data = root / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = root / "out"
    compress_dataset([data], out, tiny_lm, options=DatasetOptions(shard_sessions=3))
    return out


def _rewrite(src: Path, dst: Path, change) -> Path:
    from seqkv_cli.archive import MANIFEST_NAME

    dst.mkdir()
    for shard in src.glob("*.skv"):
        (dst / shard.name).write_bytes(shard.read_bytes())
    table = pq.read_table(src / MANIFEST_NAME)
    pq.write_table(
        change(table).replace_schema_metadata(table.schema.metadata), dst / MANIFEST_NAME
    )
    return dst


def _set(table, name, values):
    return table.set_column(table.column_names.index(name), name, values)


MANIFEST_ATTACKS = {
    "tokens as strings": (
        lambda t: _set(t, "tokens", pa.array([str(x) for x in t.column("tokens").to_pylist()])),
        "manifest column tokens holds string, not int64",
    ),
    "an id no shard holds": (
        lambda t: _set(
            t, "session_id", pa.array(["ghost", *t.column("session_id").to_pylist()[1:]])
        ),
        "lists session 'ghost' in",
    ),
    "wrong token counts": (
        lambda t: _set(t, "tokens", pa.array([999_999] * t.num_rows, pa.int64())),
        "has 999,999 tokens;",
    ),
    "a row left out": (lambda t: t.slice(1), "manifest.parquet does not list"),
    "empty cells": (
        lambda t: _set(t, "shard", pa.array([None] * t.num_rows, pa.string())),
        "manifest column shard has empty cells",
    ),
    "negative bytes": (
        lambda t: _set(t, "bytes", pa.array([-1] * t.num_rows, pa.int64())),
        "manifest column bytes holds -1, not a count",
    ),
}


@pytest.mark.parametrize("attack", sorted(MANIFEST_ATTACKS))
def test_a_manifest_is_checked_against_its_shards(attack, sharded, tmp_path):
    change, message = MANIFEST_ATTACKS[attack]
    bad = _rewrite(sharded, tmp_path / "bad", change)
    result = invoke("archive", "list", bad)
    assert_error(result, message)


def test_a_long_listing_is_plain_aligned_columns(sharded, monkeypatch):
    from seqkv_cli.archive import read_manifest
    from seqkv_cli.commands import archive

    man = read_manifest(sharded)
    monkeypatch.setattr(archive, "RICH_TABLE_ROWS", 2)
    result = invoke("archive", "list", sharded)
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert "as the manifest records them" in lines[0]
    assert lines[1].split() == ["id", "tokens", "own", "bytes", "shared", "prefix", "shard"]
    body = lines[3:]
    assert sorted(line.split()[0] for line in body) == sorted(man.rows["session_id"])
    assert len({len(line) for line in body}) == 1  # aligned


def test_a_huge_single_word_never_reaches_the_tokenizer(tmp_path, tiny_lm, tiny_model_dir):
    """30 MB of one word made the tokenizer allocate 1.4 GB and abort: the length is checked
    first (the tiny model: 512 positions of at most 12 characters each)."""
    from seqkv_cli.kvcapture.engine import SessionTooLong, check_text_length, max_token_chars

    assert max_token_chars(tiny_lm.tokenizer) == len("<|im_start|>")
    check_text_length(tiny_lm, "a" * 12_288, "ok")
    with pytest.raises(SessionTooLong, match="12,289 characters, at least 513 tokens"):
        check_text_length(tiny_lm, "a" * 12_289, "big")
    big = tmp_path / "big.txt"
    big.write_text("x" * 3_000_000)
    result = invoke("capture", big, "-o", tmp_path / "out", "--model", tiny_model_dir)
    assert_error(result, "3,000,000 characters")
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"id": "w", "messages": [{"role": "user", "content": "y" * 10**6}]}))
    result = invoke("capture", rows, "-o", tmp_path / "out2", "--model", tiny_model_dir)
    assert_error(result, "characters")


def test_a_row_past_the_byte_bound_is_refused_before_parsing(tmp_path):
    from seqkv_cli.kvcapture import rows as rows_module
    from seqkv_cli.kvcapture.rows import iter_rows

    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"id": "a", "text": "z" * 5000}) + "\n")
    rows_module_bound = rows_module.MAX_SESSION_BYTES
    try:
        rows_module.MAX_SESSION_BYTES = 4096
        with pytest.raises(SeqkvError, match=r"rows\.jsonl:1: a row of more than"):
            list(iter_rows(path))
    finally:
        rows_module.MAX_SESSION_BYTES = rows_module_bound
    assert [r.id for r in iter_rows(path)] == ["a"]


def _nan_state(lm, tokens, how: str) -> bytes:
    """A llama.cpp sequence state of the model's own recompute, with NaN put in: `all` K/V,
    or one NaN per layer."""
    from seqkv_cli.kvcapture.engine import run_capture
    from seqkv_cli.llamacpp.convert import from_capture_kv
    from seqkv_cli.llamacpp.state_file import write_state

    cap = run_capture(lm, tokens, dtype="fp32")
    keys, values = [k.half() for k in cap.keys], [v.half() for v in cap.values]
    for t in keys + values:
        if how == "all":
            t.fill_(float("nan"))
        else:
            t[0, -1, 0] = float("nan")
    return write_state(from_capture_kv(keys, values, tokens, GOOD_LAYOUT, True))


@pytest.mark.parametrize("how", ["all", "one per layer"])
def test_nan_kv_cannot_pass_the_other_model_guard(how, tmp_path, tiny_lm, tiny_model_dir):
    """A NaN distance used to skip its layer: all-NaN K/V were "0.0 % from the recompute"."""
    state = tmp_path / "nan.bin"
    state.write_bytes(_nan_state(tiny_lm, TOKENS, how))
    archive = tmp_path / "a.skv"
    result = invoke("import", "llama-state", state, "-o", archive, "--model", tiny_model_dir)
    assert_error(result, "a cache of another model?")
    assert not archive.exists()


def test_the_guard_limit_must_be_finite_and_positive(tmp_path, tiny_lm, tiny_model_dir):
    from seqkv_cli.api import open_archive
    from seqkv_cli.kvcapture.engine import run_capture

    cap = run_capture(tiny_lm, TOKENS, dtype="fp32")
    cache = tuple((k[None], v[None]) for k, v in zip(cap.keys, cap.values, strict=True))
    with open_archive(tmp_path / "a.skv", model=str(tiny_model_dir)) as arc:
        for limit in (float("nan"), float("inf"), 0.0, -1.0, "0.1", True):
            with pytest.raises(SeqkvError, match="max_relative_difference must be"):
                arc.add("s", TOKENS, cache, max_relative_difference=limit)
        nan_cache = tuple((k.clone().fill_(float("nan")), v) for k, v in cache)
        with pytest.raises(SeqkvError, match="a cache of another model"):
            arc.add("s", TOKENS, nan_cache, max_relative_difference=0.25)
        report = arc.add("s", TOKENS, cache, max_relative_difference=0.25)
        assert report.relative_difference == 0.0


def test_a_huge_dataset_row_is_skipped_and_counted_or_refused(tmp_path, tiny_lm):
    """A dataset row too long for the context by its characters alone is never tokenized:
    skipped and counted like any session past the context, or refused with --strict."""
    from seqkv_cli.archive import read_manifest
    from seqkv_cli.scale.common import DatasetOptions
    from seqkv_cli.scale.local import compress_dataset

    rows = tmp_path / "rows.jsonl"
    lines = [{"id": "small", "text": "a short session"}, {"id": "huge", "text": "w" * 2_000_000}]
    rows.write_text("".join(json.dumps(r) + "\n" for r in lines))
    result = compress_dataset([rows], tmp_path / "out", tiny_lm)
    assert result.sessions == 1 and result.too_long == 1
    assert list(read_manifest(tmp_path / "out").rows["session_id"]) == ["small"]
    with pytest.raises(SeqkvError, match=r"rows\.jsonl:2: 2,000,000 characters"):
        compress_dataset([rows], tmp_path / "strict", tiny_lm, options=DatasetOptions(strict=True))
