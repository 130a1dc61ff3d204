"""Every bench module, run through its own command line on the tiny random model at its
smallest size: it parses its arguments, measures, and publishes JSON whose keys are there and
whose numbers are real. The numbers are not benchmarks. Benches that start `seqkv` processes,
step a model over whole sample texts or need llama.cpp are `slow` (bench/slow_tests.sh)."""

from __future__ import annotations

import importlib
import json
import math
import os

import pytest
import torch

BENCHES = [
    "studies.agent_memory",
    "studies.agent_turns",
    "studies.codecs",
    "studies.delta_topk",
    "studies.entropy",
    "studies.near_dup",
    "studies.numerics",
    "studies.seq",
    "studies.trie",
    "studies.contention",
    "studies.definition_sweep",
    "studies.drafts",
    "studies.exact_step",
    "studies.first_run",
    "studies.foreign_residual",
    "gpu.check",
    "studies.llama_state",
    "studies.load_modes",
    "studies.manifest_listing",
    "studies.native_speed",
    "studies.one_session",
    "studies.parallel",
    "studies.real_models",
    "studies.portability",
    "suite.run",
    "studies.scale",
    "studies.siblings",
    "studies.trie_batching",
    "studies.vocab",
]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    """The tiny model with room for the benches' longer inputs (sample texts, byte tokens)."""
    from tests.conftest import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("bench-tiny") / "tiny", context=4096))


@pytest.fixture(autouse=True)
def _leave_torch_as_it_was():
    """A bench sets torch threads and environment variables for its own process; here it
    shares the test process, so both are put back."""
    threads, environ = torch.get_num_threads(), dict(os.environ)
    yield
    torch.set_num_threads(threads)
    os.environ.clear()
    os.environ.update(environ)


def run_bench(name: str, args: list[str], tmp_path) -> dict:
    """`python -m bench.FOLDER.NAME ARGS --json FILE`, in this process; the JSON it wrote, checked
    for the harness's keys and for real numbers only."""
    main = importlib.import_module(f"bench.{name}").main
    out = tmp_path / f"{name}.json"
    with torch.no_grad():
        main([*args, "--json", str(out), "--append", str(tmp_path / "BENCH.md")])
    result = json.loads(out.read_text())
    assert result["command"].startswith("python ")  # here: pytest's own command line
    env = result["environment"]
    assert env["cores"] >= 1 and env["torch"] == torch.__version__ and env["transformers"]
    numbers = list(_numbers(result))
    assert numbers and all(math.isfinite(x) for x in numbers)
    assert (tmp_path / "BENCH.md").read_text().strip()
    return result


def _numbers(value):
    if isinstance(value, bool):
        return
    if isinstance(value, int | float):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _numbers(v)
    elif isinstance(value, list):
        for v in value:
            yield from _numbers(v)


@pytest.mark.parametrize("name", BENCHES)
def test_every_bench_parses_its_command_line(name, capsys):
    main = importlib.import_module(f"bench.{name}").main
    with pytest.raises(SystemExit) as stop:
        main(["--help"])
    assert stop.value.code == 0
    help_text = capsys.readouterr().out
    assert "--json" in help_text and "--append" in help_text and "--threads" in help_text


def test_entropy(tmp_path):
    out = run_bench("studies.entropy", ["--size-mb", "0.01", "--repeat", "1"], tmp_path)
    assert {r["method"] for r in out["results"]} >= {"rans-numpy", "zstd-3"}
    assert all(r["encode_MBps"] > 0 and r["ratio"] > 0 for r in out["results"])


def test_manifest_listing(tmp_path):
    out = run_bench(
        "studies.manifest_listing", ["--sessions", "3000", "--rich-sample", "50"], tmp_path
    )
    assert out["sessions"] == 3000 and 0 < out["us_per_row"] < out["rich_us_per_row"]


def test_codecs_on_given_captures(model, tmp_path):
    from seqkv_cli.kvcapture.api import capture

    (tmp_path / "t.txt").write_text("Per-vector codecs, smallest case. " * 2)
    [cap] = capture([str(tmp_path / "t.txt")], model=model, out=tmp_path / "caps")
    args = ["--captures", str(cap.path), "--entropy-size-mb", "0.01"]
    out = run_bench("studies.codecs", args, tmp_path)
    rows = {r["codec"]: r for r in out["codecs"]}
    assert rows["lossless"]["rel_l2_error"] == 0 and rows["int8"]["ratio"] > 1
    assert out["positions"] == cap.capture.positions and out["entropy"]


