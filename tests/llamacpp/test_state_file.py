"""llama.cpp state files without llama.cpp: the byte layout both ways, hostile files refused in
one line, and import/export through the CLI on a tiny model (states forged in llama.cpp's
layout from the model's own recompute, perturbed the way llama.cpp's numerics differ)."""

from __future__ import annotations

import random
import struct

import pytest
import torch

from cli_run import invoke
from seqkv_cli.errors import SeqkvError
from seqkv_cli.llamacpp.convert import from_capture_kv, to_capture_kv
from seqkv_cli.llamacpp.state_file import LayerKV, LlamaState, parse_state, write_state


def one_line_error(result, fragment: str) -> str:
    assert result.exit_code == 2, result.output
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and fragment in errors[0], result.stderr
    assert "Traceback" not in result.output
    return errors[0]


def forged(kind="sequence", form="plain", v_trans=False, k_type=1, v_type=1, n=5, seed=0):
    """A small state (2 layers, width 8) with random cache bytes."""
    rng = random.Random(seed)
    width, size = 8, {0: 4, 1: 2, 30: 2}
    layers = []
    for _ in range(2):
        k = bytes(rng.randrange(256) for _ in range(n * width * size[k_type]))
        v = bytes(rng.randrange(256) for _ in range(n * width * size[v_type]))
        unit, w = (size[v_type], width) if v_trans else (width * size[v_type], 0)
        layers.append(LayerKV(k_type, width * size[k_type], k, v_type, unit, w, v))
    arch = "llama" if kind == "session" else None
    tokens = [rng.randrange(1000) for _ in range(n)]
    return LlamaState(kind, tokens, form, arch, 1, 0, 0, v_trans, layers)


@pytest.mark.parametrize("kind", ["session", "sequence"])
@pytest.mark.parametrize("form", ["plain", "server-v1"])
@pytest.mark.parametrize("v_trans", [False, True])
@pytest.mark.parametrize("types", [(1, 1), (0, 0), (30, 30), (1, 30)])
def test_every_layout_parses_back_to_the_same_bytes(kind, form, v_trans, types):
    state = forged(kind, form, v_trans, *types)
    data = write_state(state)
    back = parse_state(data)
    assert back == state
    assert write_state(back) == data


def test_the_byte_layout_is_llama_cpps():
    """Fields at the offsets llama.cpp writes them (docs/FORMAT.md): a sequence file of
    llama-server's packed token list."""
    state = forged("sequence", "server-v1", n=2)
    data = write_state(state)
    magic, version, n_words = struct.unpack_from("<III", data, 0)
    assert (magic, version) == (0x67677371, 3) and data[:4] == b"qsgg"
    words = struct.unpack_from(f"<{n_words}i", data, 12)
    assert words == (-1, 1, 2, *state.tokens, 0)
    at = 12 + 4 * n_words
    assert struct.unpack_from("<II", data, at) == (1, 2)  # one stream, two cells
    assert struct.unpack_from("<iIi", data, at + 8) == (0, 1, 0)  # pos 0, one seq, seq 0
    assert struct.unpack_from("<iIi", data, at + 20) == (1, 1, 0)
    at += 32
    assert struct.unpack_from("<IIiQ", data, at) == (0, 2, 1, 16)  # v_trans, layers, f16, row
    assert data[at + 20 : at + 20 + 32] == state.layers[0].k
    session = write_state(forged("session", n=2))
    assert session[:4] == b"nsgg" and struct.unpack_from("<I", session, 4)[0] == 10
    assert struct.unpack_from("<I5s", session, 12 + 8) == (5, b"llama")


def test_every_truncation_is_one_clear_error():
    data = write_state(forged("session", "server-v1", v_trans=True, n=3))
    for cut in range(len(data)):
        with pytest.raises(SeqkvError) as err:
            parse_state(data[:cut], "s.bin")
        assert str(err.value).startswith("s.bin: ") and "\n" not in str(err.value)


