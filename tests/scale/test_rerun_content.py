"""Reruns keep a shard only when it holds provably what they would write (issue 37): the
same ids, lengths, token content (a digest per session) and settings (model, codec)."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from dataset_fixtures import write_jsonl

from seqkv_cli.archive import (
    COLUMNS,
    MANIFEST_NAME,
    META_KEY,
    Archive,
    read_manifest,
    token_digest,
)
from seqkv_cli.errors import SeqkvError
from seqkv_cli.scale.common import DatasetOptions
from seqkv_cli.scale.local import compress_dataset

# Six sessions, two a shard: the first ids differ at once (one prefix key each), so the plan
# is three shards, and an edit past --prefix-tokens keeps every shard name.
OPTIONS = DatasetOptions(shard_sessions=2, prefix_tokens=4)


def rows(edit: dict[str, int] | None = None) -> list[dict]:
    out = []
    for i in range(6):
        ids = [10 + i, *range(20, 34)]
        for position, value in (edit or {}).items() if f"s{i}" == "s2" else ():
            ids[position] = value
        out.append({"id": f"s{i}", "token_ids": ids})
    return out


def tokens_of(root, session_id, lm) -> list[int]:
    shard = read_manifest(root).shard_of(session_id)
    with Archive(shard, model=lm) as arc:
        return arc.restore(arc.session(session_id)).tokens.tolist()


@pytest.fixture
def first(tmp_path, tiny_lm):
    data = write_jsonl(tmp_path / "s.jsonl", rows())
    out = tmp_path / "shards"
    res = compress_dataset([data], out, tiny_lm, options=OPTIONS)
    assert res.shards == 3 and res.skipped_shards == 0
    return data, out


def test_an_edit_of_the_same_length_rewrites_only_its_shard(first, tiny_lm):
    data, out = first
    man = read_manifest(out)
    assert man.meta["version"] == 2 and man.meta["settings"]["model"] == tiny_lm.fingerprint
    by_id = man.rows.set_index("session_id")
    assert by_id.at["s2", "content"] == token_digest([12, *range(20, 34)])
    write_jsonl(data, rows(edit={10: 99}))  # position 10: past the 4-token prefix key
    again = compress_dataset([data], out, tiny_lm, options=OPTIONS)
    assert again.skipped_shards == 2 and again.shards == 3
    new = [12, *range(20, 34)]
    new[10] = 99
    assert tokens_of(out, "s2", tiny_lm) == new
    assert read_manifest(out).rows.set_index("session_id").at["s2", "content"] == token_digest(new)
    # and unchanged input keeps every shard
    assert compress_dataset([data], out, tiny_lm, options=OPTIONS).skipped_shards == 3


def test_another_codec_rewrites_every_shard(first, tiny_lm):
    data, out = first
    fast = DatasetOptions(shard_sessions=2, prefix_tokens=4, codec="seq-fast")
    again = compress_dataset([data], out, tiny_lm, options=fast)
    assert again.skipped_shards == 0
    assert read_manifest(out).meta["settings"]["codec"]["id"] == "seq-fast"
    with Archive(read_manifest(out).shard_of("s0")) as arc:
        assert arc.codec.codec_id == "seq-fast"


def test_shards_and_manifests_of_before_the_record_are_read_and_rebuilt(first, tiny_lm):
    """seqkv 0.5 wrote version 1 manifests and shards without a content record: still read,
    never taken as complete."""
    from seqkv_cli.api import compress_sessions

    data, out = first
    man = read_manifest(out)
    for shard in man.shards():  # the same shards, as 0.5 wrote them: no record
        ids = man.rows[man.rows["shard"] == shard.name]["session_id"]
        sessions = [(r["id"], r["token_ids"]) for r in rows() if r["id"] in set(ids)]
        compress_sessions(sessions, shard, tiny_lm, layout="trie")
    table = pq.read_table(out / MANIFEST_NAME).select(list(COLUMNS))
    meta = {"version": 1, "model": man.model}
    pq.write_table(table.replace_schema_metadata({META_KEY: json.dumps(meta)}), out / MANIFEST_NAME)
    old = read_manifest(out)
    assert old.meta["version"] == 1 and set(old.rows["content"]) == {""}
    assert len(old.rows) == 6
    again = compress_dataset([data], out, tiny_lm, options=OPTIONS)
    assert again.skipped_shards == 0
    assert read_manifest(out).meta["version"] == 2


def test_a_manifest_naming_other_content_than_its_shard_is_refused(first, tiny_lm, tmp_path):
    """A run killed after it rewrote a shard but before its manifest: the old manifest must
    not vouch for the new shard."""
    data, out = first
    before = pq.read_table(out / MANIFEST_NAME)
    write_jsonl(data, rows(edit={10: 99}))
    compress_dataset([data], out, tiny_lm, options=OPTIONS)
    pq.write_table(before, out / MANIFEST_NAME)  # the shard is new, the manifest is not
    with pytest.raises(SeqkvError, match=r"other content for session 's2'.*stale manifest"):
        read_manifest(out)
    bad = before.set_column(
        before.column_names.index("content"), "content", pa.array(["x"] * before.num_rows)
    )
    pq.write_table(bad, out / MANIFEST_NAME)
    with pytest.raises(SeqkvError, match="content holds a value that is no digest"):
        read_manifest(out)
