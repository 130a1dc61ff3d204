"""An agent's turns kept with its own cache (replay records, format 1.9): what each turn and
one session alone cost, compaction, old files appended in their own encoding, and what a
binary record still says when a replay does not reproduce."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

import seqkv_cli as seqkv
from conftest import token_ids
from seqkv_cli.container import open_container
from seqkv_cli.trie import load_trie

GOLDEN = Path(__file__).resolve().parents[1] / "golden"


def _same(a, b) -> None:
    for i, (x, y) in enumerate(zip(a.layers, b.layers, strict=True)):
        assert torch.equal(x.keys, y.keys) and torch.equal(x.values, y.values), f"layer {i}"


def _tokens_bytes(path: Path) -> int:
    """Bytes of the newest segment's token stream."""
    with open_container(path) as reader:
        contents = load_trie(reader, path)
        return len(contents.embedded[max(contents.embedded)])


def _turns(model, path: Path, n: int):
    """`n` turns of the docs' agent loop (continue the loaded cache, generate, add); each
    turn's cache as generate left it, the per-turn (growth, coded tokens), and the last ids."""
    caches, costs, ids, last = [], [], token_ids(12), None
    for k in range(1, n + 1):
        with seqkv.open_archive(path, model=model) as arc:  # one open per turn, as after a restart
            cache = arc.load(last) if last else None
            with torch.inference_mode():
                out = model.generate(
                    ids,
                    past_key_values=cache,
                    max_new_tokens=4,
                    do_sample=False,
                    return_dict_in_generate=True,
                )
            report = arc.add(f"run/turn-{k}", out, prompt_length=ids.shape[1])
        assert report.kv_strategy == "replay"
        caches.append(out.past_key_values)
        costs.append((report.added_bytes, _tokens_bytes(path)))
        last = f"run/turn-{k}"
        ids = torch.cat([out.sequences, token_ids(6, seed=k)], 1)
    return caches, costs


@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated")
def test_a_turn_with_its_own_cache_costs_its_tokens_and_a_few_dozen_bytes(tmp_path, user_model):
    path = tmp_path / "agent.skv"
    caches, costs = _turns(user_model, path, 4)
    # one session alone: a compact archive whose table holds the record in binary
    growth, coded = costs[0]
    assert growth <= coded + 150
    # every later turn: its tokens, the index record and table, and a record of ~24 bytes
    # (the environment and the earlier calls inherited, 16 bytes of digest)
    for growth, coded in costs[2:]:
        assert growth - coded <= 72, costs
    with open_container(path) as reader:
        assert reader.version == (1, 9)
    with seqkv.open_archive(path, model=user_model) as arc:
        assert [s.restore for s in arc.sessions()] == ["replay"] * 4
        for k, cache in enumerate(caches, start=1):
            _same(cache, arc.load(f"run/turn-{k}"))
        assert arc.schedule("run/turn-2")[:5] == [12, 1, 1, 1, 7]  # generate's last token, then 6
        compacted = arc.compact()
        with open_container(path) as reader:
            assert reader.version == (1, 9) and reader.archive  # replay turns, compacted
        assert compacted <= sum(c for _, c in costs) + 4 * 40 + 256
        for k, cache in enumerate(caches, start=1):
            _same(cache, arc.load(f"run/turn-{k}"))


def test_one_session_with_its_own_cache_is_a_compact_archive(tmp_path, user_model):
    ids = token_ids(40)
    with torch.inference_mode():
        cache = user_model(ids, use_cache=True).past_key_values
    path = tmp_path / "one.skv"
    with seqkv.open_archive(path, model=user_model) as arc:
        report = arc.add("chat", ids, cache=cache)
        with open_container(path) as reader:
            assert reader.version == (1, 9) and reader.archive
            payload = reader.payload_bytes
        assert report.file_bytes <= payload + 150
        _same(cache, arc.load("chat"))
        arc.add("chat-2", torch.cat([ids, token_ids(5, seed=2)], 1))  # expanded, then appended
        _same(cache, arc.load("chat"))
        assert [s.restore for s in arc.sessions()] == ["replay", "canonical"]
    from cli_run import invoke

    listed = invoke("archive", "list", path)  # the CLI lists what the library does
    assert listed.exit_code == 0 and "replay" in listed.output and "canonical" in listed.output


def test_appending_to_a_format_1_7_file_keeps_its_json_records(tmp_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        GOLDEN / "seq-v1" / "model", dtype=torch.float32
    ).eval()
    path = tmp_path / "old.skv"
    shutil.copy(GOLDEN / "load-modes-v1" / "mixed-turns.skv", path)
    ids = token_ids(20, seed=9)
    with torch.inference_mode():
        cache = model(ids, use_cache=True).past_key_values
    with seqkv.open_archive(path, model=model) as arc:
        assert arc.add("own", ids, cache=cache).kv_strategy == "replay"
        _same(cache, arc.load("own"))
    with open_container(path) as reader:
        assert reader.version == (1, 7)
        table = reader.read_section(f"t{len(load_trie(reader, path).segments)}/index")
    assert table[0] & 0xC0 != 0xC0  # no binary records: a seqkv 0.7 still reads the file


def test_a_binary_record_still_says_what_differs(tmp_path, user_model, monkeypatch):
    import transformers

    ids = token_ids(16)
    with torch.inference_mode():
        cache = user_model(ids, use_cache=True).past_key_values
    path = tmp_path / "m.skv"
    with seqkv.open_archive(path, model=user_model) as arc:
        arc.add("a", ids, cache=cache)
        arc.add("b", torch.cat([ids, token_ids(4, seed=4)], 1), cache=None)
    real = transformers.__version__
    monkeypatch.setattr(transformers, "__version__", "0.0-other")
    with seqkv.open_archive(path, model=user_model) as arc:
        # the replay still reproduces here (the version is only a label): it is loaded ...
        _same(cache, arc.load("a"))
        rec = arc.sessions()[0]
        assert rec.restore == "replay"
    # ... and where it does not, the line names what differs, from the binary record
    from seqkv_cli.archive import Archive, entry_record, not_reproduced_message

    with Archive(path) as arc:
        record = entry_record(arc.session("a"))
    assert len(record["sha256"]) == 32  # 16 bytes kept
    line = not_reproduced_message("a", record, user_model, None)
    assert f"transformers {real} -> 0.0-other" in line and "\n" not in line
