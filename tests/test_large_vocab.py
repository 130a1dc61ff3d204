"""Vocabularies of 150k-260k tokens (issue 36): every codec family and every path that stores
token ids round-trips sessions whose ids pass 65,536, bit for bit, on tiny random models of
Qwen2.5's (151,936) and Gemma's (256,000) vocabulary size.

Before entropy stream version 2, `seq-fast` and every per-vector trie archive of such a model
stopped with a ValueError traceback (`alphabet_size must be an integer in 1..65536`): the
static rANS table held at most 2**16 symbols. Spans layers (capture, sequential, trie, skv,
archive), hence top level."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from cli_run import assert_error, invoke
from conftest import build_tiny_model
from seqkv_cli.archive import Archive, compress_captures, same_capture
from seqkv_cli.kvcapture.api import capture
from seqkv_cli.kvcapture.capture_file import load_capture

VOCABS = (151_936, 256_000)
# the smallest shape the portable path runs: the forward is negligible next to the vocabulary
SHAPE = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
}


@pytest.fixture(scope="module", params=VOCABS, ids=lambda v: f"V{v}")
def world(request, tmp_path_factory):
    """A model of the vocabulary and captures of sessions whose ids mostly pass 65,536: two
    share a prompt, one is a prefix of it; `near` is a near-duplicate of `long` (one id edited
    early: the 64 aligned tokens past the exact prefix make it an edit script)."""
    from seqkv_cli.runtime.loading import load_model

    vocab = request.param
    folder = tmp_path_factory.mktemp(f"vocab{vocab}")
    lm = load_model(str(build_tiny_model(folder / "model", vocab_size=vocab, **SHAPE)))
    rng = np.random.default_rng(vocab)

    def ids(n: int) -> list[int]:
        return rng.integers(0, vocab, n).tolist()

    # both ends of the vocabulary and of the first 16-bit block
    prompt = [vocab - 1, 0, 65_535, 65_536, *ids(16)]
    sessions = {"a": prompt + ids(6), "b": prompt + ids(5), "c": prompt[:9]}
    paths = _captures(lm, sessions, folder / "caps")
    long = ids(72)
    near = _captures(lm, {"long": long, "near": [*long[:2], *ids(1), *long[3:]]}, folder / "nd")
    assert max(max(v) for v in sessions.values()) >= 1 << 17  # ids past two 16-bit blocks
    return lm, paths, near


def _captures(lm, sessions: dict, folder) -> dict:
    folder.mkdir()
    rows = folder / "rows.jsonl"
    lines = [json.dumps({"id": k, "token_ids": v}) + "\n" for k, v in sessions.items()]
    rows.write_text("".join(lines))
    results = capture([str(rows)], model=lm, out=folder, dtype="bf16")
    return {r.document.id: r.path for r in results}


def _compress(paths: dict, out, codec, lm=None, **kw):
    """check=False: every test restores the file and compares it bit for bit itself."""
    return compress_captures(list(paths.values()), out, codec=codec, model=lm, check=False, **kw)


def _restore_all(path, lm) -> dict:
    with Archive(path, model=lm) as arc:
        return {e["id"]: r for e, r in arc.restore_many(arc.sessions)}


def _exact(path, lm, paths: dict) -> None:
    got = _restore_all(path, lm)
    assert sorted(got) == sorted(paths)
    for sid, p in paths.items():
        assert same_capture(load_capture(p), got[sid]), sid


def _tokens_exact(path, lm, paths: dict) -> None:
    """Lossy per-vector codecs: the ids (and surprisal) are exact, the K/V within bounds."""
    got = _restore_all(path, lm)
    for sid, p in paths.items():
        cap = load_capture(p)
        assert got[sid].tokens.tolist() == cap.tokens.tolist(), sid


@pytest.mark.parametrize("codec", ["seq", "seq-fast"])
@pytest.mark.parametrize("layout", ["trie", "flat"])
def test_model_codecs_round_trip(world, tmp_path, codec, layout):
    lm, paths, _ = world
    out = tmp_path / "a.skv"
    _compress(paths, out, codec, lm, layout=layout)
    _exact(out, lm, paths)


def _smaller_of_both(data: bytes, alphabet: int) -> None:
    """A model-free segment stream of ids past 65,536: the smaller of the ids packed at their
    width and a version-2 entropy stream (16-bit planes) of the same ids, both exact."""
    from seqkv_codecs.entropy import decode_symbols, encode_symbols
    from seqkv_codecs.packed_ids import is_packed, pack_ids, unpack_ids

    ids = unpack_ids(data, 1 << 24) if is_packed(data) else decode_symbols(data)
    wide = encode_symbols(ids, alphabet)
    assert int(ids.max()) >= 65_536 and wide[0] == 2
    assert int.from_bytes(wide[4:8], "little") == alphabet
    assert np.array_equal(decode_symbols(wide), ids)
    assert data == min(pack_ids(ids), wide, key=len)


def test_seq_fast_tokens_are_packed_or_a_version_2_entropy_stream(world, tmp_path):
    """seq-fast's alphabet is the vocabulary: past 65,536 a static stream is version 2, and
    the segment keeps it where it is smaller than the packed ids (format 1.7)."""
    lm, paths, _ = world
    out = tmp_path / "a.skv"
    _compress(paths, out, "seq-fast", lm, layout="trie")
    with Archive(out, model=lm) as arc:
        data = arc.read_part(1, "tokens")
    _smaller_of_both(data, lm.vocab_size)


@pytest.mark.parametrize("codec", ["seq", "seq-fast"])
def test_compact_single_session(world, tmp_path, codec):
    lm, paths, _ = world
    out = tmp_path / "one.skv"
    result = _compress({"a": paths["a"]}, out, codec, lm)
    assert result.layout == "compact"
    _exact(out, lm, {"a": paths["a"]})


def test_seq_parallel_runs(world, tmp_path):
    lm, paths, _ = world
    out = tmp_path / "p.skv"
    _compress(paths, out, {"id": "seq", "parallel": 3}, lm)
    _exact(out, lm, paths)


@pytest.mark.parametrize("codec", ["seq", "seq-fast"])
def test_near_duplicate_edit_scripts(world, tmp_path, codec):
    lm, _, paths = world
    out = tmp_path / "n.skv"
    _compress(paths, out, codec, lm, near_dup=True)
    with Archive(out, model=lm) as arc:
        assert arc.session("near")["trie"]["centroid"] is not None  # stored as edits
    _exact(out, lm, paths)


@pytest.mark.parametrize("codec", ["raw", "lossless"])
def test_lossless_per_vector_codecs(world, tmp_path, codec):
    _, paths, _ = world
    for layout in ("trie", "flat"):
        out = tmp_path / f"{layout}.skv"
        _compress(paths, out, codec, layout=layout)
        _exact(out, None, paths)


@pytest.mark.parametrize("codec", ["int8", "kivi2", "turbo3"])
def test_lossy_per_vector_codecs_keep_the_ids(world, tmp_path, codec):
    _, paths, _ = world
    out = tmp_path / "t.skv"
    _compress(paths, out, codec, layout="trie")
    with Archive(out) as arc:
        data = arc.read_part(1, "tokens")
    ids = np.concatenate([load_capture(p).tokens.numpy() for p in paths.values()])
    _smaller_of_both(data, int(ids.max()) + 1)  # the segment's largest id passes 65,536
    _tokens_exact(out, None, paths)


@pytest.mark.parametrize("codec", ["seq", "seq-fast", "lossless"])
def test_archive_add_and_compact(world, tmp_path, codec):
    """Appending codes new ids against the stored trie; compact rewrites it all."""
    lm, paths, _ = world
    out = tmp_path / "g.skv"
    _compress({"a": paths["a"]}, out, codec, lm, layout="trie")
    model = ["--model", str(lm.folder)] if codec != "lossless" else []
    for sid in ("b", "c"):
        result = invoke("archive", "add", out, paths[sid], *model)
        assert result.exit_code == 0, result.output
    _exact(out, lm, paths)
    result = invoke("archive", "compact", out, *model)
    assert result.exit_code == 0, result.output
    _exact(out, lm, paths)


def test_report_and_verify(world, tmp_path):
    """`seqkv verify` and `seqkv report` (codecs computed from the captures, and the file's own
    rows) over sessions of such ids."""
    lm, paths, _ = world
    out = tmp_path / "r.skv"
    _compress(paths, out, "seq", lm)
    result = invoke("verify", out, "--against", paths["a"], "--model", str(lm.folder))
    assert result.exit_code == 0, result.output
    codecs = "seq,seq-fast,lossless,int8,turbo3"
    args = ("--codecs", codecs, "--json", tmp_path / "r.json", "--model", str(lm.folder))
    result = invoke("report", paths["a"], paths["b"], out, *args)
    assert result.exit_code == 0, result.output
    rows = json.loads((tmp_path / "r.json").read_text())["sessions"]
    computed = {(r["codec"], r["id"]): r for r in rows if r["source"] == "computed"}
    # seq rows come from the file (the report does not compute what a given file holds)
    assert set(computed) == {(c, s) for c in codecs.split(",")[1:] for s in ("a", "b")}
    for (codec, sid), row in computed.items():
        assert row["positions"] == len(load_capture(paths[sid]).tokens)
        assert row["exact"] is (codec != "int8" and codec != "turbo3"), (codec, sid)
    from_file = {r["id"]: r for r in rows if r["source"] == str(out)}
    assert set(from_file) == set(paths) and from_file["a"]["exact"] and from_file["b"]["exact"]


@pytest.mark.parametrize(
    ("codec", "vocab", "fragment"),
    [
        ("seq", 1 << 24, "a 16,777,216-symbol vocabulary does not fit 24-bit frequency tables"),
        ("seq-fast", 1 << 32, "an entropy stream holds at most 2**32 - 1 symbols"),
    ],
)
def test_vocabulary_past_a_hard_limit_is_one_line(
    world, tmp_path, monkeypatch, codec, vocab, fragment
):
    """Where a limit remains (seq's 24-bit tables: 2**24 - 1 tokens; the entropy stream's
    u32 alphabet: 2**32 - 1), `seqkv compress` refuses in one line. No model that large
    fits a test, so the coder is told this model's vocabulary is that large."""
    from seqkv_cli.sequential.adapter import CanonicalLogits

    lm, paths, _ = world
    real = CanonicalLogits.__init__

    def huge(self, canon) -> None:
        real(self, canon)
        self.vocab_size = vocab

    monkeypatch.setattr(CanonicalLogits, "__init__", huge)
    out = tmp_path / "x.skv"
    args = ("--codec", codec, "--layout", "flat", "--model", lm.folder)  # the adapter's vocabulary
    result = invoke("compress", paths["a"], "-o", out, *args)
    assert_error(result, fragment)
    assert not out.exists()


