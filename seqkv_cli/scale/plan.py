"""Shard plans: sessions grouped by a prefix key so that a shared prefix stays in one trie.

The key of a session is a digest of its first N tokens (the templated system prompt and
few-shot block of a chat, typically). Every session of a key goes to the same shard unless
the key alone is larger than a shard, when it is split over as many shards as it needs (each
stores the prefix once). Keys smaller than a shard are packed together, largest first. The
plan depends only on the per-key counts, so a rerun over the same input plans the same shards
under the same names.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field

import numpy as np

from seqkv_cli.errors import SeqkvError

PREFIX_TOKENS = 64
SHARD_SESSIONS = 1000
SHARD_TOKENS = 2_000_000


def prefix_key(token_ids, n: int = PREFIX_TOKENS) -> str:
    """16 hex digits naming the first `n` tokens (all of them for a shorter session)."""
    head = np.asarray(token_ids[:n], dtype="<i4").tobytes()
    return hashlib.blake2b(head, digest_size=8).hexdigest()


@dataclass(frozen=True)
class KeyStats:
    sessions: int
    tokens: int


@dataclass
class ShardPlan:
    """Which shard(s) each prefix key goes to; `sessions`/`tokens`: the plan's totals per shard."""

    names_of: dict[str, list[str]]
    sessions: dict[str, int] = field(default_factory=dict)
    tokens: dict[str, int] = field(default_factory=dict)

    def shard_of(self, key: str, session_id: str) -> str:
        try:
            names = self.names_of[key]
        except KeyError:
            raise SeqkvError(
                f"session {session_id!r}: prefix key {key} is not in the plan"
            ) from None
        if len(names) == 1:
            return names[0]
        digest = hashlib.blake2b(session_id.encode("utf-8", "surrogatepass"), digest_size=8)
        return names[int.from_bytes(digest.digest(), "little") % len(names)]


def plan_shards(
    stats: dict[str, KeyStats],
    *,
    max_sessions: int = SHARD_SESSIONS,
    max_tokens: int = SHARD_TOKENS,
) -> ShardPlan:
    """Shards for keys with these counts (see the module note); names `shard-NNNNN-<digest>`,
    the digest covering the keys and counts the shard was planned for."""
    if max_sessions < 1 or max_tokens < 1:
        raise SeqkvError("shard targets must be at least 1 session and 1 token")
    order = sorted(stats, key=lambda k: (-stats[k].tokens, -stats[k].sessions, k))
    bins: list[list[str]] = []  # keys per shard (a split key: one key, several shards)
    splits: dict[int, int] = {}  # bin -> how many shards the key of a split bin needs
    room: list[tuple[int, int]] = []
    for key in order:
        s = stats[key]
        parts = max(math.ceil(s.sessions / max_sessions), math.ceil(s.tokens / max_tokens))
        if parts > 1:
            splits[len(bins)] = parts
            bins.append([key])
            room.append((0, 0))
            continue
        for i, (left_s, left_t) in enumerate(room):
            if i not in splits and s.sessions <= left_s and s.tokens <= left_t:
                bins[i].append(key)
                room[i] = (left_s - s.sessions, left_t - s.tokens)
                break
        else:
            bins.append([key])
            room.append((max_sessions - s.sessions, max_tokens - s.tokens))
    plan = ShardPlan({})
    number = 0
    for i, keys in enumerate(bins):
        parts = splits.get(i, 1)
        seal = hashlib.blake2b(digest_size=4)
        for key in sorted(keys):
            seal.update(f"{key}:{stats[key].sessions}:{stats[key].tokens};".encode())
        seal.update(f"parts={parts}".encode())
        names = [f"shard-{number + p:05d}-{seal.hexdigest()}.skv" for p in range(parts)]
        number += parts
        for key in keys:
            plan.names_of[key] = names
        for name in names:
            plan.sessions[name] = sum(stats[k].sessions for k in keys) // parts
            plan.tokens[name] = sum(stats[k].tokens for k in keys) // parts
    return plan
