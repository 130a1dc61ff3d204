"""What `seqkv report` measures, checked against numbers known independently of it."""

from __future__ import annotations

import math
import struct
from pathlib import Path

import pandas as pd
import pytest

from seqkv_cli import load_capture
from seqkv_cli.archive import Archive, account

SAMPLE_DATA = Path(__file__).resolve().parents[2] / "sample_data"
REQUIRED = {
    "id",
    "codec",
    "positions",
    "bits_total",
    "bits_per_position",
    "log2_ppl",
    "breakdown",
    "exact",
    "max_abs_error",
}


def rows_by(doc: dict) -> dict[tuple[str, str], dict]:
    return {(r["id"], r["codec"]): r for r in doc["sessions"]}


def test_json_schema_and_known_numbers(full, caps, tiny_lm):
    _, _, doc = full
    assert doc["schema"] == "seqkv.report" and doc["schema_version"] == 1
    rows = rows_by(doc)
    assert set(rows) == {(s, c) for s in ("a", "b") for c in ("raw", "seq", "turbo3")}
    comps = 2 * tiny_lm.num_layers * tiny_lm.num_kv_heads * tiny_lm.head_dim
    for path in caps:
        cap = load_capture(path)
        n, sid = cap.positions, cap.session_id
        for codec in ("raw", "seq", "turbo3"):
            row = rows[(sid, codec)]
            assert set(row) >= REQUIRED and set(row["breakdown"]) >= {
                "tokens",
                "residual",
                "header",
                "trie",
            }
            assert row["positions"] == n and row["components_per_position"] == comps
            assert row["bits_total"] == pytest.approx(sum(row["breakdown"].values()))
            assert row["bits_per_position"] == pytest.approx(row["bits_total"] / n)
            assert row["log2_ppl"] == pytest.approx(float(cap.surprisal.mean()), abs=1e-5)
            assert row["gap_ratio"] == pytest.approx(row["bits_per_position"] / row["log2_ppl"])
            assert row["ratio_vs_fp16"] * row["bits_per_position"] == pytest.approx(16 * comps)
            assert row["ratio_vs_turbo3"] * row["bits_per_position"] == pytest.approx(3 * comps)
            # measured while verifying: when this session came out, and its archive's rate
            assert 0 < row["restore_seconds"] < 600 and row["restore_tokens_per_s"] > 0
        for codec in ("raw", "seq", "turbo3"):  # one decode rate per archive
            rates = {rows[(other, codec)]["restore_tokens_per_s"] for other in ("a", "b")}
            assert len(rates) == 1
        # raw stores every component in 16 bits: payload = 16 x components x positions, plus
        # at most the token id and surprisal (96 bits) and framing per position
        raw = rows[(sid, "raw")]
        payload = raw["bits_total"] - raw["breakdown"]["header"]
        assert 16 * comps * n <= payload <= (16 * comps + 96 + 16) * n
        assert raw["exact"] is True and raw["max_abs_error"] == 0.0
        # seq on a canonical capture: exact, tokens cost their surprisal (+ log2 V for the
        # first token, coded uniformly) within 2%
        seq = rows[(sid, "seq")]
        assert seq["exact"] is True and seq["max_abs_error"] == 0.0
        assert seq["attention_error"] == 0.0 and seq["breakdown"]["residual"] == 0.0
        ideal = float(cap.surprisal.sum()) + math.log2(tiny_lm.vocab_size)
        token_bits = seq["breakdown"]["tokens"] + seq["breakdown"]["trie"]
        assert token_bits == pytest.approx(ideal, rel=0.02)
        # turbo3: lossy, errors measured, continuation metrics present
        t3 = rows[(sid, "turbo3")]
        assert t3["exact"] is False and 0 < t3["max_abs_error"] < 10
        assert 0 < t3["attention_error"] < 1 and 0 < t3["rel_l2_error"] < 1
        assert 0.0 <= t3["greedy_agreement"] <= 1.0 and 0 <= t3["greedy_prefix"] <= 6
        assert t3["ppl_ratio"] == pytest.approx(2 ** t3["delta_log2_ppl"])
        assert seq["delta_log2_ppl"] == 0.0 and seq["greedy_agreement"] == 1.0


