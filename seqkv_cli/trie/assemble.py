"""A restored session as a Capture, from the run of the trie node it ends in."""

from __future__ import annotations

from seqkv_cli.errors import SeqkvError
from seqkv_cli.kvcapture.capture_file import DTYPES
from seqkv_cli.sequential.adapter import unrounded_kv
from seqkv_cli.sequential.session_codec import finish_capture
from seqkv_cli.trie.runs import session_kv
from seqkv_cli.trie.store import TrieContents


def session_capture(run, contents: TrieContents, s: int, entry: dict, read, canon):
    """Session `s` (its entry, its parts' reader) as a Capture from `run` (its end node's
    run, or the error that stopped it), or the SeqkvError that stops the session."""
    if isinstance(run, Exception):
        return SeqkvError(f"session {entry['id']}: {run}")
    rec = contents.sessions[s]
    try:
        keys, values, surprisal = session_kv(run, rec.end, DTYPES[entry["dtype"]], canon.num_layers)
        tokens = run.all_tokens(rec.end)
        # residuals resting on another session are applied once it is restored (skv/restore_trie.py)
        unrounded = unrounded_kv(run.track.state, run.start + rec.end)
        return finish_capture(
            entry, read, tokens, keys, values, surprisal, deferred={}, unrounded=unrounded
        )
    except SeqkvError as exc:
        return exc
