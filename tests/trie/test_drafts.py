"""Draft-and-verify decoding: guessed tokens ride in the pass, and not one decoded bit changes.

The decoder feeds the token it decoded plus guesses of the next ones (n-grams of what it has
decoded, codecs drafts.py); the stored stream decides every token. A right guess saves a
pass, a wrong one costs a row. What must hold: the restored capture is the captured one bit
for bit (tokens, surprisal, every K/V tensor), with guesses or without, on both numeric
paths; the forward gives a row the same bits however many tokens it carries; a rolled-back
guess leaves nothing behind.
"""

from __future__ import annotations

import pytest
import torch

from seqkv_cli.archive import Archive, compress_captures, same_capture
from seqkv_cli.kvcapture.api import capture
from seqkv_cli.kvcapture.capture_file import load_capture
from seqkv_cli.sequential.adapter import CanonicalLogits
from seqkv_codecs.sequential.drafts import MAX_DRAFT, DraftIndex, Stream

# The byte-level tiny tokenizer: one token per byte. Repeated phrases give the n-gram
# guesses something to find, as agent transcripts and code do.
ROOT = "Shared system prompt. " * 3
TEXTS = {
    "loop": ROOT + "for i in range(10): total += i\n" * 3,
    "tool": ROOT + 'call("search", query="kv cache")\nresult: ok\n' * 2,
    "prose": ROOT + "A quiet river ran past the mill, slow and brown in the late sun.",
}


def passes_of(monkeypatch) -> list[int]:
    """Token rows of every model pass (decoded tokens plus guesses), in order."""
    rows: list[int] = []
    single, drafts = CanonicalLogits.feed_rows, CanonicalLogits.feed_drafts

    def feed_rows(self, tracks, ids):
        rows.append(len(tracks))
        return single(self, tracks, ids)

    def feed_drafts(self, tracks, lists):
        out = drafts(self, tracks, lists)
        rows.append(sum(len(x) for x in out))
        return out

    monkeypatch.setattr(CanonicalLogits, "feed_rows", feed_rows)
    monkeypatch.setattr(CanonicalLogits, "feed_drafts", feed_drafts)
    return rows


@pytest.fixture(scope="module")
def archive(tiny_lm, tmp_path_factory):
    folder = tmp_path_factory.mktemp("drafts")
    for name, text in TEXTS.items():
        (folder / f"{name}.txt").write_text(text)
    inputs = sorted(str(p) for p in folder.glob("*.txt"))
    caps = [r.path for r in capture(inputs, model=tiny_lm, out=folder)]
    path = folder / "drafts.skv"
    compress_captures(caps, path, codec="seq", model=tiny_lm)
    return path, caps


def restore_all(path, lm, stats: list | None = None):
    """Every session of the archive restored, by id; the restore's DecodeStats appended to
    `stats` if given."""
    with Archive(path, model=lm) as arc:
        out = {e["id"]: r for e, r in arc.restore_many(arc.sessions)}
        if stats is not None:
            stats.append(arc.decode_stats)
    return out


def test_guesses_save_passes_and_the_restore_is_bit_exact(archive, tiny_lm, monkeypatch):
    path, caps = archive
    monkeypatch.setenv("SEQKV_DRAFTS", "off")
    rows_off = passes_of(monkeypatch)
    plain = restore_all(path, tiny_lm)
    monkeypatch.undo()
    rows_on = passes_of(monkeypatch)
    seen = []
    guessed = restore_all(path, tiny_lm, seen)
    [stats] = seen
    for p in caps:
        cap = load_capture(p)
        assert same_capture(cap, plain[cap.session_id])
        assert same_capture(cap, guessed[cap.session_id])
    assert stats.tokens == stats.total == sum(rows_off)  # every token once, in fewer passes
    assert stats.passes == len(rows_on) < len(rows_off)
    assert 0 < stats.accepted < stats.drafted
    assert stats.tokens_per_step > 1.2, stats
    assert max(rows_on) <= 16  # the row budget of one pass


def test_guesses_fit_the_state_at_the_end_of_the_context(tmp_path, monkeypatch):
    """A session filling the model context has no headroom for padded rows: guesses stop
    short of the end, and the restore is still exact."""
    from conftest import build_tiny_model
    from seqkv_cli.runtime.loading import load_model

    lm = load_model(str(build_tiny_model(tmp_path / "ctx64", context=64)))
    (tmp_path / "full.txt").write_text(("abcd" * 20)[:64])
    [cap] = capture([str(tmp_path / "full.txt")], model=lm, out=tmp_path)
    out = tmp_path / "full.skv"
    compress_captures([cap.path], out, codec="seq", model=lm)
    rows = passes_of(monkeypatch)
    [restored] = restore_all(out, lm).values()
    assert restored.positions == 64
    assert same_capture(load_capture(cap.path), restored)
    assert len(rows) < 63  # the repeats were guessed


