"""Smoke test of the benchmark suite (`bench/suite/run.py --quick`'s cheapest parts), so it
cannot rot.

Everything runs on the tiny random model, at quick sizes: the numbers are not benchmarks,
but each section's code path runs end to end and its results must be self-consistent.
"""

from __future__ import annotations

import json
import math

import pytest

from bench.harness import append_markdown, environment, write_json
from bench.suite.common import Run


@pytest.fixture(scope="module")
def run(tiny_lm, tmp_path_factory) -> Run:
    return Run(tiny_lm, tmp_path_factory.mktemp("bench"), quick=True)


@pytest.fixture(scope="module")
def set_results(run):
    from bench.suite.inputs import capture_set

    return capture_set(run, max_tokens=32)


def test_rates_every_kind_of_codec(run, set_results):
    from bench.suite.inputs import save, slice_capture
    from bench.suite.rates import measure

    # different lengths: a trie archive restores sessions as they finish, not in file order
    caps = [slice_capture(r.capture, n) for r, n in zip(set_results, (32, 12, 24, 32), strict=True)]
    paths = [save(c, run.scratch("unequal")) for c in caps]
    raw, int8, seq = (measure(run, c, caps, paths) for c in ("raw", "int8", "seq"))
    assert raw["bit_exact"] and raw["max_abs_error"] == 0.0
    assert seq["bit_exact"] and seq["bits_per_position"] < int8["bits_per_position"]
    assert int8["bits_per_position"] < raw["bits_per_position"]
    assert not int8["bit_exact"] and 0 < int8["rel_l2_error"] < 0.05
    assert math.isfinite(int8["delta_log2_ppl"]) and int8["continuation_tokens"] > 0
    assert seq["positions"] == sum(c.positions for c in caps) == 100
    assert [s["id"] for s in seq["per_session"]] == [c.session_id for c in caps]


def test_sessions_prefix_reuse_is_exact_and_archives_scale(run):
    from bench.suite.archives import run_archives

    out = run_archives(run, points=(1, 3), decode=(3,), singles=2)
    assert out["prefix_reuse_bit_exact"]
    one, three = out["rows"]
    assert (one["sessions"], three["sessions"]) == (1, 3)
    assert three["positions"] == 3 * (out["prefix_tokens"] + out["tail_tokens"])
    assert three["decode_s"] > 0 and three["separate"].startswith("estimated")
    # the prefix is coded once: three sessions' tokens cost well under three times one's
    tokens = {r["sessions"]: r["token_bits_per_position"] * r["positions"] for r in (one, three)}
    assert tokens[3] < 2 * tokens[1]
    # (at these sizes, 80 tokens a session, three compact single-session files are smaller
    # than one trie archive with its ~900 bytes of tables and index: the full-size bench
    # compares them where prefixes are long)


def test_context_decode_clock(run):
    from bench.suite.context import run_context

    out = run_context(run)
    seq = [r for r in out["rows"] if r["codec"] == "seq"]
    assert [r["positions"] for r in seq] == list(out["lengths"])
    assert 0 < seq[0]["decode_s"] <= seq[-1]["decode_s"]


def test_profile_split_adds_up(run, set_results):
    from bench.suite.profile_seq import run_profile

    out = run_profile(run, set_results[0].path, set_results[0].capture.positions, False)
    split = out["runs"]["check_off"]
    assert 0 < split["model_share"] < 1
    assert sum(split["seconds"].values()) == pytest.approx(split["total_s"])


def test_memory_child_reports_its_own_peak():
    from bench.suite.memory import peak

    out = peak(["import"])
    assert 50 < out["peak_rss_MiB"] < 4096 and out["seconds"] >= 0


def test_gpu_check_dry_run_functions():
    from bench.gpu.check import entropy_crossover, entropy_identity, entropy_speed, tables
    from bench.gpu.tokens import TINY, DeviceRows, token_coder

    # no GPU and not the simulator: the kernel source on the CPU, and no speed to measure
    identity = entropy_identity(dry=True)
    assert identity["kernel"].startswith("kernel source on the CPU")
    assert identity["identical"] == identity["streams"] == 3 and identity["failures"] == []
    assert "skipped" in entropy_speed(True, 0.004) and "skipped" in entropy_crossover(True)
    assert all(t["identical"] for t in tables(DeviceRows(TINY, "cpu"), "cpu", 8))
    coder = token_coder(TINY, "cpu", sessions=3, tokens=6)
    assert coder["sessions_decoded_exactly"] == 3


def test_report_and_outputs(run, set_results, tmp_path):
    from bench.suite.report import render
    from bench.suite.run import parse_args
    from bench.suite.speed import run_speed

    speed = run_speed(run, set_results)
    assert speed["seq_decode_tokens_per_s_1_session"] > 0
    payload = {
        "command": "python -m bench.suite.run --quick",
        "quick": True,
        "environment": environment(run.lm),
        "inputs": [{"session": "x", "positions": 32}],
        "results": {"speed": speed},
    }
    text = render(payload)
    assert "### Speed against plain transformers and zstd" in text and "rans-numpy" in text
    write_json(tmp_path / "r.json", payload)
    assert json.loads((tmp_path / "r.json").read_text())["quick"] is True
    (tmp_path / "B.md").write_text("# Benchmarks\n\nold table\n")
    append_markdown(tmp_path / "B.md", text)
    assert (tmp_path / "B.md").read_text().startswith("# Benchmarks\n\nold table\n\n## Bench")
    with pytest.raises(SystemExit):
        parse_args(["--sections", "nope"])
    assert parse_args(["--quick", "--sessions", "1,3"]).sessions == (1, 3)
