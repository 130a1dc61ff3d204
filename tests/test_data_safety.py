"""Issue 13 (A): no command destroys a user's file, malformed captures and hostile ids are
refused in one line, and writes are atomic and clean up only what they created.

Most cases use synthetic captures (random K/V, per-vector codecs: no model needed).
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from cli_run import assert_error, invoke
from seqkv_cli.kvcapture.capture_file import Capture, load_capture, save_capture


def synthetic(session_id: str, n: int = 12, tokens=None, dtype=torch.bfloat16) -> Capture:
    gen = torch.Generator().manual_seed(len(session_id) * 31 + n)
    tokens = torch.arange(1, n + 1) if tokens is None else torch.tensor(tokens)
    n = len(tokens)
    keys = [torch.randn(2, n, 8, generator=gen).to(dtype) for _ in range(2)]
    values = [torch.randn(2, n, 8, generator=gen).to(dtype) for _ in range(2)]
    meta = {
        "session_id": session_id,
        "dtype": {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "fp32"),
        "positions": n,
        "num_layers": 2,
        "num_kv_heads": 2,
        "head_dim": 8,
        "model_name": "synthetic",
        "model_fingerprint": "0" * 64,
        "tokenizer_fingerprint": "0" * 64,
        "numeric_path": "synthetic",
    }
    surprisal = torch.rand(max(n - 1, 0), generator=gen, dtype=torch.float64)
    return Capture(tokens, keys, values, surprisal, meta)


def write(folder: Path, session_id: str, name: str | None = None, **kw) -> Path:
    path = folder / f"{name or 'cap'}.safetensors"
    save_capture(synthetic(session_id, **kw), path)
    return path


# -- 1. an output that is also an input ---------------------------------------------------


@pytest.mark.parametrize("layout", ["trie", "flat"])
def test_compress_refuses_an_output_that_is_one_of_its_inputs(tmp_path, layout):
    cap = write(tmp_path, "a", "a")
    before = cap.read_bytes()
    result = invoke("compress", cap, "-o", cap, "--codec", "raw", "--layout", layout)
    assert_error(result, "is also an input")
    (tmp_path / "sub").mkdir()
    other = tmp_path / "sub" / ".." / "a.safetensors"  # the same file by another name
    assert_error(invoke("compress", cap, "-o", other, "--codec", "raw"), "is also an input")
    assert cap.read_bytes() == before


def test_extract_refuses_to_write_over_its_archive(tmp_path):
    caps = [write(tmp_path, "a", "a"), write(tmp_path, "b", "b", n=9)]
    skv = tmp_path / "x.skv"
    assert invoke("compress", *caps, "-o", skv, "--codec", "raw").exit_code == 0
    before = skv.read_bytes()
    assert_error(invoke("archive", "extract", skv, "a", "-o", skv), "is also an input")
    assert skv.read_bytes() == before


def test_report_refuses_a_json_output_that_is_an_input(tmp_path):
    cap = write(tmp_path, "a", "a")
    before = cap.read_bytes()
    result = invoke("report", cap, "--codecs", "raw", "--json", cap)
    assert_error(result, "is also an input")
    assert cap.read_bytes() == before


def test_capture_refuses_an_output_that_is_its_input(tiny_model_dir, tmp_path):
    text = tmp_path / "notes.safetensors"  # a text file that happens to have this suffix
    text.write_text("precious notes, not a capture")
    result = invoke("capture", text, "-o", text, "--model", tiny_model_dir)
    assert_error(result, "is also an input")
    assert text.read_text() == "precious notes, not a capture"


def test_failed_decompress_deletes_only_what_it_created(tmp_path, monkeypatch):
    import safetensors.torch

    caps = [write(tmp_path, "a", "a"), write(tmp_path, "b", "b", n=9)]
    skv = tmp_path / "x.skv"
    assert invoke("compress", *caps, "-o", skv, "--codec", "raw", "--layout", "flat").exit_code == 0
    out = tmp_path / "mine"
    out.mkdir()
    (out / "a.safetensors").write_bytes(b"the user's own a")
    (out / "keep.txt").write_text("unrelated")
    real, calls = safetensors.torch.save_file, []

    def disk_full_on_second(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(*args, **kwargs)

    monkeypatch.setattr(safetensors.torch, "save_file", disk_full_on_second)
    assert_error(invoke("decompress", skv, "-o", out), "No space left on device")
    assert (out / "a.safetensors").read_bytes() == b"the user's own a"
    assert sorted(p.name for p in out.iterdir()) == ["a.safetensors", "keep.txt"]
    calls.clear()
    fresh = tmp_path / "new" / "deeper"
    assert_error(invoke("decompress", skv, "-o", fresh), "No space left on device")
    assert not (tmp_path / "new").exists()  # the directories it made are gone too


def test_compact_refuses_to_quantize_a_lossy_archive_again(tmp_path):
    caps = [write(tmp_path, "a", "a", n=20), write(tmp_path, "b", "b", n=16)]
    skv = tmp_path / "x.skv"
    assert invoke("compress", *caps, "-o", skv, "--codec", "turbo3").exit_code == 0
    before = skv.read_bytes()
    assert_error(invoke("archive", "compact", skv), "lossy codec turbo3")
    assert skv.read_bytes() == before


# -- 2. session ids that map to one file name ---------------------------------------------

HOSTILE_IDS = ["a b", "a_b", "x/y", "x_y", ".", "..", "é" * 150, "z" * 300, "../../etc/passwd"]


def test_ids_that_sanitise_alike_get_files_of_their_own(tmp_path):
    caps = [write(tmp_path, sid, f"c{i}", n=5 + i) for i, sid in enumerate(HOSTILE_IDS)]
    skv = tmp_path / "x.skv"
    assert invoke("compress", *caps, "-o", skv, "--codec", "raw").exit_code == 0
    out = tmp_path / "out"
    result = invoke("decompress", skv, "-o", out)
    assert result.exit_code == 0, result.output
    assert f"restored {len(HOSTILE_IDS)} session(s)" in result.stdout
    files = list(out.iterdir())
    assert len(files) == len(HOSTILE_IDS)
    assert all(len(f.name.encode()) <= 255 and f.parent == out for f in files)
    assert sorted(load_capture(f).session_id for f in files) == sorted(HOSTILE_IDS)


def test_ids_whose_files_collide_are_refused_naming_both():
    from seqkv_cli.errors import SeqkvError
    from seqkv_cli.kvcapture.inputs import file_stem_for, unique_stems

    assert file_stem_for("prose") == "prose"  # ordinary ids keep their plain names
    assert file_stem_for("a b") != file_stem_for("a_b")
    assert file_stem_for(".") != file_stem_for("..")
    with pytest.raises(SeqkvError, match="sessions 'Chat' and 'chat' would both be written"):
        unique_stems(["Chat", "chat"])


# -- 3. malformed captures ------------------------------------------------------------------


def _forge(path: Path, meta_patch: dict, tensor_patch: dict) -> Path:
    from safetensors import safe_open
    from safetensors.torch import save_file

    good = path.parent / "good.safetensors"
    save_capture(synthetic("s"), good)
    with safe_open(str(good), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (not a dict)
        meta = dict(f.metadata())
    meta.update(meta_patch)
    for key in [k for k, v in meta.items() if v is None]:
        del meta[key]
    tensors.update(tensor_patch)
    save_file(tensors, str(path), metadata=meta)
    return path


N = 12
MALFORMED = {
    "format_version": ({"format_version": "abc"}, {}, "format_version"),
    "1-D key": ({}, {"layers.0.key": torch.zeros(N, dtype=torch.bfloat16)}, "layers.0.key"),
    "no positions": ({"positions": None}, {}, "lacks 'positions'"),
    "no dtype": ({"dtype": None}, {}, "lacks 'dtype'"),
    "positions a string": ({"positions": '"12"'}, {}, "positions"),
    "num_layers 1e400": ({"num_layers": "1e400"}, {}, "num_layers"),
    "num_layers x": ({"num_layers": "x"}, {}, "num_layers"),
    "dtype int4": ({"dtype": "int4"}, {}, "'int4' is not one of"),
    "dtype disagrees": ({"dtype": "fp16"}, {}, "is bfloat16, but the capture says fp16"),
    "layers disagree": ({"num_layers": "3"}, {}, "num_layers=3, the tensors have 2"),
    "positions disagree": ({"positions": "13"}, {}, "says 13 positions"),
    "int32 keys": ({}, {"layers.0.key": torch.zeros(2, N, 8, dtype=torch.int32)}, "int32"),
    "token -1": ({}, {"tokens": torch.tensor([-1] + [5] * (N - 1))}, "token id -1"),
    "token 2^32": ({}, {"tokens": torch.tensor([2**32] + [5] * (N - 1))}, "out of range"),
    "float tokens": ({}, {"tokens": torch.zeros(N)}, "1-D integers"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
@pytest.mark.parametrize("layout", ["trie", "flat"])
def test_malformed_captures_are_refused_in_one_line(tmp_path, case, layout):
    meta_patch, tensor_patch, fragment = MALFORMED[case]
    bad = _forge(tmp_path / "bad.safetensors", meta_patch, tensor_patch)
    out = tmp_path / "x.skv"
    result = invoke("compress", bad, "-o", out, "--codec", "raw", "--layout", layout)
    assert_error(result, fragment)
    assert not out.exists()


def test_negative_token_ids_never_wrap_into_a_file(tmp_path):
    """Before: -1 was stored as 4294967295 and `verify --against` still said exact."""
    from seqkv_cli.errors import SeqkvError
    from seqkv_cli.kvcapture.capture_file import tokens_as_u4

    with pytest.raises(SeqkvError, match=r"0\.\.2\^32-1"):
        tokens_as_u4(torch.tensor([3, -1]), "session s")
    assert tokens_as_u4(torch.tensor([1, 2**32 - 1]), "s") == b"\x01\0\0\0\xff\xff\xff\xff"


def test_seq_trie_refuses_token_ids_outside_the_vocabulary(tiny_lm, tmp_path):
    cap = synthetic("s", tokens=[1, 2, tiny_lm.vocab_size, 4])
    cap.meta["model_fingerprint"] = tiny_lm.fingerprint
    save_capture(cap, tmp_path / "v.safetensors")
    result = invoke(
        "compress", tmp_path / "v.safetensors", "-o", tmp_path / "v.skv", "--model", tiny_lm.folder
    )
    assert_error(result, f"token ids must lie in [0, {tiny_lm.vocab_size})")


# -- 4. markup and terminal escapes in ids and paths ---------------------------------------


def test_markup_and_escape_sequences_in_ids_and_paths_are_printed_inertly(tmp_path):
    hostile = "[/x][bold]\x1b]0;owned\x07\x1b[31mred"
    folder = tmp_path / "d[" / "x]"  # the path reads ".../d[/x]/..."
    folder.mkdir(parents=True)
    cap = write(folder, hostile, "c[bold]")
    skv = folder / "m[red].skv"
    results = [
        invoke("compress", cap, "-o", skv, "--codec", "raw"),
        invoke("archive", "list", skv),
        invoke("decompress", skv, "-o", folder / "out[b]"),
        invoke("archive", "extract", skv, hostile, "-o", folder / "one[i].safetensors"),
    ]
    for result in results:
        assert result.exit_code == 0, (result.output, result.exception)
        assert "\x1b" not in result.output and "\x07" not in result.output
    assert "d[/x]/out[b]" in results[2].stdout and "[/x][bold]\\x1b]0" in results[2].stdout
    assert_error(invoke("info", folder / "missing[red].skv"), "d[/x]/missing[red].skv")


# -- 5. atomicity: staging names, stale files, real errors, permissions ---------------------


def test_two_compresses_to_one_output_do_not_publish_each_others_file(tmp_path, monkeypatch):
    import seqkv_cli.archive.create as create

    a, b = write(tmp_path, "a", "a"), write(tmp_path, "b", "b", n=9)
    out = tmp_path / "x.skv"
    real = create.verify_against
    other: list = []
    raced = []

    def verify_then_race(path, *args):
        real(path, *args)
        if not raced:  # while A is between write and publish, B runs to the end
            raced.append(1)
            from seqkv_cli.archive import compress_captures

            worker = threading.Thread(
                target=lambda: other.append(compress_captures([b], out, codec="raw"))
            )
            worker.start()
            worker.join()

    monkeypatch.setattr(create, "verify_against", verify_then_race)
    result = invoke("compress", a, "-o", out, "--codec", "raw")
    assert result.exit_code == 0, result.output
    assert other, "the racing compress failed"
    from seqkv_cli.archive import Archive

    with Archive(out) as arc:  # A published last: its own file, whole
        assert [e["id"] for e in arc.sessions] == ["a"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".x.skv")]


def test_staging_files_of_dead_writers_are_removed(tmp_path):
    from seqkv_cli.fsutil import host_tag as _host_tag

    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        text=True,
        capture_output=True,
        check=True,
    )
    dead_pid = int(dead.stdout)
    stale = tmp_path / f".x.skv.{_host_tag()}-{dead_pid}-0badc0de.staging"
    stale_tmp = tmp_path / f"..x.skv.{_host_tag()}-{dead_pid}-0badc0de.staging.123.tmp"
    live = tmp_path / f".x.skv.{_host_tag()}-{os.getppid()}-feedf00d.staging"
    for p in (stale, stale_tmp, live):
        p.write_bytes(b"left by a killed compress")
    cap = write(tmp_path, "a", "a")
    assert invoke("compress", cap, "-o", tmp_path / "x.skv", "--codec", "raw").exit_code == 0
    assert not stale.exists() and not stale_tmp.exists() and live.exists()


def test_a_read_only_output_shows_the_real_error_not_the_cleanup(tmp_path, monkeypatch):
    folder = tmp_path / "ro"
    folder.mkdir()
    cap = write(tmp_path, "a", "a")
    real_open, real_unlink = os.open, Path.unlink

    def read_only_open(path, flags, *args, **kwargs):
        if str(path).startswith(str(folder)) and flags & os.O_CREAT:
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return real_open(path, flags, *args, **kwargs)

    def read_only_unlink(self, missing_ok=False):
        if str(self).startswith(str(folder)):
            raise OSError(errno.EROFS, "Read-only file system", str(self))
        return real_unlink(self, missing_ok=missing_ok)

    monkeypatch.setattr(os, "open", read_only_open)
    monkeypatch.setattr(Path, "unlink", read_only_unlink)
    result = invoke("compress", cap, "-o", folder / "x.skv", "--codec", "raw")
    assert_error(result, "Read-only file system")


def test_capture_files_get_the_umasks_permissions(tmp_path):
    old = os.umask(0o022)
    try:
        path = write(tmp_path, "a", "a")
    finally:
        os.umask(old)
    assert path.stat().st_mode & 0o777 == 0o644
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_save_capture_keeps_its_own_format_marker(tmp_path):
    cap = synthetic("s")
    cap.meta["format_version"] = "999"  # metadata cannot override the file's format version
    save_capture(cap, tmp_path / "c.safetensors")
    assert load_capture(tmp_path / "c.safetensors").positions == 12


# -- 6. no flock, torn tails ---------------------------------------------------------------


def test_append_without_flock_refuses_clearly(tmp_path, monkeypatch):
    import seqkv_cli.container.append as append

    a, b = write(tmp_path, "a", "a"), write(tmp_path, "b", "b", n=9)
    skv = tmp_path / "x.skv"
    assert invoke("compress", a, "-o", skv, "--codec", "raw").exit_code == 0
    monkeypatch.setattr(append, "fcntl", None)  # what Windows has
    assert_error(invoke("archive", "add", skv, b), "no flock")


def test_add_after_a_torn_tail_reports_the_bytes_it_added(tmp_path):
    from seqkv_cli.archive import add_captures

    a, b = write(tmp_path, "a", "a"), write(tmp_path, "b", "b", n=30, tokens=list(range(30)))
    skv = tmp_path / "x.skv"
    assert invoke("compress", a, "-o", skv, "--codec", "raw").exit_code == 0
    committed = skv.stat().st_size
    with open(skv, "ab") as f:
        f.write(b"\0" * 500)  # what a killed `archive add` leaves past the committed end
    res = add_captures(skv, [b])
    assert res.added_bytes == res.file_bytes - committed > 500
