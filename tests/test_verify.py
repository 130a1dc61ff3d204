"""Issue 13 (B): one verifier (`archive/verify.py`) behind compress, verify, pipeline, compact and
report; and the leftovers of part A (markup in info/verify, pipeline outputs, writer
temporaries, the GGUF conversion)."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

from seqkv_cli.archive import check_restored, restored_problems
from seqkv_cli.errors import SeqkvError
from seqkv_cli.kvcapture.capture_file import Capture
from test_data_safety import assert_error, invoke, synthetic, write


@dataclasses.dataclass
class FakeCodec:
    codec_id: str = "fake"
    lossless: bool = False
    tolerance: float | None = None


def altered(cap: Capture, **changes) -> Capture:
    fields = {
        "tokens": cap.tokens.clone(),
        "keys": [k.clone() for k in cap.keys],
        "values": [v.clone() for v in cap.values],
        "surprisal": cap.surprisal.clone(),
        "meta": dict(cap.meta),
    }
    fields.update(changes)
    return Capture(**fields)


# -- the check itself -----------------------------------------------------------------------


def test_an_exact_copy_passes_every_codec_kind():
    cap = synthetic("a")
    for codec in (FakeCodec(lossless=True), FakeCodec(), FakeCodec(tolerance=1e-3)):
        assert restored_problems(cap, altered(cap), codec) == []
        check_restored(cap, altered(cap), codec)


def test_lossless_needs_every_bit_lossy_per_vector_only_the_structure():
    cap = synthetic("a")
    keys = [k.clone() for k in cap.keys]
    keys[1][0, 3, 2] += 0.5
    off = altered(cap, keys=keys)
    assert restored_problems(cap, off, FakeCodec())[:1] == []  # measured, not judged
    [problem] = restored_problems(cap, off, FakeCodec(lossless=True))
    assert problem.startswith("not bit-exact (max abs error 0.5")
    [problem] = restored_problems(cap, off, FakeCodec(tolerance=0.1))
    assert problem == "max abs error 0.5 above the tolerance 0.1"
    assert restored_problems(cap, off, FakeCodec(tolerance=1.0)) == []


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        (lambda c: {"tokens": c.tokens.flip(0)}, "tokens differ (first at position 0)"),
        (lambda c: {"tokens": c.tokens[:-1]}, "11 tokens instead of 12"),
        (lambda c: {"surprisal": c.surprisal + 1}, "surprisal differs"),
        (lambda c: {"keys": c.keys[:1]}, "1/2 K/V layers instead of 2/2"),
        (lambda c: {"values": [c.values[0][:, :-1], c.values[1]]}, "layer 0 value shape"),
        (lambda c: {"keys": [c.keys[0].float(), c.keys[1]]}, "layer 0 key dtype"),
    ],
)
def test_every_codec_kind_refuses_other_tokens_surprisal_shapes_or_dtypes(change, fragment):
    cap = synthetic("a")
    bad = altered(cap, **change(cap))
    for codec in (FakeCodec(lossless=True), FakeCodec(), FakeCodec(tolerance=1.0)):
        with pytest.raises(SeqkvError, match="session a did not round-trip through fake: ") as e:
            check_restored(cap, bad, codec, "nothing written")
        assert fragment in str(e.value) and str(e.value).endswith("; nothing written")


# -- compress (trie, lossy): today's code compared nothing ----------------------------------


def _tamper_restores(monkeypatch, change):
    from seqkv_cli.archive import Archive

    real = Archive.restore_many

    def tampered(self, entries, *args, **kw):
        for entry, restored in real(self, entries, *args, **kw):
            yield entry, altered(restored, **change(restored))

    monkeypatch.setattr(Archive, "restore_many", tampered)


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        (lambda r: {"keys": [r.keys[0][:, :-1], r.keys[1]]}, "layer 0 key shape (2, 11, 8)"),
        (lambda r: {"tokens": r.tokens + 1}, "tokens differ"),
    ],
)
def test_a_trie_lossy_archive_that_restores_wrong_is_not_written(
    tmp_path, monkeypatch, change, fragment
):
    cap = write(tmp_path, "a", "a")
    out = tmp_path / "x.skv"
    _tamper_restores(monkeypatch, change)
    result = invoke("compress", cap, "-o", out, "--codec", "turbo3", "--layout", "trie")
    assert_error(result, "session a did not round-trip through turbo3: " + fragment)
    assert "nothing written" in result.stderr
    assert not out.exists() and not [p for p in tmp_path.iterdir() if ".x.skv" in p.name]


# -- verify --against -----------------------------------------------------------------------


def test_verify_against_refuses_a_lossy_session_with_other_tokens(tmp_path, monkeypatch):
    cap = write(tmp_path, "a", "a")
    skv = tmp_path / "x.skv"
    assert invoke("compress", cap, "-o", skv, "--codec", "turbo3").exit_code == 0
    assert invoke("verify", skv, "--against", cap).exit_code == 0  # error measured, not judged
    _tamper_restores(monkeypatch, lambda r: {"tokens": r.tokens + 1})
    result = invoke("verify", skv, "--against", cap)
    assert_error(result, "codec turbo3 did not restore a (tokens differ", code=1)


def test_verify_against_still_refuses_an_inexact_lossless_session(tmp_path, monkeypatch):
    cap = write(tmp_path, "a", "a")
    skv = tmp_path / "x.skv"
    assert invoke("compress", cap, "-o", skv, "--codec", "raw").exit_code == 0
    assert invoke("verify", skv, "--against", cap).exit_code == 0

    def nudge(r):
        keys = [k.clone() for k in r.keys]
        keys[0][0, 0, 0] += 1
        return {"keys": keys}

    _tamper_restores(monkeypatch, nudge)
    result = invoke("verify", skv, "--against", cap)
    assert_error(result, "codec raw did not restore a (not bit-exact", code=1)


def test_info_and_verify_print_markup_in_ids_and_paths_inertly(tmp_path):
    hostile = "[/x][bold]\x1b[31mred"
    folder = tmp_path / "d[" / "x]"
    folder.mkdir(parents=True)
    cap = write(folder, hostile, "c[bold]")
    skv = folder / "m[red].skv"
    assert invoke("compress", cap, "-o", skv, "--codec", "raw").exit_code == 0
    for result in (invoke("info", skv), invoke("verify", skv, "--against", cap)):
        assert result.exit_code == 0, (result.output, result.exception)
        assert "\x1b" not in result.output
        # the id whole, its escape byte shown as text; the path with its brackets (a long
        # path may wrap: compare without the line breaks and indents)
        unwrapped = "".join(result.stdout.split())
        assert "[/x][bold]\\x1b[31mred" in unwrapped, result.stdout
        assert str(skv) in unwrapped, result.stdout


# -- pipeline ---------------------------------------------------------------------------------


def test_pipeline_refuses_an_output_that_is_one_of_its_inputs(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    precious = run / "seq.skv"
    precious.write_text("my notes, not an archive\n")
    assert_error(invoke("pipeline", precious, "-o", run), "is also an input")
    base = run / "turbo3.skv"
    base.write_text("more notes\n")
    assert_error(invoke("pipeline", base, "-o", run), "is also an input")
    assert precious.read_text() == "my notes, not an archive\n"


# -- container writer temporaries -----------------------------------------------------------


def _dead_pid() -> int:
    done = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        text=True,
        capture_output=True,
        check=True,
    )
    return int(done.stdout)


def test_writer_temporaries_carry_host_and_pid_and_dead_ones_are_removed(tmp_path):
    from seqkv_cli.container import ContainerWriter
    from seqkv_cli.fsutil import host_tag

    out = tmp_path / "x.skv"
    stale = tmp_path / f".x.skv.{host_tag()}-{_dead_pid()}-0badc0de.tmp"
    live = tmp_path / f".x.skv.{host_tag()}-{os.getppid()}-feedf00d.tmp"
    other = tmp_path / ".x.skv.0badc0de.tmp"  # no tag: not a writer's, not touched
    for p in (stale, live, other):
        p.write_bytes(b"left by a killed writer")
    writer = ContainerWriter(out)
    try:
        mine = Path(writer._tmp).name
        assert mine.startswith(f".x.skv.{host_tag()}-{os.getpid()}-") and mine.endswith(".tmp")
    finally:
        writer.abort()
    assert not stale.exists() and live.exists() and other.exists()
    cap = write(tmp_path, "a", "a")
    stale.write_bytes(b"again")
    result = invoke("compress", cap, "-o", out, "--codec", "raw", "--layout", "flat")
    assert result.exit_code == 0, result.output
    assert not stale.exists() and live.exists()


# -- GGUF metadata cache and the fp32 folder -------------------------------------------------


class _Saved:
    """Stands for a transformers config or tokenizer: save_pretrained writes its text."""

    def __init__(self, name: str, text: str) -> None:
        self.name, self.text = name, text

    def save_pretrained(self, folder):
        if self.text == "boom":
            raise SeqkvError("disk full")
        (folder / self.name).write_text(self.text)


@pytest.fixture
def fake_gguf(monkeypatch):
    """transformers' reading of a GGUF file replaced by a stand-in: its config records the
    file's size, a "boom" config fails to save."""
    import seqkv_cli.runtime.gguf as gguf

    calls = []

    def read(path, layout):
        calls.append(path)
        text = "boom" if getattr(read, "boom", False) else str(path.stat().st_size)
        return _Saved("config.json", text), _Saved("tokenizer.json", "t"), {}

    monkeypatch.setattr(gguf, "_read_metadata", read)
    return gguf, calls, read