def test_byte_flips_parse_or_fail_in_one_line():
    data = bytearray(write_state(forged("sequence", "server-v1", n=3)))
    rng = random.Random(7)
    refused = 0
    for _ in range(600):
        bad = bytearray(data)
        for _ in range(rng.randrange(1, 4)):
            bad[rng.randrange(len(bad))] = rng.randrange(256)
        try:
            state = parse_state(bytes(bad))
        except SeqkvError as exc:
            assert "\n" not in str(exc)
            refused += 1
        else:
            assert write_state(state) == bytes(bad)  # what is accepted is kept exactly
    assert refused > 100


def _patch(data: bytes, offset: int, fmt: str, *values) -> bytes:
    out = bytearray(data)
    struct.pack_into(fmt, out, offset, *values)
    return bytes(out)


def test_hostile_fields_are_named():
    seq = write_state(forged("sequence", n=3))
    with pytest.raises(SeqkvError, match="sequence state version 2 is not supported"):
        parse_state(_patch(seq, 4, "<I", 2))
    with pytest.raises(SeqkvError, match="session state version 9 is not supported"):
        parse_state(_patch(write_state(forged("session")), 4, "<I", 9))
    with pytest.raises(SeqkvError, match=r"not a llama\.cpp state file"):
        parse_state(b"GGUF" + seq[4:])
    with pytest.raises(SeqkvError, match=r"truncated llama\.cpp state \(4000000000 tokens"):
        parse_state(_patch(seq, 8, "<I", 4_000_000_000))
    at = 12 + 4 * 3 + 8 + 12 * 3  # first layer's key type
    with pytest.raises(SeqkvError, match="key cache type q8_0 is not supported"):
        parse_state(_patch(seq, at + 8, "<i", 8))
    with pytest.raises(SeqkvError, match="cell 1 is at position 7"):
        parse_state(_patch(seq, 12 + 12 + 8 + 12, "<i", 7))
    with pytest.raises(SeqkvError, match="cells of sequences 0 and 3"):
        parse_state(_patch(seq, 12 + 12 + 8 + 12 + 8, "<i", 3))
    with pytest.raises(SeqkvError, match="belongs to 2 sequences"):
        parse_state(_patch(seq, 12 + 12 + 8 + 4, "<I", 2))
    with pytest.raises(SeqkvError, match="bytes after the KV cache"):
        parse_state(seq + b"\0" * 8)
    packed = forged("sequence", "server-v1", n=2)
    media = write_state(packed)
    with pytest.raises(SeqkvError, match="holds 1 media chunks"):
        parse_state(_patch(media, 12 + 4 * 5, "<i", 1))
    with pytest.raises(SeqkvError, match="negative token id"):
        parse_state(_patch(seq, 12 + 4, "<i", -5))


