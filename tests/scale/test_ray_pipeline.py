"""The sharded pipeline on a local Ray cluster (scale/ray_data.py): the same shards and
sessions as the serial run, a killed actor retried by Ray, progress reported."""

from __future__ import annotations

import pytest
from dataset_fixtures import chat_rows, write_jsonl
from test_sharded import restored_sessions, same_capture

from seqkv_cli.archive import read_manifest
from seqkv_cli.scale.common import DatasetOptions
from seqkv_cli.scale.local import compress_dataset

ray = pytest.importorskip("ray", reason="Ray Data is not installed (pip install 'seqkv[ray]')")


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    """Where the fault injected into the workers leaves a marker for each shard it killed."""
    return tmp_path_factory.mktemp("killed")


@pytest.fixture(scope="module")
def cluster(killed):
    markers = str(killed)

    def kill_the_first_build_of_shard_1() -> None:
        """Runs in every Ray worker as it starts (pickled by value: the workers cannot import
        this test module): the first worker to build shard-00001 dies hard, once, before
        writing anything, so Ray must restart the actor and retry the shard."""
        import os
        import signal
        from pathlib import Path

        from seqkv_cli.scale import shard

        build = shard.build_shard

        def build_or_die(target, name, *args, **kwargs):
            marker = Path(markers) / f".killed-{name}"
            if name.startswith("shard-00001") and not marker.exists():
                marker.write_text("killed once by the fault injected by the test\n")
                os.kill(os.getpid(), signal.SIGKILL)
            return build(target, name, *args, **kwargs)

        shard.build_shard = build_or_die

    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        configure_logging=False,
        runtime_env={"worker_process_setup_hook": kill_the_first_build_of_shard_1},
    )
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    rows = [*chat_rows(18, seed=2), {"id": "plain", "text": "A tower keeps water pressure up."}]
    return write_jsonl(tmp_path_factory.mktemp("rayds") / "sessions.jsonl", rows)


def run(dataset, out, lm_dir, lines=None):
    return compress_dataset(
        [dataset],
        out,
        str(lm_dir),
        options=DatasetOptions(shard_sessions=4),
        ray_address="auto",
        workers=2,
        cpus_per_worker=0.5,
        on_progress=None if lines is None else lines.append,
    )


def test_ray_shards_equal_the_serial_run_despite_a_killed_actor(
    cluster, killed, dataset, tiny_model_dir, tiny_lm, tmp_path
):
    lines: list[str] = []
    out = tmp_path / "killed-run"  # the injected fault kills the actor on shard-00001 once
    on_ray = run(dataset, out, tiny_model_dir, lines)
    assert len(list(killed.glob(".killed-*"))) == 1, "the injected fault did not fire once"
    serial = compress_dataset(
        [dataset], tmp_path / "serial", tiny_lm, options=DatasetOptions(shard_sessions=4)
    )
    a, b = read_manifest(out), read_manifest(tmp_path / "serial")
    assert on_ray.sessions == serial.sessions == 19 and on_ray.shards == serial.shards > 2
    assert [p.name for p in a.shards()] == [p.name for p in b.shards()]
    assert a.rows.drop(columns="bytes").equals(b.rows.drop(columns="bytes"))
    got, want = restored_sessions(a.shards(), tiny_lm), restored_sessions(b.shards(), tiny_lm)
    assert sorted(got) == sorted(want) and all(same_capture(got[k], want[k]) for k in got)
    assert on_ray.file_bytes == sum(p.stat().st_size for p in a.shards())
    assert not [p for p in out.iterdir() if p.suffix == ".tmp"]
    assert any(" shards (" in line and "sessions/s" in line for line in lines), lines
    again = run(dataset, out, tiny_model_dir)
    assert again.skipped_shards == again.shards and again.sessions == 19
    # an edit of one session to another of the same length: only its shard is rebuilt
    rows = [*chat_rows(18, seed=2), {"id": "plain", "text": "A tower keeps water pressure up."}]
    rows[3]["messages"][1]["content"] = rows[3]["messages"][1]["content"].upper()
    edited = write_jsonl(tmp_path / "edited.jsonl", rows)
    third = run(edited, out, tiny_model_dir)
    assert third.skipped_shards == third.shards - 1
    restored = restored_sessions([read_manifest(out).shard_of("chat-0003")], tiny_lm)
    text = tiny_lm.tokenizer.decode(restored["chat-0003"].tokens.tolist())
    assert rows[3]["messages"][1]["content"] in text


@pytest.mark.model
@pytest.mark.slow
def test_ray_on_the_embedded_model(cluster, embedded_lm, tmp_path):
    rows = chat_rows(4, seed=9)
    path = write_jsonl(tmp_path / "real.jsonl", rows)
    res = compress_dataset(
        [path],
        tmp_path / "out",
        None,
        options=DatasetOptions(shard_sessions=2),
        ray_address="auto",
        workers=1,
        cpus_per_worker=1,
    )
    man = read_manifest(tmp_path / "out")
    assert res.sessions == 4 and len(man.shards()) >= 2
    got = restored_sessions(man.shards(), embedded_lm)
    from seqkv_cli.kvcapture.engine import run_capture
    from seqkv_cli.kvcapture.rows import iter_rows
    from seqkv_cli.scale.common import tokenize_row

    for row in iter_rows(path):
        want = run_capture(embedded_lm, tokenize_row(embedded_lm, row), dtype="bf16")
        assert same_capture(got[row.id], want), row.id