def test_parallel(model, tmp_path):
    # 256 tokens restored: seconds are rounded to 0.1, and the speed-up divides by them
    args = ["--model", model, "--cases", "prose", "--tokens", "256", "--runs", "2"]
    args += ["--speed-tokens", "256", "--speed-runs", "1", "2"]
    [row] = run_bench("studies.parallel", args, tmp_path)["rows"]
    assert [b["runs"] for b in row["bits"]] == [1, 2] and row["bits"][0]["vs_one_run"] == 1
    assert [s["runs"] for s in row["speed"]] == [1, 2]
    assert all(s["bit_exact"] for s in row["speed"]) and row["hf_step_loop_tokens_per_s"] > 0


def test_siblings(model, tmp_path):
    args = ["--model", model, "--cases", "independent", "--sessions", "2", "--tokens", "16"]
    [row] = run_bench("studies.siblings", args, tmp_path)["rows"]
    assert (row["alone"]["sessions"], row["together"]["sessions"]) == (1, 2)
    assert row["together"]["positions"] == 32 and row["positions_ratio"] > 0


def test_exact_step(tmp_path):
    """A tiny GGUF through capture, compress and a restore as whole processes (llama.cpp's
    steps need the `llamacpp` extra): bit-exact, and the multiply-adds of one token counted
    from the file's 2-D weights (a tied embedding counts as the output)."""
    from transformers import AutoConfig

    from bench.real_shapes import byte_tokenizer, write_gguf

    values = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2}
    values |= {"num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 320}
    config = AutoConfig.for_model("llama", max_position_embeddings=16384, **values)
    config.tie_word_embeddings = True
    gguf = write_gguf(config, tmp_path / "tiny.gguf", qtype="Q8_0", tokenizer=byte_tokenizer(320))
    args = ["--models", str(gguf), "--tokens", "40", "--steps", "capture,compress,decompress"]
    [row] = run_bench("studies.exact_step", args, tmp_path)["models"]
    assert row["steps"]["decompress"]["bit_exact"] is True
    per_layer = 64 * (64 + 32 + 32) + 64 * 64 + 3 * 64 * 128
    assert row["multiply_adds"] == 2 * per_layer + 320 * 64
    assert row["restore_ms_a_token"] > 0


@pytest.mark.slow
def test_real_models(model, tmp_path):
    """Whole `seqkv` processes: capture, compress and decompress of the tiny model, exact."""
    steps = "capture_plain,capture,compress,decompress"
    result = run_bench(
        "studies.real_models", ["--model", model, "--tokens", "40", "--steps", steps], tmp_path
    )
    assert result["steps"]["decompress"]["bit_exact"] is True
    assert all(row["peak_GiB"] > 0 for row in result["steps"].values())


@pytest.mark.slow
def test_first_run(model, tmp_path):
    """Three whole captures; the cold one compiles kernels and lists them, the warm one none."""
    result = run_bench("studies.first_run", ["--model", model, "--tokens", "40"], tmp_path)
    assert set(result["steps"]) == {"plain", "cold", "warm"}
    assert result["compiles"] == sum(k["compiles"] for k in result["kernels"].values()) > 0
    assert 0 < result["compile_seconds"] < result["steps"]["cold"]["seconds"]


def test_one_session(model, tmp_path):
    text = tmp_path / "short.txt"
    text.write_text("One session, one file: the smallest case.\n")
    args = ["--model", model, "--texts", str(text), "--verify", str(text)]
    [row] = run_bench("studies.one_session", args, tmp_path)["rows"]
    assert row["verified_bit_exact"] and row["positions"] > 0
    assert 0 < row["token_payload_bytes"] < row["compact_file_bytes"] < row["trie_file_bytes"]


def test_definition_sweep(model, tmp_path):
    from seqkv_cli.runtime.portable import fused

    exact = (fused.FusedDecoder._linear, fused.attend)
    out = run_bench("studies.definition_sweep", ["--model", model, "--tokens", "16"], tmp_path)
    assert out["tokens"] == 16 and out["rows"][0]["name"] == "transformers fp32"
    assert all(0 <= r["bf16_differ"] <= 1 for r in out["rows"])
    # its emulated products replace the fused kernels while it runs, and only then (left in
    # place they made every later fused forward in the process inexact: 19 tests failed)
    assert (fused.FusedDecoder._linear, fused.attend) == exact


def test_numerics_speed(model, tmp_path):
    out = run_bench("studies.numerics", ["--model", model, "--sections", "speed"], tmp_path)
    assert out["texts"] == {} and len(out["speed"]) == 4
    assert all(s["step_ms"] > 0 and s["prefill_256_s"] > 0 for s in out["speed"].values())


def test_trie(model, tmp_path):
    args = ["--model", model, "--sessions", "3", "--prefix", "40", "--tail", "10"]
    args += ["--singles", "1", "--work", str(tmp_path / "work")]
    out = run_bench("studies.trie", args, tmp_path)
    assert out["captures_exact_vs_whole_capture"] and out["extract_exact"]
    assert out["nodes"] >= 2 and out["archive_bytes"] > 0


def test_suite_context_section(model, tmp_path):
    out = run_bench("suite.run", ["--model", model, "--quick", "--sections", "context"], tmp_path)
    assert out["quick"] and list(out["results"]) == ["context"]
    assert out["results"]["context"]["rows"] and out["total_seconds"] > 0


def test_scale_without_ray(tmp_path):
    args = ["--tiny", "--sessions", "4", "--shard-sessions", "2", "--workers", ""]
    out = run_bench("studies.scale", args, tmp_path)
    assert [r["run"] for r in out["runs"]] == ["one archive (no shards)", "shards, serial"]
    assert all(r["sessions"] == 4 for r in out["runs"])


# --- slow: processes of their own, whole sample texts, or many restores ---------------------


@pytest.mark.slow
def test_drafts(model, tmp_path):
    # 256 tokens: seconds are rounded to 0.1, and the speed-up divides by them
    args = ["--model", model, "--cases", "prose", "--tokens", "256"]
    [row] = run_bench("studies.drafts", args, tmp_path)["rows"]
    assert row["bit_exact"] and row["passes_off"] == row["tokens"] and row["speedup"] > 0


@pytest.mark.slow
def test_foreign_residual(model, tmp_path):
    out = run_bench("studies.foreign_residual", ["--model", model, "--tokens", "16"], tmp_path)
    assert [r["dtype"] for r in out["rows"]] == ["bf16", "fp16", "fp32", "bf16"]
    assert out["rows"][0]["verified_bit_exact"] and out["replay"][0]["bit_exact"]


@pytest.mark.slow
def test_agent_memory(model, tmp_path):
    out = run_bench("studies.agent_memory", ["--model", model, "--max-tokens", "1100"], tmp_path)
    assert out["turns"] and out["restore"]["own_cache_bit_exact"]


def test_agent_turns(model, tmp_path):
    out = run_bench(
        "studies.agent_turns", ["--model", model, "--turns", "3", "--turn-tokens", "40"], tmp_path
    )
    turns, summary = out["turns"], out["summary"]
    assert [t["tokens"] for t in turns] == [40, 80, 120] and summary["tokens_exact"]
    # each turn's growth is its coded tokens and its framing, and the third a segment only
    assert all(t["growth_bytes"] == t["coded_bytes"] + t["framing_bytes"] for t in turns)
    assert 0 < turns[2]["framing_bytes"] < 80
    # compacted: one node of a compact archive, its tokens about the turns' coded tokens
    assert summary["compacted_layout"] == "compact archive"
    assert summary["compacted_bytes"] < summary["file_bytes"]
    coded = sum(t["coded_bytes"] for t in turns)
    assert summary["compacted_bytes"] - summary["compacted_token_bytes"] < 40 + 20 * len(turns)
    assert summary["compacted_token_bytes"] <= coded + 8


def test_agent_turns_with_the_agents_own_cache(model, tmp_path):
    args = ["--model", model, "--turns", "3", "--turn-tokens", "40", "--cache"]
    out = run_bench("studies.agent_turns", args, tmp_path)
    turns, summary = out["turns"], out["summary"]
    assert summary["own_cache"] and summary["tokens_exact"]  # the last cache, bit for bit
    assert summary["restore"] == ["replay"]
    # one session alone: a compact archive; the third turn: a segment with a binary record
    assert turns[0]["framing_bytes"] <= 150 and 0 < turns[2]["framing_bytes"] < 100
    assert summary["compacted_layout"] == "compact archive"
    assert summary["compacted_bytes"] <= summary["compact_bound"]


def test_load_modes(model, tmp_path):
    out = run_bench("studies.load_modes", ["--model", model, "--tokens", "60"], tmp_path)
    rows = {r["archive"]: r for r in out["rows"]}
    assert all(out["exact"].values()) and len(rows) == 3
    assert rows["own cache (replay), fast"]["kv_strategy"] == "replay"
    # fewest bytes in the small mode: the model codes the tokens
    assert rows["tokens only, small"]["file_bytes"] < rows["tokens only, fast"]["file_bytes"]


@pytest.mark.slow
def test_trie_batching(tmp_path):
    out = run_bench("studies.trie_batching", ["--sessions", "2"], tmp_path)
    assert out["now"]["sessions"] == 4 and out["now"]["passes"] > 0


@pytest.mark.slow
def test_portability(model, tmp_path):
    args = ["--model", model, "--tokens", "16", "--threads", "1", "--skip-mkl"]
    out = run_bench("studies.portability", args, tmp_path)
    assert out["variants"] and all(v["exact"] for v in out["variants"])


@pytest.mark.slow
def test_native_speed(model, tmp_path):
    out = run_bench("studies.native_speed", ["--model", model, "--threads", "1"], tmp_path)
    assert out["processes"]["capture_ratio"] > 0 and len(out["runs"]) == 2


@pytest.mark.slow
def test_contention(model, tmp_path):
    args = ["--model", model, "--tokens", "16", "--policies", "now"]
    out = run_bench("studies.contention", args, tmp_path)
    assert len(out["rows"]) == 5 and all(r["seconds"] for r in out["rows"])


@pytest.mark.slow
def test_gpu_check_cpu_dry_run(tmp_path):
    out = run_bench("gpu.check", ["--cpu-dry-run", "--out", str(tmp_path / "gpu")], tmp_path)
    assert out["mode"] == "cpu dry run" and (tmp_path / "gpu" / "gpu_check.md").exists()
    steps = ("entropy_identity", "entropy_speed", "tables", "token_coder")
    assert all("error" not in out[k] for k in steps)
    assert out["entropy_identity"]["identical"] == 3


@pytest.mark.slow
def test_seq(tmp_path):
    from tests.conftest import build_tiny_model

    # bench_seq captures whole sample texts: up to ~9,400 byte tokens
    model = str(build_tiny_model(tmp_path / "tiny", context=16384))
    out = run_bench("studies.seq", ["--model", model], tmp_path)
    assert all(r["exact"] for r in out["rows"]) and out["speed"]["hf_step_loop_tokens_per_s"] > 0


def test_vocab(tmp_path):
    """A small vocabulary and one past 65,536: the kernels' and numpy's streams are the same
    bytes (the bench stops otherwise), every speed is real, the ratio is the payload over
    log2 PP, and seq-fast's stream is entropy version 2 past 65,536 tokens."""
    out = run_bench("studies.vocab", ["--vocabs", "300", "70000", "--tokens", "24"], tmp_path)
    assert [r["vocab"] for r in out["rows"]] == [300, 70_000]
    for r in out["rows"]:
        assert r["same_bytes"] and r["tokens"] == 24 and r["stream_bytes"] > 0
        assert (
            min(
                r[f"{w}_tokens_per_s_{k}"]
                for w in ("encode", "decode")
                for k in ("kernels", "numpy")
            )
            > 0
        )
        assert r["payload_over_log2_pp"] == pytest.approx(
            r["payload_bits_per_position"] / r["log2_pp"], rel=1e-3
        )
        assert r["first_token_bits"] == pytest.approx(math.log2(r["vocab"]), abs=0.01)
        assert r["static_version"] == (1 if r["vocab"] <= 65_536 else 2)
        assert r["static_bits_per_position"] > 0
    assert {(g["vocab"], g["scale"]) for g in out["gaussian"]} == {
        (v, s) for v in (300, 70_000) for s in (2.0, 5.0, 10.0)
    }


@pytest.mark.slow
def test_near_dup(model, tmp_path):
    out = run_bench("studies.near_dup", ["--model", model], tmp_path)
    assert out["rows"] and out["clusters"]


@pytest.mark.slow
def test_delta_topk(model, tmp_path):
    out = run_bench("studies.delta_topk", ["--model", model, "--tokens", "16"], tmp_path)
    assert out["rows"]


@pytest.mark.slow
def test_llama_state(tmp_path):
    pytest.importorskip("llama_cpp")
    out = run_bench("studies.llama_state", ["--slots", "2"], tmp_path)
    assert out["exact_bytes"] > 0
