"""--device auto|cpu|cuda (runtime/devices.py): refusals, resolution, and that the device and
thread count never change a written byte (SOURCE_DATE_EPOCH makes whole files comparable).

The CUDA path itself needs a GPU: bench/gpu/check.sh compares whole .skv files written on the
CPU and on the device (bench/gpu/files.py)."""

from __future__ import annotations

import pytest
import torch

from cli_run import invoke as run
from seqkv_cli.errors import SeqkvError
from seqkv_cli.runtime import devices

NO_CUDA = devices.cuda_unavailable_reason() is not None
needs_no_cuda = pytest.mark.skipif(not NO_CUDA, reason="this machine has CUDA")


def stderr_lines(result) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.strip()]


@needs_no_cuda
@pytest.mark.parametrize(
    "command",
    [
        ["capture", "{d}/in.txt", "-o", "{d}/out.safetensors"],
        ["compress", "{d}/in.safetensors", "-o", "{d}/out.skv"],
        ["decompress", "{d}/in.skv", "-o", "{d}/out"],
        ["verify", "{d}/in.skv"],
        ["report", "{d}/in.skv"],
        ["pipeline", "{d}", "-o", "{d}/out"],
        ["archive", "extract", "{d}/in.skv", "a", "-o", "{d}/out.safetensors"],
        ["archive", "compact", "{d}/in.skv"],
        ["resume", "{d}/in.skv", "a", "--prompt", "hi"],
        ["info", "{d}/in.skv"],
    ],
)
def test_cuda_without_cuda_is_one_line_and_exit_2(tmp_path, command):
    (tmp_path / "in.txt").write_text("hello")
    args = [a.format(d=tmp_path) for a in command]
    result = run(*args, "--device", "cuda")
    assert result.exit_code == 2, result.output
    lines = stderr_lines(result)  # the error and nothing else
    assert len(lines) == 1, lines
    assert lines[0].startswith("error: --device cuda: no CUDA device here (")
    assert "use --device cpu" in lines[0]
    assert "Traceback" not in result.output
    assert not any(p.name.startswith("out") for p in tmp_path.iterdir())  # nothing written


def test_unknown_devices_are_refused_naming_the_choices(tmp_path):
    for bad, expected in (
        ("tpu", "is not one of auto, cpu, cuda, cuda:N"),
        ("cuda:x", "the GPU index must be a number"),
        ("cuda:", "the GPU index must be a number"),
        ("cuda:\u0663", "the GPU index must be a number"),  # a digit, but not an ASCII one
        ("[red]x", "is not one of auto, cpu, cuda, cuda:N"),
    ):
        result = run("verify", tmp_path / "in.skv", "--device", bad)
        assert result.exit_code == 2
        assert expected in result.stderr, result.stderr


@needs_no_cuda
def test_auto_is_the_cpu_without_cuda_and_commands_restore_the_selection():
    assert devices.resolve("auto") == torch.device("cpu")
    assert devices.resolve("CPU") == torch.device("cpu")
    with pytest.raises(SeqkvError, match=r"CPU-only build|sees no GPU"):
        devices.resolve("cuda:0")
    before = devices.selected(), devices.requested()
    with devices.using("AUTO") as chosen:
        assert chosen == torch.device("cpu") == devices.selected()
        assert devices.requested() == "auto"  # what a Ray actor resolves on its own machine
    assert (devices.selected(), devices.requested()) == before


def test_the_legacy_path_refuses_a_model_off_the_cpu(tiny_lm, monkeypatch):
    from seqkv_cli.runtime import numerics

    model = tiny_lm.model  # its fp32 weights made on the CPU first (alone, this test makes them)
    monkeypatch.setattr(devices, "model_device", lambda model: torch.device("cuda", 0))
    with pytest.raises(SeqkvError, match="cannot run on cuda:0; use --device cpu"):
        numerics.build_canonical(model, numerics.LEGACY)


def test_source_date_epoch_fixes_created_and_bad_values_are_one_line(monkeypatch):
    from seqkv_cli.clock import created_utc

    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")
    assert created_utc() == "2023-11-14T22:13:20Z"
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "-5")
    with pytest.raises(SeqkvError, match="must be a count of seconds, got '-5'"):
        created_utc()


def test_device_and_threads_leave_every_byte_of_the_archive_alone(tmp_path, tiny_model_dir):
    """The same capture compressed under --device cpu/auto and --threads 1/2 gives one file,
    byte for byte, and a change the writer does make (the time) shows up: the comparison
    can fail."""
    env = {"SOURCE_DATE_EPOCH": "1700000000"}
    caps = []
    for name, text in (("a", "The same bytes on every device. " * 6), ("b", "The same ... " * 9)):
        (tmp_path / f"{name}.txt").write_text(text)
        caps.append(tmp_path / f"{name}.safetensors")
        result = run("capture", tmp_path / f"{name}.txt", "-o", caps[-1], "--model", tiny_model_dir)
        assert result.exit_code == 0, result.output
    files = {}
    for device, threads in (("cpu", 1), ("auto", 2), ("cpu", 2)):
        out = tmp_path / f"{device}-{threads}.skv"
        result = run(
            "compress", *caps, "-o", out, "--model", tiny_model_dir,
            "--device", device, "--threads", threads, env=env,
        )  # fmt: skip
        assert result.exit_code == 0, result.output
        files[(device, threads)] = out.read_bytes()
    first = files[("cpu", 1)]
    assert all(data == first for data in files.values())
    later = tmp_path / "later.skv"
    run("compress", *caps, "-o", later, "--model", tiny_model_dir, env={"SOURCE_DATE_EPOCH": "1"})
    assert later.read_bytes() != first
    back = tmp_path / "back"
    result = run("decompress", tmp_path / "auto-2.skv", "-o", back, "--model", tiny_model_dir)
    assert result.exit_code == 0, result.output
    from seqkv_cli.kvcapture.capture_file import load_capture

    for cap in caps:
        original, restored = load_capture(cap), load_capture(back / cap.name)
        assert torch.equal(original.tokens, restored.tokens)
        pairs = zip(original.keys + original.values, restored.keys + restored.values, strict=True)
        assert all(torch.equal(a, b) for a, b in pairs)
