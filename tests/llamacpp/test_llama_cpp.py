"""Real llama.cpp (llama-cpp-python, the `llamacpp` extra): states it saves from the embedded
GGUF go into an archive and come back as files it loads, and its next-token logits from the
restored state equal those from the original state. Skipped without llama-cpp-python;
`.ci/run` installs it and runs this file."""

from __future__ import annotations

import ctypes
import os

import numpy as np
import pytest

from cli_run import invoke

if os.environ.get("SEQKV_REQUIRE_LLAMA_CPP"):  # .ci/run: a missing llama.cpp is a failure
    import llama_cpp
else:
    llama_cpp = pytest.importorskip(
        "llama_cpp", reason="llama-cpp-python is not installed (pip install -e '.[llamacpp]')"
    )

SYSTEM = "You are a careful assistant. Answer briefly and cite the rule you used. "
USERS = ["What is the capital of France?", "List three prime numbers.", "Why is the sky blue?"]


@pytest.fixture(scope="module")
def gguf():
    from seqkv_cli.runtime.embedded import embedded_gguf

    return embedded_gguf()


def _context(gguf, flash_attn):
    return llama_cpp.Llama(
        model_path=str(gguf), n_ctx=256, n_threads=2, verbose=False, flash_attn=flash_attn
    )


def _logits(llm) -> np.ndarray:
    ptr = llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1)
    return np.ctypeslib.as_array(ptr, shape=(llm.n_vocab(),)).copy()


def _save(llm, tokens, path, *, kind, packed):
    """Evaluate `tokens` from an empty cache and save the state as llama-server (packed
    token list) or an application (plain list) would; then the logits of one more token."""
    llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(llm._ctx.ctx), True)
    llm.reset()
    llm.eval(tokens)
    words = [-1, 1, len(tokens), *tokens, 0] if packed else list(tokens)
    arr = (llama_cpp.llama_token * len(words))(*words)
    if kind == "sequence":
        assert llama_cpp.llama_state_seq_save_file(
            llm._ctx.ctx, str(path).encode(), 0, arr, len(words)
        )
    else:
        assert llama_cpp.llama_state_save_file(llm._ctx.ctx, str(path).encode(), arr, len(words))
    llm.eval([tokens[-1]])  # the next token: its logits are what a restored state must give
    return _logits(llm)


def _load_and_step(llm, tokens, path, *, kind):
    llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(llm._ctx.ctx), True)
    llm.reset()
    cap = len(tokens) + 8
    buf = (llama_cpp.llama_token * cap)()
    n = ctypes.c_size_t(0)
    if kind == "sequence":
        got = llama_cpp.llama_state_seq_load_file(
            llm._ctx.ctx, str(path).encode(), 0, buf, cap, ctypes.byref(n)
        )
    else:
        got = llama_cpp.llama_state_load_file(
            llm._ctx.ctx, str(path).encode(), buf, cap, ctypes.byref(n)
        )
    assert got, f"llama.cpp refused {path}"
    llm.n_tokens = len(tokens)
    llm.input_ids[: len(tokens)] = tokens
    llm.eval([tokens[-1]])
    return _logits(llm)


@pytest.mark.parametrize("flash_attn", [True, False])
def test_llama_cpp_states_round_trip_through_an_archive(tmp_path, gguf, flash_attn):
    llm = _context(gguf, flash_attn)
    slots, logits = [], []
    for i, user in enumerate(USERS):
        tokens = llm.tokenize((SYSTEM + user).encode(), add_bos=False)
        kind = "session" if i == 2 else "sequence"
        path = tmp_path / f"slot{i}.bin"
        logits.append(_save(llm, tokens, path, kind=kind, packed=kind == "sequence"))
        slots.append((path, tokens, kind))
    archive = tmp_path / "slots.skv"
    result = invoke("import", "llama-state", *[p for p, _, _ in slots], "-o", archive)
    assert result.exit_code == 0, result.output
    for i, (path, tokens, kind) in enumerate(slots):
        out = tmp_path / f"out{i}.bin"
        result = invoke("export", "llama-state", archive, f"slot{i}", "-o", out)
        assert result.exit_code == 0 and "byte-identical" in result.stdout, result.output
        assert out.read_bytes() == path.read_bytes()
        restored = _load_and_step(_context(gguf, flash_attn), tokens, out, kind=kind)
        assert np.array_equal(restored, logits[i])  # bit for bit: llama.cpp's own K/V
    # The shared system prompt is one token path: the archive is smaller than the states.
    assert archive.stat().st_size < sum(p.stat().st_size for p, _, _ in slots)


def test_tokens_only_export_loads_in_llama_cpp(tmp_path, gguf):
    llm = _context(gguf, True)
    tokens = llm.tokenize((SYSTEM + USERS[0]).encode(), add_bos=False)
    path = tmp_path / "chat.bin"
    want = _save(llm, tokens, path, kind="sequence", packed=True)
    archive = tmp_path / "t.skv"
    result = invoke("import", "llama-state", path, "-o", archive, "--tokens-only")
    assert result.exit_code == 0, result.output
    assert archive.stat().st_size * 100 < path.stat().st_size  # tokens only: tiny
    out = tmp_path / "out.bin"
    result = invoke("export", "llama-state", archive, "chat", "-o", out)
    assert result.exit_code == 0 and "recompute" in result.stdout, result.output
    got = _load_and_step(_context(gguf, True), tokens, out, kind="sequence")
    # seqkv's K/V, not llama.cpp's: the same next token, logits close.
    assert int(np.argmax(got)) == int(np.argmax(want))
    assert np.abs(got - want).max() < 0.05 * np.abs(want).max()


def test_a_state_of_another_model_is_refused(tmp_path, gguf, tiny_model_dir):
    llm = _context(gguf, True)
    tokens = llm.tokenize(SYSTEM.encode(), add_bos=False)
    path = tmp_path / "s.bin"
    _save(llm, tokens, path, kind="sequence", packed=False)
    result = invoke(
        "import", "llama-state", path, "-o", tmp_path / "a.skv", "--model", tiny_model_dir
    )
    assert result.exit_code == 2 and "30 layers in the state, 2 in the model" in result.stderr
    assert not (tmp_path / "a.skv").exists()
