"""Shard plans (scale/plan.py): a prefix key's sessions stay together, shards fill to a target."""

from __future__ import annotations

import pytest

from seqkv_cli.errors import SeqkvError
from seqkv_cli.scale.plan import KeyStats, plan_shards, prefix_key


def test_prefix_key_names_the_first_tokens_only():
    assert prefix_key([1, 2, 3, 4], 3) == prefix_key([1, 2, 3, 9, 9], 3)
    assert prefix_key([1, 2, 3], 3) != prefix_key([1, 2, 4], 3)
    assert len(prefix_key([5], 64)) == 16
    assert prefix_key([5], 64) != prefix_key([5, 0], 64)  # a shorter session is its own key


def test_small_keys_are_packed_and_never_split():
    stats = {
        "a": KeyStats(6, 600),
        "b": KeyStats(3, 300),
        "c": KeyStats(3, 300),
        "d": KeyStats(5, 50),
    }
    plan = plan_shards(stats, max_sessions=10, max_tokens=10_000)
    # largest first: a (6) + b (3) fill one shard; c (3) + d (5) the next
    assert plan.names_of["a"] == plan.names_of["b"] != plan.names_of["c"] == plan.names_of["d"]
    assert all(len(v) == 1 for v in plan.names_of.values())
    assert sorted(plan.sessions.values()) == [8, 9]


def test_a_key_larger_than_a_shard_is_split_evenly():
    plan = plan_shards({"big": KeyStats(25, 2500), "x": KeyStats(1, 10)}, max_sessions=10)
    names = plan.names_of["big"]
    assert len(names) == 3 and plan.names_of["x"][0] not in names
    placed = [plan.shard_of("big", f"s{i}") for i in range(300)]
    assert set(placed) == set(names)
    assert all(placed.count(n) > 60 for n in names)  # spread, not piled on one shard
    assert plan.shard_of("big", "s7") == plan.shard_of("big", "s7")


def test_token_target_splits_too():
    plan = plan_shards({"k": KeyStats(4, 4000)}, max_sessions=100, max_tokens=1000)
    assert len(plan.names_of["k"]) == 4


def test_same_counts_same_names_other_counts_other_names():
    stats = {"a": KeyStats(2, 20), "b": KeyStats(1, 5)}
    first = plan_shards(stats, max_sessions=2)
    assert plan_shards(dict(reversed(stats.items())), max_sessions=2).names_of == first.names_of
    other = plan_shards({"a": KeyStats(2, 21), "b": KeyStats(1, 5)}, max_sessions=2)
    assert other.names_of["a"] != first.names_of["a"]
    assert other.names_of["b"] == first.names_of["b"]
    assert all(n.startswith("shard-") and n.endswith(".skv") for n in first.sessions)


def test_bad_targets_and_unknown_keys():
    with pytest.raises(SeqkvError, match="shard targets must be at least 1"):
        plan_shards({"a": KeyStats(1, 1)}, max_sessions=0)
    with pytest.raises(SeqkvError, match="prefix key zz is not in the plan"):
        plan_shards({"a": KeyStats(1, 1)}).shard_of("zz", "s")
