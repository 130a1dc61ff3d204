"""Thousands of truncations and bit flips of real .skv files: always a clean SeqkvError."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from seqkv_cli.errors import SeqkvError
from seqkv_cli.skv.compress import compress_captures
from seqkv_cli.skv.restore import Archive


@pytest.fixture(scope="module")
def real_files(tmp_path_factory):
    from golden.make_golden import synthetic_capture
    from seqkv_cli.kvcapture.capture_file import save_capture

    folder = tmp_path_factory.mktemp("fuzz")
    save_capture(synthetic_capture(), folder / "cap.safetensors")
    files = {}
    for codec in ("lossless", "turbo3"):
        compress_captures([folder / "cap.safetensors"], folder / f"{codec}.skv", codec=codec)
        files[codec] = (folder / f"{codec}.skv").read_bytes()
    return files


def open_everything(path) -> None:
    with Archive(path) as arc:
        arc.reader.verify()
        for entry in arc.sessions:
            arc.restore(entry)


@settings(
    max_examples=1500,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(codec=st.sampled_from(["lossless", "turbo3"]), data=st.data())
def test_damage_is_always_caught(real_files, tmp_path, codec, data):
    blob = bytearray(real_files[codec])
    if data.draw(st.booleans(), label="truncate"):
        cut = data.draw(st.integers(0, len(blob) - 1), label="cut")
        blob = blob[:cut]
    else:
        for _ in range(data.draw(st.integers(1, 8), label="flips")):
            bit = data.draw(st.integers(0, len(blob) * 8 - 1), label="bit")
            blob[bit // 8] ^= 1 << (bit % 8)
        if bytes(blob) == real_files[codec]:
            return  # flips cancelled out
    path = tmp_path / "damaged.skv"
    path.write_bytes(bytes(blob))
    with pytest.raises(SeqkvError):
        open_everything(path)


def test_undamaged_files_open(real_files, tmp_path):
    for codec, blob in real_files.items():
        (tmp_path / f"{codec}.skv").write_bytes(blob)
        open_everything(tmp_path / f"{codec}.skv")
