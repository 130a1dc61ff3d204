"""The sharded pipeline without Ray (scale/local.py): shards by shared prefix, a manifest,
every session restored bit for bit, reruns that skip finished shards, bad input refused."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pyarrow.parquet as pq
import pytest
import torch
from dataset_fixtures import chat_rows, write_jsonl
from typer.testing import CliRunner

from seqkv_cli.archive import MANIFEST_NAME, Archive, read_manifest
from seqkv_cli.cli import app
from seqkv_cli.errors import SeqkvError
from seqkv_cli.scale.common import DatasetOptions
from seqkv_cli.scale.local import compress_dataset, compress_dataset_to_file

runner = CliRunner()


def restored_sessions(paths, lm) -> dict:
    out = {}
    for path in paths:
        with Archive(path, model=lm) as arc:
            for entry, cap in arc.restore_many(arc.sessions):
                assert not isinstance(cap, Exception), cap
                out[entry["id"]] = cap
    return out


def same_capture(a, b) -> bool:
    return (
        torch.equal(a.tokens, b.tokens)
        and all(
            torch.equal(x, y) for x, y in zip(a.keys + a.values, b.keys + b.values, strict=True)
        )
        and torch.equal(a.surprisal.double(), b.surprisal.double())
    )


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("ds")
    rows = chat_rows(30)
    rows.append({"id": "plain", "text": "A plain text session about water towers."})
    rows.append({"id": 99, "token_ids": [5, 6, 7, 8, 9, 10]})
    return write_jsonl(root / "sessions.jsonl", rows)


@pytest.fixture(scope="module")
def sharded(dataset, tiny_lm, tmp_path_factory):
    out = tmp_path_factory.mktemp("out") / "shards"
    lines = []
    res = compress_dataset(
        [dataset], out, tiny_lm, options=DatasetOptions(shard_sessions=8), on_progress=lines.append
    )
    return res, out, lines


def test_shards_keep_prefix_groups_and_restore_exactly(sharded, dataset, tiny_lm, tmp_path):
    res, out, lines = sharded
    assert res.sessions == 32 and res.shards == len(list(out.glob("shard-*.skv")))
    man = read_manifest(out)
    rows = man.rows.set_index("session_id")
    # one system prompt's chats (10 each, over 8 a shard) fill their own shards only
    for group in range(3):
        ids = [f"chat-{i:04d}" for i in range(group, 30, 3)]
        assert len(set(rows.loc[ids, "prefix_key"])) == 1
        other = set(rows.index) - set(ids)
        assert not set(rows.loc[ids, "shard"]) & set(rows.loc[list(other), "shard"])
    assert (rows.loc["chat-0003", "shared_prefix"]) > 20
    assert sum(man.rows["tokens"]) == res.tokens
    assert res.file_bytes == sum(p.stat().st_size for p in man.shards())
    assert lines[-1].startswith(f"{res.shards}/{res.shards} shards (0 already complete), 32 ")
    # every session equals the same session in one single archive, bit for bit
    single = compress_dataset_to_file([dataset], tmp_path / "one.skv", tiny_lm)
    assert single.sessions == 32
    a = restored_sessions(man.shards(), tiny_lm)
    b = restored_sessions([tmp_path / "one.skv"], tiny_lm)
    assert sorted(a) == sorted(b) == sorted(rows.index)
    assert all(same_capture(a[k], b[k]) for k in a)
    assert a["99"].tokens.tolist() == [5, 6, 7, 8, 9, 10]


def test_rerun_skips_complete_shards_and_rebuilds_a_lost_one(sharded, dataset, tiny_lm):
    res, out, _ = sharded
    shards = sorted(out.glob("shard-*.skv"))
    before = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in shards}
    shards[1].unlink()
    (out / ".shard-00000-dead.skv.somehost-1-x.staging").write_bytes(b"half")
    stale = out / "shard-09999-00000000.skv"
    stale.write_bytes(shards[0].read_bytes())
    again = compress_dataset([dataset], out, tiny_lm, options=DatasetOptions(shard_sessions=8))
    assert again.skipped_shards == res.shards - 1
    assert again.removed == [stale.name] and not stale.exists()
    for p in sorted(out.glob("shard-*.skv")):
        if p.name != shards[1].name:
            assert (p.stat().st_ino, p.stat().st_mtime_ns) == before[p.name]
    assert shards[1].is_file()
    assert read_manifest(out).rows.equals(read_manifest(out).rows)
    assert len(read_manifest(out).rows) == 32


def test_cli_list_extract_and_report_accept_the_manifest(sharded, tiny_model_dir, tmp_path):
    _, out, _ = sharded
    listed = runner.invoke(app, ["archive", "list", str(out / MANIFEST_NAME)])
    assert listed.exit_code == 0, listed.output
    assert "32 session(s) in" in listed.output and "chat-0007" in listed.output
    got = runner.invoke(
        app,
        [
            "archive",
            "extract",
            str(out),
            "chat-0007",
            "-o",
            str(tmp_path / "c.safetensors"),
            "--model",
            str(tiny_model_dir),
        ],
    )
    assert got.exit_code == 0, got.output
    missing = runner.invoke(
        app, ["archive", "extract", str(out), "nope", "-o", str(tmp_path / "n.safetensors")]
    )
    assert missing.exit_code == 2 and "has no session 'nope'" in missing.output
    from seqkv_cli.report.inputs import expand

    assert sorted(expand([out / MANIFEST_NAME])) == read_manifest(out).shards()


def test_manifest_refuses_hostile_or_mixed_content(sharded, tmp_path):
    import pyarrow as pa

    _, out, _ = sharded
    table = pq.read_table(out / MANIFEST_NAME)
    bad = tmp_path / "bad"
    bad.mkdir()
    col = table.column_names.index("shard")
    evil = table.set_column(col, "shard", pa.array(["../x.skv"] * table.num_rows))
    pq.write_table(evil.replace_schema_metadata(table.schema.metadata), bad / MANIFEST_NAME)
    with pytest.raises(SeqkvError, match=r"shard name '../x.skv' is not a .skv file name"):
        read_manifest(bad)
    pq.write_table(table.replace_schema_metadata({}), bad / MANIFEST_NAME)
    with pytest.raises(SeqkvError, match="not a seqkv shard manifest"):
        read_manifest(bad)
    # a shard of another model listed in the manifest
    other = tmp_path / "other"
    other.mkdir()
    for p in out.glob("shard-*.skv"):
        (other / p.name).write_bytes(p.read_bytes())
    meta = dict(table.schema.metadata)
    meta[b"seqkv_manifest"] = meta[b"seqkv_manifest"].replace(
        b'"fingerprint": "', b'"fingerprint": "00'
    )
    pq.write_table(table.replace_schema_metadata(meta), other / MANIFEST_NAME)
    with pytest.raises(SeqkvError, match="holds sessions of another model"):
        read_manifest(other)


def test_bad_input_is_refused_before_any_work(tmp_path, tiny_model_dir):
    dup = write_jsonl(tmp_path / "dup.jsonl", chat_rows(3) + chat_rows(1))
    r = runner.invoke(
        app, ["compress", str(dup), "-o", str(tmp_path / "o"), "--model", str(tiny_model_dir)]
    )
    assert r.exit_code == 2
    assert "dup.jsonl:4: session id 'chat-0000' appears twice" in r.output
    assert not (tmp_path / "o").exists()
    noid = write_jsonl(tmp_path / "noid.jsonl", [{"text": "x"}])
    r = runner.invoke(app, ["compress", str(noid), "-o", str(tmp_path / "o")])
    assert r.exit_code == 2 and "noid.jsonl:1: the row has no id" in r.output
    r = runner.invoke(app, ["compress", str(dup), str(tmp_path / "c.safetensors"), "-o", "x.skv"])
    assert r.exit_code == 2 and "not both" in r.output
    skv = tmp_path / "a.skv"
    skv.write_bytes(b"x")
    r = runner.invoke(app, ["compress", str(skv), "-o", str(tmp_path / "b.skv"), "--ray", "local"])
    assert r.exit_code == 2 and "--ray runs session datasets" in r.output


def test_too_long_sessions_are_counted_or_refused(tmp_path, tiny_lm):
    rows = [*chat_rows(2), {"id": "long", "token_ids": [1] * (tiny_lm.max_context + 1)}]
    path = write_jsonl(tmp_path / "long.jsonl", rows)
    res = compress_dataset([path], tmp_path / "o", tiny_lm)
    assert res.too_long == 1 and res.sessions == 2
    assert read_manifest(tmp_path / "o").meta["too_long_skipped"] == 1
    with pytest.raises(SeqkvError, match=r"long.jsonl:3: session 'long' has 513 tokens"):
        compress_dataset([path], tmp_path / "o2", tiny_lm, options=DatasetOptions(strict=True))
    assert not (tmp_path / "o2" / MANIFEST_NAME).exists()


def test_another_models_directory_is_refused(sharded, dataset, tmp_path):
    from conftest import build_tiny_model

    _, out, _ = sharded
    other = build_tiny_model(tmp_path / "other", seed=3)
    with pytest.raises(SeqkvError, match="holds shards of another model"):
        compress_dataset([dataset], out, str(other))


def test_a_killed_run_leaves_only_whole_shards_and_the_rerun_finishes(tmp_path, tiny_model_dir):
    path = write_jsonl(tmp_path / "s.jsonl", chat_rows(24, seed=5))
    out = tmp_path / "o"
    cmd = [
        sys.executable,
        "-c",
        "from seqkv_cli.cli import main; main()",
        "compress",
        str(path),
        "-o",
        str(out),
        "--model",
        str(tiny_model_dir),
        "--shard-sessions",
        "4",
        "--no-verify",
    ]
    env = dict(os.environ)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and len(list(out.glob("shard-*.skv"))) < 2:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done = sorted(out.glob("shard-*.skv"))
    assert len(done) >= 2 and not (out / MANIFEST_NAME).exists()
    for p in done:  # whatever was published is whole
        with Archive(p) as arc:
            assert len(arc.sessions) >= 1
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    man = read_manifest(out)
    assert len(man.rows) == 24
    assert f"({len(done)} already complete)" in r.stdout.replace("\n", " ")
    assert not [p for p in out.iterdir() if p.name.startswith(".")]


def test_an_unreachable_ray_address_is_one_line(dataset, tmp_path, tiny_model_dir):
    r = runner.invoke(
        app,
        [
            "compress",
            str(dataset),
            "-o",
            str(tmp_path / "o"),
            "--model",
            str(tiny_model_dir),
            "--ray",
            "127.0.0.1:1",
        ],
    )
    assert r.exit_code == 2
    assert (
        r.output.strip() == "error: cannot reach the Ray cluster at 127.0.0.1:1: Connection refused"
    )
    r = runner.invoke(app, ["compress", str(dataset), "-o", str(tmp_path / "o"), "--ray", "x"])
    assert r.exit_code == 2 and "give 'local', 'auto', HOST:PORT" in r.output
    r = runner.invoke(
        app, ["compress", str(dataset), "-o", str(tmp_path / "o.skv"), "--ray", "local"]
    )
    assert r.exit_code == 2 and "--ray writes shards into a directory" in r.output
