"""Counting the canonical model passes a restore makes, for tests of the decode schedule."""

from __future__ import annotations

from seqkv_cli.sequential.adapter import CanonicalLogits


def counted(monkeypatch) -> list[int]:
    """Rows of every canonical model pass, in order (guessed tokens off: the schedule is
    what these tests check; tests/trie/test_drafts.py checks passes with guesses)."""
    monkeypatch.setenv("SEQKV_DRAFTS", "off")
    passes: list[int] = []
    real = CanonicalLogits.feed_rows
    monkeypatch.setattr(
        CanonicalLogits,
        "feed_rows",
        lambda self, tracks, ids: passes.append(len(tracks)) or real(self, tracks, ids),
    )
    return passes
