"""Session datasets (kvcapture/rows.py): JSONL and Parquet rows, read as a stream, checked."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from seqkv_cli.errors import SeqkvError
from seqkv_cli.kvcapture.rows import check_ids, iter_rows

ROWS = [
    {"id": "chat", "messages": [{"role": "user", "content": "hi"}]},
    {"id": "prose", "text": "Water flows downhill."},
    {"id": 17, "token_ids": [3, 1, 4, 1, 5]},
]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def write_parquet(path, rows):
    cols = {
        "id": pa.array([str(r["id"]) for r in rows]),
        "messages": pa.array(
            [r.get("messages") for r in rows],
            type=pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())])),
        ),
        "text": pa.array([r.get("text") for r in rows], type=pa.string()),
        "token_ids": pa.array([r.get("token_ids") for r in rows], type=pa.list_(pa.int64())),
    }
    pq.write_table(pa.table(cols), path)
    return path


@pytest.mark.parametrize("writer", [write_jsonl, write_parquet], ids=["jsonl", "parquet"])
def test_rows_of_every_kind(tmp_path, writer):
    suffix = ".jsonl" if writer is write_jsonl else ".parquet"
    rows = list(iter_rows(writer(tmp_path / f"d{suffix}", ROWS)))
    assert [r.id for r in rows] == ["chat", "prose", "17"]
    assert rows[0].messages == ({"role": "user", "content": "hi"},)
    assert rows[0].text is None and rows[0].token_ids is None
    assert rows[1].text == "Water flows downhill."
    assert rows[2].token_ids == (3, 1, 4, 1, 5)
    assert check_ids([tmp_path / f"d{suffix}"]) == 3


def test_jsonl_is_streamed_a_line_at_a_time(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(ROWS[1]) + "\n{broken\n", encoding="utf-8")
    rows = iter_rows(path)
    assert next(rows).id == "prose"  # the good row comes before the bad line is read
    with pytest.raises(SeqkvError, match=r"d.jsonl:2: malformed JSON"):
        next(rows)


def test_parquet_is_read_in_batches(tmp_path, monkeypatch):
    import seqkv_cli.kvcapture.rows as rows_mod

    monkeypatch.setattr(rows_mod, "PARQUET_BATCH", 2)
    many = [{"id": f"s{i}", "text": f"row {i}"} for i in range(7)]
    got = [r.id for r in iter_rows(write_parquet(tmp_path / "d.parquet", many))]
    assert got == [f"s{i}" for i in range(7)]


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        ([ROWS[1], {"text": "no id"}], r"d.jsonl:2: the row has no id"),
        (
            [ROWS[1], ROWS[1]],
            r"d.jsonl:2: session id 'prose' appears twice \(first at .*d.jsonl:1\)",
        ),
        ([{"id": "", "text": "x"}], r"d.jsonl:1: id must have 1 to 1024 characters"),
        ([{"id": "a\x1b[31m", "text": "x"}], r"d.jsonl:1: id 'a\\x1b\[31m' has control characters"),
        ([{"id": [1], "text": "x"}], r"d.jsonl:1: id must be a string or an integer, not list"),
        ([{"id": "a", "text": "   "}], r"d.jsonl:1: text must be a non-empty string"),
        ([{"id": "a", "token_ids": []}], r"d.jsonl:1: token_ids must be a non-empty list"),
        ([{"id": "a", "token_ids": [1, True]}], r"token_ids must be a non-empty list of integers"),
        ([], r"empty input: .*d.jsonl hold no sessions"),
    ],
)
def test_bad_rows_are_refused_naming_the_row(tmp_path, rows, message):
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    with pytest.raises(SeqkvError, match=message):
        check_ids([path])


def test_duplicate_ids_across_files_are_refused(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", [ROWS[1]])
    b = write_parquet(tmp_path / "b.parquet", [ROWS[1]])
    with pytest.raises(SeqkvError, match=r"b.parquet row 1: session id 'prose' appears twice"):
        check_ids([a, b])


def test_parquet_without_id_column_or_payload(tmp_path):
    pq.write_table(pa.table({"text": ["a"]}), tmp_path / "noid.parquet")
    with pytest.raises(SeqkvError, match=r"noid.parquet has no `id` column"):
        list(iter_rows(tmp_path / "noid.parquet"))
    assert [r.id for r in iter_rows(tmp_path / "noid.parquet", default_ids=True)] == ["noid-1"]
    pq.write_table(pa.table({"id": ["a"], "body": ["x"]}), tmp_path / "nobody.parquet")
    with pytest.raises(SeqkvError, match=r"has none of the columns messages, text, token_ids"):
        list(iter_rows(tmp_path / "nobody.parquet"))
    (tmp_path / "junk.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(SeqkvError, match=r"junk.parquet is not a readable Parquet file"):
        list(iter_rows(tmp_path / "junk.parquet"))
