"""Continuous batching in trie restore: a node that becomes ready takes a free row at the
next model pass instead of waiting for the nodes it was not batched with."""

from __future__ import annotations

import pytest

from passes import counted
from seqkv_cli.archive import Archive, compress_captures, same_capture
from seqkv_cli.errors import SeqkvError
from seqkv_cli.kvcapture.api import capture
from seqkv_cli.kvcapture.capture_file import load_capture
from seqkv_cli.trie.schedule import planned_passes

ROOT = "Shared system prompt. " * 3  # the byte-level tiny tokenizer: one token per byte


@pytest.fixture(scope="module")
def tree(tiny_lm, tmp_path_factory):
    """Nodes are never split: a1 is the root (96 tokens); b branches off it at 66 (60
    tokens of its own) and a2 at 76 (20 tokens)."""
    folder = tmp_path_factory.mktemp("batching")
    texts = {
        "a1": ROOT + "a" * 10 + "b" * 20,
        "a2": ROOT + "a" * 10 + "c" * 20,
        "b": ROOT + "d" * 60,
    }
    for name, text in texts.items():
        (folder / f"{name}.txt").write_text(text)
    caps = [
        r.path
        for r in capture(sorted(str(p) for p in folder.glob("*.txt")), model=tiny_lm, out=folder)
    ]
    path = folder / "tree.skv"
    compress_captures(caps, path, codec="seq", model=tiny_lm)
    with Archive(path) as arc:
        shape = [(n.parent, n.attach, n.n_tokens) for n in arc.trie.nodes]
    assert sorted(shape) == [(-1, 0, 96), (0, 66, 60), (0, 76, 20)]  # the tree meant here
    return path, caps


def test_children_start_where_they_branch_and_the_output_is_unchanged(tree, tiny_lm, monkeypatch):
    path, caps = tree
    with Archive(path, model=tiny_lm) as arc:
        passes = counted(monkeypatch)
        restored = {e["id"]: r for e, r in arc.restore_many(arc.sessions)}
    # b joins after the root's 66th token, a2 after its 76th: 126 passes where waiting for
    # the root to end would take 96 + 60
    assert passes == [1] * 66 + [2] * 10 + [3] * 20 + [1] * 30
    # the restore-time estimate replays this schedule on node lengths alone
    assert planned_passes(arc.trie, [0, 1, 2]) == (126, 96 + 60 + 20)
    assert planned_passes(arc.trie, [arc.session("a2")["index"]]) == (96, 96)
    for p in caps:
        cap = load_capture(p)
        assert same_capture(cap, restored[cap.session_id])


def test_a_full_batch_admits_waiting_nodes_as_rows_free_up(tree, tiny_lm, monkeypatch):
    from seqkv_cli.trie import schedule

    path, caps = tree
    monkeypatch.setattr(schedule, "LOCKSTEP", 1)  # one row: the nodes run one after another
    with Archive(path, model=tiny_lm) as arc:
        passes = counted(monkeypatch)
        restored = {e["id"]: r for e, r in arc.restore_many(arc.sessions)}
    assert passes == [1] * (96 + 60 + 20)
    assert planned_passes(arc.trie, [0, 1, 2]) == (len(passes), len(passes))
    for p in caps:
        cap = load_capture(p)
        assert same_capture(cap, restored[cap.session_id])


def test_a_child_that_ends_first_waits_for_its_parent_and_fails_with_it(tree, tiny_lm, monkeypatch):
    """The root's stream fails its end check after both children forked from it: their
    prefixes came from a stream that turned out damaged, so no session comes out whole."""
    from seqkv_codecs.errors import CodecError
    from seqkv_codecs.sequential.node_stream import NodeDecoder

    real = NodeDecoder.close

    def close(self):
        if self.n == 96:
            raise CodecError("flush check failed (simulated)")
        return real(self)

    monkeypatch.setattr(NodeDecoder, "close", close)
    path, _ = tree
    with Archive(path, model=tiny_lm) as arc:
        got = [(e["id"], r) for e, r in arc.restore_many(arc.sessions)]
    assert sorted(sid for sid, _ in got) == ["a1", "a2", "b"]
    for sid, result in got:
        assert isinstance(result, SeqkvError), sid
        assert "flush check failed (simulated)" in str(result)
    assert "its prefix could not be decoded" in str(dict(got)["b"])


def test_planned_passes_follow_a_crowded_restore(tiny_lm, tmp_path, monkeypatch):
    """24 sessions branching at many points of a shared prompt, more nodes than rows: the
    estimate's replay of the schedule gives the restore's own pass count."""
    import random

    rng = random.Random(5)
    folder = tmp_path / "crowd"
    folder.mkdir()
    for i in range(24):
        cut = rng.randrange(20, len(ROOT) * 2)
        tail = "".join(rng.choice("xyz ") for _ in range(rng.randrange(5, 40)))
        (folder / f"s{i:02d}.txt").write_text((ROOT * 2)[:cut] + tail)
    caps = [
        r.path
        for r in capture(sorted(str(p) for p in folder.glob("*.txt")), model=tiny_lm, out=folder)
    ]
    path = tmp_path / "crowd.skv"
    compress_captures(caps, path, codec="seq", model=tiny_lm, check=False)
    with Archive(path, model=tiny_lm) as arc:
        assert len(arc.trie.nodes) > 16
        passes = counted(monkeypatch)
        restored = {}
        for entry, result in arc.restore_many(arc.sessions):
            restored[entry["id"]] = result
        planned = planned_passes(arc.trie, list(range(len(arc.sessions))))
        assert planned == (len(passes), arc.decode_stats.tokens)
    for p in caps:
        cap = load_capture(p)
        assert same_capture(cap, restored[cap.session_id])


@pytest.mark.parametrize("load", ["small", "fast"])
def test_a_chain_restored_whole_keeps_no_state_of_a_node_it_has_left(tiny_lm, tmp_path, load):
    """An agent's turns (each a node continuing the last): restoring every turn must not keep
    every node's state (it did: 50 turns of the embedded model held 11 GB). The states alive
    at each yield stay bounded while the chain grows."""
    import gc
    import weakref

    import seqkv_cli as seqkv
    from seqkv_cli.trie import decode

    ids = list(range(40, 40 + 6 * 16))
    path = tmp_path / "chain.skv"
    with seqkv.open_archive(path, model=tiny_lm, load=load) as arc:
        for k in range(1, 7):
            arc.add(f"turn-{k}", ids[: 16 * k])
    runs: list[weakref.ref] = []  # a Run is a dataclass: unhashable, so no WeakSet
    real = decode.start_run

    def tracked(*args, **kwargs):
        run = real(*args, **kwargs)
        runs.append(weakref.ref(run))
        return run

    alive = []
    with Archive(path, model=tiny_lm) as arc, pytest.MonkeyPatch.context() as patch:
        patch.setattr(decode, "start_run", tracked)
        assert len(arc.trie.nodes) == 6
        for entry, restored in arc.restore_many(arc.sessions):
            assert restored.tokens.tolist() == ids[: restored.positions], entry["id"]
            del restored
            gc.collect()
            alive.append(sum(r() is not None for r in runs))
    assert len(alive) == 6 and max(alive) <= 2, alive
