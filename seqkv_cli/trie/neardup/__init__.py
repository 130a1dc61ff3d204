"""Near-duplicate sessions as edit scripts of another session (`compress --near-dup`).

Exact-prefix sharing (the trie) stops at the first token two sessions differ in; a session
whose prompt differs from another's by a small edit ("You are a helpful …" / "You are an AI
…") would branch there and pay for the rest of the shared prompt again. This package stores
such a member as an edit script against a centroid session instead. Four jobs, one module
each, because each has a different reader:

- `alignment`: what a member shares with its centroid (copy/delete/insert runs), the one
  alignment both the clustering and the stored edits use;
- `clustering`: which sessions are members of which centroid (a search over a whole compress
  run, with its own cost bounds);
- `edits`: the ``SKND`` stream, a file format (docs/format/NEARDUP.md) and nothing else;
- `model`: inserted tokens range-coded under the model, the only part that runs one.

Where the stream sits in a trie archive is `trie.neardup_store`'s (the ``edits`` part).
"""

from seqkv_cli.trie.neardup.alignment import (
    COPY,
    DELETE,
    INSERT,
    Edit,
    align,
    apply_edits,
    common_prefix_len,
    token_ids,
)
from seqkv_cli.trie.neardup.clustering import Cluster, cluster, near_prefix, plt_distance
from seqkv_cli.trie.neardup.edits import decode_edits, encode_edits

__all__ = [
    "COPY",
    "DELETE",
    "INSERT",
    "Cluster",
    "Edit",
    "align",
    "apply_edits",
    "cluster",
    "common_prefix_len",
    "decode_edits",
    "encode_edits",
    "near_prefix",
    "plt_distance",
    "token_ids",
]