@pytest.mark.parametrize("numerics", ["portable", "legacy"])
def test_a_row_gets_the_same_bits_however_many_tokens_it_carries(tiny_lm, numerics):
    """forward_many with rows of 1, 3 and 8 tokens (shorter rows padded) equals stepping
    each sequence alone; rolling a row back and feeding other tokens leaves no trace."""
    from seqkv_cli.kvcapture.engine import canonical_model
    from seqkv_cli.runtime.numerics import DEFAULT, LEGACY

    canon = canonical_model(tiny_lm, DEFAULT if numerics == "portable" else LEGACY)
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, canon.vocab_size, (40,), generator=gen) for _ in range(3)]
    alone = []
    for ids in seqs:
        state = canon.new_state(48)
        logits = torch.cat([canon.forward(state, ids[i : i + 1]) for i in range(len(ids))])
        alone.append((logits, state))
    states = [canon.new_state(48) for _ in seqs]
    for s, ids in zip(states, seqs, strict=True):
        canon.forward(s, ids[:20])
    wrong = [5, 6, 7, 8, 9, 10, 11]
    outs = canon.forward_many(states, [seqs[0][20:21], [int(seqs[1][20]), *wrong], seqs[2][20:28]])
    assert [len(o) for o in outs] == [1, 8, 8]
    assert [s.length for s in states] == [21, 28, 28]
    states[1].length = 21  # the guesses after position 20 were wrong: forget them
    rest = canon.forward_many(states, [seqs[0][21:40], seqs[1][21:40], seqs[2][28:40]])
    got = [
        torch.cat([outs[0], rest[0]]),
        torch.cat([outs[1][:1], rest[1]]),
        torch.cat([outs[2], rest[2]]),
    ]
    for (want, ref), logits, state, ids in zip(alone, got, states, seqs, strict=True):
        assert torch.equal(logits, want[20:])
        assert state.length == len(ids)
        for layer in range(canon.num_layers):
            for a, b in zip(state.layer_kv(layer), ref.layer_kv(layer), strict=True):
                assert torch.equal(a, b)


# -- the drafter alone --------------------------------------------------------------------


def confident() -> DraftIndex:
    """An index whose guesses have all been right so far: it guesses as far as it can."""
    index = DraftIndex()
    for n in range(1, 4):
        for _ in range(100):
            index.record(n, MAX_DRAFT, MAX_DRAFT)
    return index


def test_the_longest_earlier_ngram_gives_the_guess():
    index = confident()
    s = Stream()
    index.extend(s, [1, 2, 3, 4, 9, 2, 3, 5, 6, 1, 2, 3])
    guess, n = index.draft(s, 8)
    # "1 2 3" last seen at the start, followed by 4 9 2 3 5 ...; "2 3" alone would say 5
    assert n == 3 and guess[:2] == [4, 9]
    assert len(guess) <= MAX_DRAFT


def test_the_index_is_bounded(monkeypatch):
    from seqkv_codecs.sequential import drafts

    monkeypatch.setattr(drafts, "MAX_ENTRIES", 50)
    index, s = confident(), Stream()
    index.extend(s, range(1000))
    assert all(len(where) <= 50 for where in index._where)
    index.extend(s, [990, 991])
    assert index.draft(s, 3)[0] == [992, 993, 994]  # recent text is still found


def test_guesses_come_only_from_decoded_tokens_and_respect_the_limit():
    index = confident()
    s = Stream()
    index.extend(s, [7, 8, 9, 7, 8])
    guess, n = index.draft(s, 8)
    assert (guess, n) == ([9, 7, 8], 2)  # the continuation stops at what is decoded
    assert index.draft(s, 1)[0] == [9]
    assert index.draft(s, 0) == ([], 0)
    assert confident().draft(Stream(), 5) == ([], 0)


def test_sibling_streams_and_context_share_one_index():
    index = confident()
    a, b = Stream(context=[1, 2]), Stream(context=[1, 2])
    index.extend(a, [3, 4, 5, 6])
    guess, n = index.draft(b, 4)  # b's context "1 2" was followed by 3 in a
    assert guess[:1] == [3] and n == 2
    index.extend(b, [3, 4])
    assert index.draft(b, 2)[0] == [5, 6]  # "2 3 4" -> a's 5 6


def test_guess_length_follows_the_measured_acceptance():
    index = DraftIndex()
    s = Stream()
    index.extend(s, list(range(20)) * 2)
    full, n = index.draft(s, MAX_DRAFT)
    for _ in range(30):
        index.record(n, MAX_DRAFT, 0)  # the first guess always wrong
    short, _ = index.draft(s, MAX_DRAFT)
    assert len(short) < len(full)
    for _ in range(200):
        index.record(n, MAX_DRAFT, MAX_DRAFT)
    assert len(index.draft(s, MAX_DRAFT)[0]) == MAX_DRAFT
    assert index.accepted == 200 * MAX_DRAFT and index.proposed == 230 * MAX_DRAFT


def test_decompress_reports_tokens_as_they_decode(archive, tiny_lm, tmp_path):
    """What the CLI's progress bar shows: tokens decoded so far of the tokens to decode."""
    from seqkv_cli.archive import decompress

    path, caps = archive
    calls = []
    written = decompress(
        path, tmp_path / "out", model=tiny_lm, on_tokens=lambda *a: calls.append(a)
    )
    assert len(written) == len(caps) and len(calls) > 10
    totals = {total for _, total in calls}
    done = [d for d, _ in calls]
    assert len(totals) == 1 and done == sorted(done)
    # shared prefixes decode once: fewer tokens than the sessions' positions together
    positions = sum(load_capture(p).positions for p in caps)
    assert done[-1] == totals.pop() < positions