def test_a_state_whose_cache_does_not_cover_its_tokens_is_refused():
    state = forged("sequence", n=4)
    data = bytearray(write_state(state))
    struct.pack_into("<I", data, 8, 3)  # 3 tokens announced, 4 cells follow
    del data[12 + 12 : 12 + 16]
    with pytest.raises(SeqkvError, match="3 tokens but 4 cached positions"):
        parse_state(bytes(data))


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("v_trans", [True, False])
def test_kv_conversion_is_exact_both_ways(interleaved, v_trans):
    heads, hd, n = 2, 8, 5
    keys = [torch.randn(heads, n, hd).half() for _ in range(3)]
    values = [torch.randn(heads, n, hd).half() for _ in range(3)]
    layout = {
        "kind": "sequence",
        "token_form": "plain",
        "n_stream": 1,
        "stream": 0,
        "seq_id": 2,
        "v_trans": v_trans,
        "k_type": "f16",
        "v_type": "f16",
    }
    state = from_capture_kv(keys, values, list(range(n)), layout, interleaved)
    k2, v2 = to_capture_kv(parse_state(write_state(state)), heads, hd, interleaved)
    for a, b in zip(keys + values, k2 + v2, strict=True):
        assert torch.equal(a, b)
    if interleaved:  # llama.cpp pairs dims (2i, 2i+1) where transformers pairs (i, i+hd/2)
        row = torch.frombuffer(bytearray(state.layers[0].k[: hd * 2]), dtype=torch.float16)
        assert torch.equal(row[0::2], keys[0][0, 0, : hd // 2])
        assert torch.equal(row[1::2], keys[0][0, 0, hd // 2 :])


# -- import / export through the CLI on a tiny model --------------------------------------


def _llama_like_state(lm, tokens, *, seed=0, v_trans=False, form="server-v1", scale=0.02):
    """The model's recompute in llama.cpp's layout, perturbed by a few % (as llama.cpp's
    quantized activations move it) so the residual is not trivial."""
    from seqkv_cli.kvcapture.engine import run_capture

    cap = run_capture(lm, tokens, dtype="fp32")
    gen = torch.Generator().manual_seed(seed)

    def moved(t):
        return (t * (1 + scale * torch.randn(t.shape, generator=gen))).half()

    layout = {
        "kind": "sequence",
        "token_form": form,
        "n_stream": 1,
        "stream": 0,
        "seq_id": 0,
        "v_trans": v_trans,
        "k_type": "f16",
        "v_type": "f16",
    }
    keys = [moved(k) for k in cap.keys]
    values = [moved(v) for v in cap.values]
    return write_state(from_capture_kv(keys, values, tokens, layout, True))


def test_import_export_round_trip_on_a_tiny_model(tmp_path, tiny_model_dir, tiny_lm):
    system = [5 + (i * 7) % 200 for i in range(24)]
    files = []
    for i in range(3):
        tokens = system + [10 + (i * 31 + j * 3) % 200 for j in range(6 + i)]
        path = tmp_path / f"slot{i}.bin"
        path.write_bytes(_llama_like_state(tiny_lm, tokens, seed=i, v_trans=i == 1))
        files.append(path)
    archive = tmp_path / "slots.skv"
    result = invoke("import", "llama-state", *files, "-o", archive, "--model", tiny_model_dir)
    assert result.exit_code == 0, result.output
    assert "imported 3 state(s)" in result.stdout and "exact" in result.stderr
    listed = invoke("archive", "list", archive)
    assert listed.exit_code == 0 and "slot0" in listed.stdout and "slot2" in listed.stdout
    for i, path in enumerate(files):
        out = tmp_path / f"back{i}.bin"
        result = invoke(
            "export", "llama-state", archive, f"slot{i}", "-o", out, "--model", tiny_model_dir
        )
        assert result.exit_code == 0, result.output
        assert "byte-identical" in result.stdout
        assert out.read_bytes() == path.read_bytes()
    # The layout llama.cpp's context needs can be changed on export: same K/V, V transposed.
    out = tmp_path / "fa-off.bin"
    result = invoke(
        "export",
        "llama-state",
        archive,
        "slot0",
        "-o",
        out,
        "--flash-attn",
        "off",
        "--model",
        tiny_model_dir,
    )
    assert result.exit_code == 0, result.output
    a, b = parse_state(out.read_bytes()), parse_state(files[0].read_bytes())
    assert a.v_trans and not b.v_trans and a.tokens == b.tokens
    ka, va = to_capture_kv(a, tiny_lm.num_kv_heads, tiny_lm.head_dim, True)
    kb, vb = to_capture_kv(b, tiny_lm.num_kv_heads, tiny_lm.head_dim, True)
    assert all(torch.equal(x, y) for x, y in zip(ka + va, kb + vb, strict=True))


def test_tokens_only_import_exports_the_recompute(tmp_path, tiny_model_dir, tiny_lm):
    from seqkv_cli.kvcapture.engine import run_capture

    tokens = [3 + (j * 11) % 250 for j in range(20)]
    path = tmp_path / "s.bin"
    path.write_bytes(_llama_like_state(tiny_lm, tokens))
    archive = tmp_path / "t.skv"
    result = invoke(
        "import", "llama-state", path, "-o", archive, "--tokens-only", "--model", tiny_model_dir
    )
    assert result.exit_code == 0, result.output
    assert "tokens only" in result.stderr
    size = archive.stat().st_size
    assert size < len(path.read_bytes()) / 5
    out = tmp_path / "out.bin"
    result = invoke("export", "llama-state", archive, "s", "-o", out, "--model", tiny_model_dir)
    assert result.exit_code == 0 and "recompute" in result.stdout, result.output
    state = parse_state(out.read_bytes())
    assert state.tokens == tokens and state.token_form == "server-v1"
    keys, values = to_capture_kv(state, tiny_lm.num_kv_heads, tiny_lm.head_dim, True)
    cap = run_capture(tiny_lm, tokens, dtype="bf16")
    for got, want in zip(keys + values, cap.keys + cap.values, strict=True):
        assert torch.equal(got, want.half())  # the canonical bf16 recompute, in f16


def test_bad_imports_are_refused_and_write_nothing(tmp_path, tiny_model_dir, tiny_lm):
    tokens = [4 + j for j in range(12)]
    good = tmp_path / "good.bin"
    good.write_bytes(_llama_like_state(tiny_lm, tokens))
    archive = tmp_path / "a.skv"
    # K/V of another model (same shapes): far from this model's recompute.
    other = tmp_path / "other.bin"
    other.write_bytes(_llama_like_state(tiny_lm, tokens, scale=3.0))
    result = invoke("import", "llama-state", other, "-o", archive, "--model", tiny_model_dir)
    one_line_error(result, "a cache of another model?")
    assert not archive.exists()
    # A state with another layer count.
    state = parse_state(good.read_bytes())
    state.layers = state.layers[:1]
    short = tmp_path / "short.bin"
    short.write_bytes(write_state(state))
    result = invoke("import", "llama-state", short, "-o", archive, "--model", tiny_model_dir)
    one_line_error(result, "1 layers in the state, 2 in the model")
    # A session file of another architecture.
    state = parse_state(good.read_bytes())
    state.kind, state.arch = "session", "qwen2"
    qwen = tmp_path / "qwen.bin"
    qwen.write_bytes(write_state(state))
    result = invoke("import", "llama-state", qwen, "-o", archive, "--model", tiny_model_dir)
    one_line_error(result, "a state of a 'qwen2' model")
    # Truncated, the output among the inputs, two files that would be one id.
    (tmp_path / "cut.bin").write_bytes(good.read_bytes()[:-3])
    result = invoke(
        "import", "llama-state", tmp_path / "cut.bin", "-o", archive, "--model", tiny_model_dir
    )
    one_line_error(result, "truncated llama.cpp state")
    result = invoke("import", "llama-state", good, "-o", good, "--model", tiny_model_dir)
    one_line_error(result, "is also an input")
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "good.bin").write_bytes(good.read_bytes())
    result = invoke(
        "import",
        "llama-state",
        good,
        tmp_path / "d" / "good.bin",
        "-o",
        archive,
        "--model",
        tiny_model_dir,
    )
    one_line_error(result, "would both be session 'good'")
    assert not archive.exists() and sorted(p.name for p in tmp_path.iterdir()) == [
        "cut.bin",
        "d",
        "good.bin",
        "other.bin",
        "qwen.bin",
        "short.bin",
    ]
    # An id already in the archive is refused; the archive is left as it was.
    assert (
        invoke("import", "llama-state", good, "-o", archive, "--model", tiny_model_dir).exit_code
        == 0
    )
    before = archive.read_bytes()
    result = invoke("import", "llama-state", good, "-o", archive, "--model", tiny_model_dir)
    one_line_error(result, "already has a session 'good'")
    assert archive.read_bytes() == before
    result = invoke(
        "export", "llama-state", archive, "good", "-o", archive, "--model", tiny_model_dir
    )
    one_line_error(result, "is also an input")
    assert archive.read_bytes() == before


def _slots_sharing_a_prompt(lm, folder, *, same_prefix_kv: bool):
    """Three slot states of one 40-token prompt and their own 8-token turns; with
    `same_prefix_kv` the prompt's K/V are the same bits in every slot, as llama.cpp gives."""
    prompt = [5 + (i * 7) % 200 for i in range(40)]
    states = []
    for i in range(3):
        tokens = prompt + [10 + (i * 31 + j * 3) % 200 for j in range(8)]
        states.append(parse_state(_llama_like_state(lm, tokens, seed=i)))
    if same_prefix_kv:
        first = states[0]
        for state in states[1:]:
            for mine, theirs in zip(state.layers, first.layers, strict=True):
                cut = 40 * mine.k_row_bytes
                mine.k = theirs.k[:cut] + mine.k[cut:]
                cut = 40 * mine.v_unit
                mine.v = theirs.v[:cut] + mine.v[cut:]
    paths = []
    for i, state in enumerate(states):
        path = folder / f"slot{i}.bin"
        path.write_bytes(write_state(state))
        paths.append(path)
    return paths


def test_a_shared_prompts_kv_is_stored_once(tmp_path, tiny_model_dir, tiny_lm):
    from seqkv_cli.archive import session_rows

    own = {}
    for same in (True, False):
        folder = tmp_path / f"same-{same}"
        folder.mkdir()
        paths = _slots_sharing_a_prompt(tiny_lm, folder, same_prefix_kv=same)
        archive = folder / "a.skv"
        result = invoke("import", "llama-state", *paths, "-o", archive, "--model", tiny_model_dir)
        assert result.exit_code == 0, result.output
        rows, _ = session_rows(archive)
        own[same] = [r["own_bytes"] for r in rows]
        for i, path in enumerate(paths):  # exact either way
            out = folder / f"out{i}.bin"
            result = invoke(
                "export", "llama-state", archive, f"slot{i}", "-o", out, "--model", tiny_model_dir
            )
            assert result.exit_code == 0 and out.read_bytes() == path.read_bytes(), result.output
    # The first slot pays for the prompt's residual in both; the others only with other bits.
    assert own[True][0] == pytest.approx(own[False][0], rel=0.05)
    for i in (1, 2):
        assert own[True][i] < 0.5 * own[False][i]


def test_a_residual_resting_on_a_later_session_fails_alone(tmp_path, tiny_model_dir, tiny_lm):
    """Checksums valid, the based part names slot 2 (a later session) for slot 1: slot 1 is
    refused in one line, slots 0 and 2 still restore."""
    from forge import put_together, take_apart
    from seqkv_cli.archive import Archive
    from seqkv_codecs.residual import parse_based

    paths = _slots_sharing_a_prompt(tiny_lm, tmp_path, same_prefix_kv=True)
    archive = tmp_path / "a.skv"
    result = invoke("import", "llama-state", *paths, "-o", archive, "--model", tiny_model_dir)
    assert result.exit_code == 0, result.output
    header, sections = take_apart(archive)
    name = next(n for n in sections if "/s1/residual." in n)
    assert parse_based(sections[name])[:2] == (0, 40)
    forged = bytearray(sections[name])
    struct.pack_into("<I", forged, 8, 2)
    sections[name] = bytes(forged)
    bad = tmp_path / "bad.skv"
    bad.write_bytes(put_together(header, sections))
    with Archive(bad, model=tiny_lm) as arc:
        results = {e["id"]: r for e, r in arc.restore_many(arc.sessions)}
    assert isinstance(results["slot1"], SeqkvError)
    assert "rests on sessions [0, 2] of its segment; one earlier" in str(results["slot1"])
    for sid in ("slot0", "slot2"):
        assert not isinstance(results[sid], Exception)
    # The same part in a file without a trie (a based residual where none may be) is refused.
    from seqkv_cli.sequential.session_codec import finish_capture

    entry = {"id": "x", "dtype": "fp16"}
    with pytest.raises(SeqkvError, match="rests on another session"):
        finish_capture(
            entry,
            lambda part: bytes(forged),
            [1, 2],
            [torch.zeros(2, 2, 16)],
            [torch.zeros(2, 2, 16)],
            torch.zeros(1),
        )
