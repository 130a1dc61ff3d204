"""The CLI: exit codes, one-line errors, nothing half-written."""

from __future__ import annotations

import inspect

import pytest

from cli_run import invoke
from conftest import SAMPLE_DATA


def assert_one_line_error(result, fragment: str) -> None:
    assert result.exit_code == 2, result.output
    # Progress lines may come first; the error itself is exactly one line, the last one.
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:")]
    assert len(errors) == 1 and lines[-1] == errors[0], result.stderr
    assert fragment in errors[0], errors[0]
    assert "Traceback" not in result.output


def test_help_and_version():
    result = invoke("--help")
    assert result.exit_code == 0 and "capture" in result.stdout and "model" in result.stdout
    result = invoke("--version")
    assert result.exit_code == 0 and result.stdout.strip() == "seqkv 0.9.0"


def test_capture_writes_files_and_table(tiny_model_dir, tmp_path):
    out = tmp_path / "caps"
    result = invoke(
        "capture",
        str(SAMPLE_DATA / "chats.jsonl"),
        "-o",
        str(out),
        "--model",
        str(tiny_model_dir),
        "--max-tokens",
        "40",
        "--dtype",
        "fp16",
    )
    assert result.exit_code == 0, result.output
    files = sorted(p.name for p in out.iterdir())
    assert "chat-01.safetensors" in files and len(files) >= 12
    assert "chat-01" in result.stdout and "log2 PP" in result.stdout


def test_capture_stdin_to_single_file(tiny_model_dir, tmp_path):
    out = tmp_path / "one.safetensors"
    result = invoke(
        "capture",
        "-",
        "-o",
        str(out),
        "--model",
        str(tiny_model_dir),
        input="hello from standard input",
    )
    assert result.exit_code == 0, result.output
    from seqkv_cli import load_capture

    cap = load_capture(out)
    assert cap.positions == len("hello from standard input") and cap.meta["source"] == "<stdin>"


@pytest.mark.parametrize(
    ("make_args", "fragment"),
    [
        (lambda t, m: ["capture", str(t / "missing.txt")], "no such input file"),
        (lambda t, m: ["capture", str(t / "empty.txt")], "empty input"),
        (lambda t, m: ["capture", str(t / "bad.jsonl")], "bad.jsonl:2: malformed JSON"),
        (lambda t, m: ["capture", str(t / "ok.txt"), "--dtype", "int3"], "unknown dtype 'int3'"),
        (lambda t, m: ["capture", str(t / "ok.txt"), "--model", str(t)], "not a model folder"),
        (lambda t, m: ["capture", str(t / "ok.txt"), "--model", str(t / "ok.txt")], "not a model"),
        (
            lambda t, m: ["capture", str(t / "ok.txt"), "--model", str(t / "junk.gguf")],
            "not a GGUF file",
        ),
        (
            lambda t, m: ["capture", str(t / "ok.txt"), "--model", str(t / "trunc.gguf")],
            "could not read GGUF file",
        ),
        (
            lambda t, m: ["capture", str(t / "ok.txt"), "--model", "nobody/no-such-model"],
            "cannot fetch 'nobody/no-such-model'",
        ),
        (
            lambda t, m: [
                "capture",
                str(t / "ok.txt"),
                "--model",
                m,
                "-o",
                str(t / "ok.txt" / "sub"),
            ],
            "cannot create output directory",
        ),
        (
            lambda t, m: ["capture", str(t / "long.txt"), "--model", m, "-o", str(t / "out")],
            "more than the model context (512); pass --truncate",
        ),
    ],
)
def test_bad_input_gives_one_line_and_writes_nothing(
    tmp_path, tiny_model_dir, monkeypatch, make_args, fragment
):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("SEQKV_CACHE", str(tmp_path / "cache"))
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "ok.txt").write_text("some text")
    (tmp_path / "long.txt").write_text("y" * 600)
    (tmp_path / "bad.jsonl").write_text(
        '{"id": "a", "messages": [{"role": "user", "content": "hi"}]}\nnot json\n'
    )
    (tmp_path / "junk.gguf").write_bytes(b"PK\x03\x04" + b"\x00" * 64)
    (tmp_path / "trunc.gguf").write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x07" * 40)
    result = invoke(*make_args(tmp_path, str(tiny_model_dir)))
    assert_one_line_error(result, fragment)
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").iterdir())
    assert not (tmp_path / "captures").exists()


@pytest.mark.model
def test_model_info_shows_the_embedded_model(embedded_lm):
    result = invoke("model", "info")
    assert result.exit_code == 0, result.output
    out = result.stdout
    for fragment in (
        "SmolLM2-135M-Instruct",
        "LlamaForCausalLM",
        "30",
        "49152",
        "8192",
        embedded_lm.fingerprint,
    ):
        assert fragment in out, fragment


@pytest.mark.model
def test_pipeline_captures_compresses_verifies_and_summarises(embedded_lm, tmp_path):
    short = tmp_path / "short.txt"
    short.write_text((SAMPLE_DATA / "prose.txt").read_text()[:400])
    result = invoke("pipeline", str(short), "-o", str(tmp_path / "run"), "--baseline", "int8")
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "short" in out and "log2 PP" in out and "int8" in out and "yes" in out
    run = tmp_path / "run"
    assert (run / "captures" / "short.safetensors").exists()
    assert (run / "seq.skv").exists() and (run / "int8.skv").exists()
    result = invoke("pipeline", str(short), "-o", str(tmp_path / "r2"), "--verify", "maybe")
    assert_one_line_error(result, "--verify must be one of all, sample, none")


def test_a_model_command_is_declared_and_must_take_the_machine_options():
    """`runs_model` is what applies --threads and --device, so a command that declares it
    without both options fails when it is defined, not when a user runs it."""
    from seqkv_cli.cli import app
    from seqkv_cli.commands.options import runs_model

    with pytest.raises(TypeError, match=r"forgetful runs a model but takes no \['device'\]"):

        @runs_model
        def forgetful(threads: int | None = None) -> None: ...

    # every command with both options declares it (else they would be accepted and ignored)
    def commands(group):
        for info in group.registered_commands:
            yield info.callback
        for sub in group.registered_groups:
            yield from commands(sub.typer_instance)

    for callback in commands(app):
        params = set(inspect.signature(callback).parameters)
        takes = {"threads", "device"} <= params
        assert takes == getattr(callback, "runs_model", False), callback.__name__
