"""The token trie: a prefix that several sessions share is stored, and computed, once.

Sessions go in as `Source`s (token ids up front, K/V loaded when their turn comes) and are
placed in a `Trie` of nodes: a session costs only the tokens no earlier session has at the
same prefix, and a branch may start inside its parent, so nodes are never split and an
archive grows by appending. What one commit adds is a *segment* (`build_segment` for a new
archive, `grow_segment` for one more on an archived trie, `segment_sections` for its parts):
node and session tables in binary (`encode_tables`), and the nodes' tokens, coded under the
model for `seq` (each node from a fork of its parent's state, so a shared prefix runs once)
or per-vector K/V blocks otherwise. A near-duplicate session is stored as an edit script of
another (`choose_members`, the `neardup` sub-package).

Reading: `load_trie` reads and cross-checks every segment's tables without decoding a token,
`session_entries` turns them into the session entries the archive hands out, and
`decode_sessions` restores sessions decoding only the nodes on their paths, rows of one model
pass in the order `trie.schedule` decides (`planned_passes` counts the same schedule for the
restore-time estimate). `session_costs` and `trie_shape` say who pays for which bytes.

This face is what the rest of seqkv uses (an import-linter contract: no module outside the
trie imports one of its modules). Writing, locking and publishing files is the archive's job
(`seqkv_cli.archive`); the byte layout is docs/FORMAT.md, "Trie archives".
"""

from seqkv_cli.trie.compact import compact_archive_form, compact_form, expanded
from seqkv_cli.trie.costs import session_costs, trie_shape
from seqkv_cli.trie.decode import DecodeStats, decode_sessions, node_steps
from seqkv_cli.trie.encode import SegmentBuild, refuse_empty
from seqkv_cli.trie.neardup import (
    COPY,
    DELETE,
    INSERT,
    Edit,
    align,
    cluster,
    common_prefix_len,
    decode_edits,
    encode_edits,
    near_prefix,
    plt_distance,
)
from seqkv_cli.trie.neardup_store import choose_members, restore_member
from seqkv_cli.trie.node_source import NodeSource, check_precision
from seqkv_cli.trie.oracle import WarmStates
from seqkv_cli.trie.pervector import restore_pervector
from seqkv_cli.trie.plan import Trie
from seqkv_cli.trie.replay_records import DIGEST_BYTES, MAX_RUNS
from seqkv_cli.trie.runs import fork_track
from seqkv_cli.trie.schedule import planned_passes
from seqkv_cli.trie.segment import (
    build_segment,
    grow_segment,
    index_sections,
    place_sessions,
    segment_sections,
)
from seqkv_cli.trie.sources import Source, ppl_milli
from seqkv_cli.trie.store import (
    MAX_POSITIONS,
    PartReader,
    TrieContents,
    archive_header,
    chain,
    check_context,
    load_trie,
    part_name,
    session_entries,
    session_part,
)
from seqkv_cli.trie.tables import (
    FRESH,
    MAX_JSON_DEPTH,
    NAMES_BYTES_PER_SESSION,
    TableContext,
    encode_tables,
    too_deep,
)

__all__ = [
    "COPY",
    "DELETE",
    "DIGEST_BYTES",
    "FRESH",
    "INSERT",
    "MAX_JSON_DEPTH",
    "MAX_POSITIONS",
    "MAX_RUNS",
    "NAMES_BYTES_PER_SESSION",
    "DecodeStats",
    "Edit",
    "NodeSource",
    "PartReader",
    "SegmentBuild",
    "Source",
    "TableContext",
    "Trie",
    "TrieContents",
    "WarmStates",
    "align",
    "archive_header",
    "build_segment",
    "chain",
    "check_context",
    "check_precision",
    "choose_members",
    "cluster",
    "common_prefix_len",
    "compact_archive_form",
    "compact_form",
    "decode_edits",
    "decode_sessions",
    "encode_edits",
    "encode_tables",
    "expanded",
    "fork_track",
    "grow_segment",
    "index_sections",
    "load_trie",
    "near_prefix",
    "node_steps",
    "part_name",
    "place_sessions",
    "planned_passes",
    "plt_distance",
    "ppl_milli",
    "refuse_empty",
    "restore_member",
    "restore_pervector",
    "segment_sections",
    "session_costs",
    "session_entries",
    "session_part",
    "too_deep",
    "trie_shape",
]