def _tiny_gguf(path: Path, seed: int = 3) -> Path:
    """A real, tiny GGUF file (the metadata folder is only made for a file that checks out)."""
    from bench.real_shapes import byte_tokenizer, write_gguf
    from tests.runtime.test_checkpoint import _qtypes, _tiny_config

    write_gguf(_tiny_config(), path, _qtypes, seed, byte_tokenizer(320))
    return path


def test_a_gguf_files_metadata_is_read_once_into_a_folder_named_by_its_content(
    tmp_path, monkeypatch, fake_gguf
):
    import hashlib

    from seqkv_cli.runtime.checkpoint.gguf_check import read_layout

    conv, calls, _ = fake_gguf
    monkeypatch.setenv("SEQKV_CACHE", str(tmp_path / "cache"))
    gguf = _tiny_gguf(tmp_path / "m.gguf")
    folder = conv.metadata_folder(gguf)
    digest = hashlib.sha256(gguf.read_bytes()).hexdigest()[:16]
    assert folder == tmp_path / "cache" / "models" / f"gguf-{digest}-v{conv.META_VERSION}"
    assert (folder / "config.json").read_text() == str(gguf.stat().st_size)
    assert conv.tensor_table(folder) == (read_layout(gguf).table(), "llama", {})
    assert conv.metadata_folder(gguf) == folder and len(calls) == 1  # cached
    _tiny_gguf(gguf, seed=4)  # other weights: another folder
    assert conv.metadata_folder(gguf) != folder and len(calls) == 2
    gguf.write_bytes(b"GGML old" * 4)
    with pytest.raises(SeqkvError, match="bad magic bytes"):
        conv.metadata_folder(gguf)