def test_llama_cpp_state_files(world, tmp_path):
    """llama.cpp slot files (token lists of int32 ids) import into a trie archive, exactly and
    tokens-only, and export byte-identical: their ids go through the same `seq` coder."""
    from seqkv_cli.kvcapture.engine import run_capture
    from seqkv_cli.llamacpp.convert import from_capture_kv
    from seqkv_cli.llamacpp.state_file import parse_state, write_state

    lm, paths, _ = world
    tokens = load_capture(paths["a"]).tokens.tolist()
    cap = run_capture(lm, tokens, dtype="fp32")
    gen = torch.Generator().manual_seed(0)

    def moved(t):  # llama.cpp's numerics sit a few % from the recompute
        return (t * (1 + 0.02 * torch.randn(t.shape, generator=gen))).half()

    layout = {
        "kind": "sequence",
        "token_form": "server-v1",
        "n_stream": 1,
        "stream": 0,
        "seq_id": 0,
        "v_trans": False,
        "k_type": "f16",
        "v_type": "f16",
    }
    keys, values = [moved(k) for k in cap.keys], [moved(v) for v in cap.values]
    slot = tmp_path / "slot.bin"
    slot.write_bytes(write_state(from_capture_kv(keys, values, tokens, layout, True)))
    for mode in ([], ["--tokens-only"]):
        archive = tmp_path / f"slots{len(mode)}.skv"
        result = invoke("import", "llama-state", slot, "-o", archive, *mode, "--model", lm.folder)
        assert result.exit_code == 0, result.output
        out = tmp_path / f"back{len(mode)}.bin"
        result = invoke("export", "llama-state", archive, "slot", "-o", out, "--model", lm.folder)
        assert result.exit_code == 0, result.output
        assert parse_state(out.read_bytes()).tokens == tokens
        assert (out.read_bytes() == slot.read_bytes()) is not mode  # exact mode: the same bytes