def test_sessions_of_one_file_add_up_to_its_size(caps, tmp_path):
    """The per-session bits (with their share of header and trie) sum to the file."""
    from seqkv_cli.archive import compress_captures
    from seqkv_cli.report.collect import ReportOptions, build_report

    skv = tmp_path / "int8.skv"
    compress_captures(caps, skv, codec="int8")
    report = build_report([skv, *caps], ReportOptions(codecs=["int8"], verify=False))
    file_rows = [r for r in report.rows if r.source == str(skv)]
    assert {r.role for r in file_rows} == {"subject"} and len(report.rows) == 2
    assert sum(r.bits_total for r in file_rows) == pytest.approx(skv.stat().st_size * 8)
    with Archive(skv) as arc:
        assert [r.positions for r in file_rows] == [s["positions"] for s in account(arc).sessions]
    assert all(r.exact is None for r in file_rows)  # --no-verify: not measured


def test_windows_follow_surprisal_for_seq_and_are_flat_per_vector(full, caps):
    _, _, doc = full
    rows = rows_by(doc)
    cap = load_capture(caps[0])
    seq, raw = rows[("a", "seq")], rows[("a", "raw")]
    assert [w["start"] for w in seq["windows"]] == list(range(0, cap.positions, 32))
    assert seq["windows"][-1]["end"] == cap.positions
    weighted = sum(w["bits_per_position"] * (w["end"] - w["start"]) for w in seq["windows"])
    assert weighted == pytest.approx(seq["bits_total"])
    second = cap.surprisal[31:63].double().mean().item()  # positions 32..63
    assert seq["windows"][1]["surprisal"] == pytest.approx(second)
    assert len({round(w["bits_per_position"], 6) for w in raw["windows"]}) == 1


def test_csv_and_parquet_round_trip(full):
    _, out, doc = full
    csv = pd.read_csv(out / "r.csv")
    parquet = pd.read_parquet(out / "r.parquet")
    for df in (csv, parquet):
        assert len(df) == len(doc["sessions"]) == 6
        assert {"id", "codec", "bits_per_position", "breakdown_tokens", "exact"} <= set(df)
        for record in doc["sessions"]:
            match = df[(df["id"] == record["id"]) & (df["codec"] == record["codec"])]
            assert len(match) == 1
            got = match.iloc[0]
            assert got["bits_total"] == pytest.approx(record["bits_total"])
            assert got["breakdown_header"] == pytest.approx(record["breakdown"]["header"])
            assert bool(got["exact"]) is record["exact"]
    assert parquet["positions"].dtype.kind == "i"


def test_markdown_and_table(full):
    result, out, _ = full
    md = (out / "r.md").read_text()
    assert md.startswith("## seqkv report")
    assert "| session | codec | role |" in md and "| a | seq | subject |" in md
    assert "No thresholds set." in md
    for fragment in ("bits/pos", "log2 PP", "gap (x)", "vs turbo3", "greedy agree (6)"):
        assert fragment in result.stdout
    assert "where the bits go" in result.stdout


def test_plots_are_png_files(full):
    _, out, _ = full
    for name in ("cumulative_bits", "marginal_bits", "rate_distortion"):
        data = (out / "plots" / f"{name}.png").read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
        width, height = struct.unpack(">II", data[16:24])
        assert width >= 600 and height >= 400
    assert not [p for p in (out / "plots").iterdir() if p.name.endswith(".tmp")]


@pytest.mark.model
def test_embedded_model_seq_costs_its_surprisal(embedded_lm, tmp_path):
    """On the real model: seq restores a canonical capture exactly, and its token stream costs
    the capture's surprisal (+ log2 V for the first token) within 2%; turbo3 sits near 3
    bits per component."""
    from seqkv_cli import capture
    from seqkv_cli.report.collect import ReportOptions, build_report

    text = tmp_path / "p.txt"
    text.write_text((SAMPLE_DATA / "prose.txt").read_text()[:700])
    [res] = capture([str(text)], model=embedded_lm, out=tmp_path / "caps", max_tokens=120)
    report = build_report([res.path], ReportOptions(codecs=["seq", "turbo3"]))
    rows = {r.codec: r for r in report.rows}
    seq, t3 = rows["seq"], rows["turbo3"]
    ideal = float(res.capture.surprisal.sum()) + math.log2(embedded_lm.vocab_size)
    assert seq.exact is True and seq.breakdown["residual"] == 0.0
    assert seq.breakdown["tokens"] + seq.breakdown["trie"] == pytest.approx(ideal, rel=0.02)
    assert seq.components_per_position == 11520 and seq.ratio_vs_fp16 > 1000
    assert t3.exact is False and 0.05 < t3.attention_error < 0.4
    payload = (t3.bits_total - t3.breakdown["header"]) / t3.positions
    assert 3 * 11520 <= payload <= 3.5 * 11520