def test_a_failed_metadata_read_leaves_nothing_and_a_damaged_cache_is_one_line(
    tmp_path, monkeypatch, fake_gguf
):
    conv, calls, read = fake_gguf
    monkeypatch.setenv("SEQKV_CACHE", str(tmp_path / "cache"))
    gguf = _tiny_gguf(tmp_path / "m.gguf")
    read.boom = True
    with pytest.raises(SeqkvError, match="disk full"):
        conv.metadata_folder(gguf)
    models = tmp_path / "cache" / "models"
    assert [p.name for p in models.iterdir() if not p.name.endswith(".lock")] == []
    read.boom = False
    folder = conv.metadata_folder(gguf)
    (folder / conv.META_MARKER).write_text("{not json")
    with pytest.raises(SeqkvError, match="damaged GGUF metadata cache"):
        conv.tensor_table(folder)
    assert conv.metadata_folder(gguf) == folder and len(calls) == 3  # not trusted: rebuilt
    assert conv.tensor_table(folder)[1] == "llama"


def test_the_fp32_folder_is_written_once_and_never_deleted(tmp_path, monkeypatch):
    import seqkv_cli.runtime.gguf as conv

    written = []

    class Model:
        def save_pretrained(self, folder):
            written.append(folder)
            (folder / "model.safetensors").write_text("fp32")

    class Store:
        def fp32_model(self, model):
            return model

    monkeypatch.setattr(
        conv, "load_gguf", lambda path, progress=None: (Model(), _Saved("t.json", "t"), Store(), 0)
    )
    gguf, target = tmp_path / "m.gguf", tmp_path / "models" / "fp32"
    gguf.write_bytes(b"GGUF")
    conv.fp32_folder(gguf, target)
    assert (target / conv.CONVERTED_MARKER).exists() and len(written) == 1
    conv.fp32_folder(gguf, target)  # a second run (it waited on the lock) keeps the copy
    assert len(written) == 1
    assert sorted(p.name for p in target.parent.iterdir()) == ["fp32", "fp32.convert.lock"]


# -- restore.py keeps no second decompress --------------------------------------------------


def test_there_is_one_decompress(tmp_path):
    from seqkv_cli.archive import decompression, restore

    caps = [write(tmp_path, "a b", "a"), write(tmp_path, "a_b", "b")]
    skv = tmp_path / "x.skv"
    assert invoke("compress", *caps, "-o", skv, "--codec", "raw").exit_code == 0
    # an old copy in restore.py named both sessions "a_b.safetensors": one overwrote the other
    written = decompression.decompress(skv, tmp_path / "out")
    assert len({p.name for p in written}) == 2
    assert not hasattr(restore, "decompress") and not hasattr(restore, "_safe")


def test_report_refuses_restored_kv_of_another_shape_in_one_line():
    from types import SimpleNamespace

    from seqkv_cli.report.measure import measure_fidelity

    cap = synthetic("a")
    bad = altered(cap, keys=[cap.keys[0][:, :, :4], cap.keys[1]])  # torch.stack raised before
    with pytest.raises(SeqkvError, match=r"x\.skv: session a: layer 0 key shape"):
        measure_fidelity(SimpleNamespace(id="a"), cap, bad, "x.skv")
