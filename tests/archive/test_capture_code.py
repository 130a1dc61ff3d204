"""`seqkv pipeline` captures and codes in one walk of the model (archive/create.py): its
captures must be the files `seqkv capture` writes, bit for bit, and its archive must restore
them, also where sessions share a prefix (computed once) or one is a prefix of another."""

from __future__ import annotations

import json

import torch

from seqkv_cli.archive import Archive, capture_and_code
from seqkv_cli.kvcapture.api import capture, prepare_capture
from seqkv_cli.kvcapture.capture_file import load_capture


def _same(a, b) -> bool:
    pairs = [(a.tokens, b.tokens), (a.surprisal, b.surprisal)]
    pairs += list(zip(a.keys + a.values, b.keys + b.values, strict=True))
    return all(x.dtype == y.dtype and torch.equal(x, y) for x, y in pairs)


def test_one_walk_writes_what_capture_writes(tiny_lm, tmp_path):
    g = torch.Generator().manual_seed(3)
    prompt, tails = torch.randint(3, 250, (40,), generator=g).tolist(), []
    for n in (9, 30, 1):
        tails.append(torch.randint(3, 250, (n,), generator=g).tolist())
    sessions = {
        "a": prompt + tails[0],
        "b": prompt + tails[1],  # shares the prompt with a
        "c": prompt + tails[0] + tails[2],  # a is a prefix of c
        "d": prompt[:20],  # a prefix of all
        "e": tails[1],  # shares nothing
    }
    rows = tmp_path / "rows.jsonl"
    rows.write_text(
        "".join(json.dumps({"id": k, "token_ids": v}) + "\n" for k, v in sessions.items())
    )
    inputs = [str(rows)]
    lm, plan, targets = prepare_capture(inputs, model=tiny_lm, out=tmp_path / "caps", dtype="fp16")
    seq, walked = capture_and_code(lm, plan, targets, tmp_path / "seq.skv", dtype="fp16")
    alone = capture(inputs, model=tiny_lm, dtype="fp16")  # one forward per session
    assert [w.document.id for w in walked] == [a.document.id for a in alone]
    assert seq.positions == plan.total_tokens == sum(a.capture.positions for a in alone)
    for w, a in zip(walked, alone, strict=True):
        written = load_capture(w.path)
        assert _same(written, a.capture) and _same(w.capture, a.capture)
        meta = {k: v for k, v in written.meta.items() if k != "created"}
        assert meta == {k: v for k, v in a.capture.meta.items() if k != "created"}
    with Archive(tmp_path / "seq.skv", model=tiny_lm) as arc:
        by_id = {a.document.id: a.capture for a in alone}
        restored = 0
        for entry, cap in arc.restore_many(arc.sessions):
            assert _same(cap, by_id[entry["id"]])
            restored += 1
        assert restored == len(sessions)
