"""A `.skv` file as sessions: create it, restore from it, add to it, compact, verify, list.

Every operation on an archive file is here, on top of the container format (sections, index,
atomic write and append: `seqkv_cli.container`) and the token trie (`seqkv_cli.trie`):

- **create** (create.py): captures, or token ids, into a new file. The codec's capabilities
  decide the layout: a trie of shared prefixes, a compact one-session file, or one set of
  sections per session (flat). Nothing is published before it restores.
- **restore** (restore.py, `Archive`): open a file, check its header and its model, and
  restore sessions through the path for its shape (restore_trie.py or restore_flat.py);
  `decompress` writes them back as capture files, all or nothing; `estimate_restore` says how
  long a restore takes here without doing it; `continue_from` resumes generation from one.
- **add** (add.py): new sessions become one more trie segment, appended under a lock;
  nothing committed is rewritten. **compact** (compaction.py): every session restored and
  written again as one trie.
- **verify** (verify.py): one check of a restored session against its capture, for every
  command and writer that verifies. **list** (listing.py): where a file's bytes go and what
  each session costs on its own.
- **manifest** (manifest.py): a directory of shard archives read as one.
- **a user's own cache** (user_cache.py, replay.py): what `open_archive(...).add` keeps of a
  cache (a replay record, a residual, or the recompute), and the replay that brings it back.
- **identity** (identity.py): which model a file belongs to and which seqkv wrote it.

This face is what the rest of seqkv uses (an import-linter contract).
"""

from seqkv_cli.archive.add import AddResult, add_captures, add_sources, appendable_codec
from seqkv_cli.archive.compaction import compact
from seqkv_cli.archive.create import (
    LAYOUTS,
    CompressResult,
    capture_and_code,
    codec_spec,
    compress_captures,
    compress_sources,
    memory_codec,
)
from seqkv_cli.archive.decompression import decompress
from seqkv_cli.archive.identity import (
    fingerprint_matches,
    load_canonical,
    model_identity,
    same_model,
    writer_version,
)
from seqkv_cli.archive.listing import Accounting, account, restore_kind, session_rows
from seqkv_cli.archive.manifest import (
    COLUMNS,
    CONTENT_KEY,
    MANIFEST_NAME,
    META_KEY,
    Manifest,
    manifest_file,
    read_manifest,
    token_digest,
    write_manifest,
)
from seqkv_cli.archive.replay import (
    Schedule,
    entry_record,
    not_reproduced_message,
    read_record,
    replay_schedule,
    reproduced,
    session_kv,
)
from seqkv_cli.archive.restore import SESSION_BATCH, Archive
from seqkv_cli.archive.restore_time import RestoreEstimate, estimate_restore
from seqkv_cli.archive.resume import continue_from
from seqkv_cli.archive.user_cache import (
    RESIDUAL_CHOICES,
    StoredKV,
    check_positive_number,
    coder_with_tolerance,
    kv_to_store,
    residual_to_use,
)
from seqkv_cli.archive.verify import (
    VERIFY_MODES,
    SessionCheck,
    attention_error,
    bit_equal,
    check_added,
    check_restored,
    check_session,
    check_sessions,
    check_verify_mode,
    kv_structure_problems,
    max_abs_error,
    restored_problems,
    same_capture,
    sessions_to_decode,
)

__all__ = [
    "COLUMNS",
    "CONTENT_KEY",
    "LAYOUTS",
    "MANIFEST_NAME",
    "META_KEY",
    "RESIDUAL_CHOICES",
    "SESSION_BATCH",
    "VERIFY_MODES",
    "Accounting",
    "AddResult",
    "Archive",
    "CompressResult",
    "Manifest",
    "RestoreEstimate",
    "Schedule",
    "SessionCheck",
    "StoredKV",
    "account",
    "add_captures",
    "add_sources",
    "appendable_codec",
    "attention_error",
    "bit_equal",
    "capture_and_code",
    "check_added",
    "check_positive_number",
    "check_restored",
    "check_session",
    "check_sessions",
    "check_verify_mode",
    "codec_spec",
    "coder_with_tolerance",
    "compact",
    "compress_captures",
    "compress_sources",
    "continue_from",
    "decompress",
    "entry_record",
    "estimate_restore",
    "fingerprint_matches",
    "kv_structure_problems",
    "kv_to_store",
    "load_canonical",
    "manifest_file",
    "max_abs_error",
    "memory_codec",
    "model_identity",
    "not_reproduced_message",
    "read_manifest",
    "read_record",
    "replay_schedule",
    "reproduced",
    "residual_to_use",
    "restore_kind",
    "restored_problems",
    "same_capture",
    "same_model",
    "session_kv",
    "session_rows",
    "sessions_to_decode",
    "token_digest",
    "write_manifest",
    "writer_version",
]
