"""Golden .skv files written by an earlier version must decode to the recorded bytes forever."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from seqkv_cli import load_capture
from seqkv_cli.skv.restore import Archive

GOLDEN = Path(__file__).resolve().parent.parent / "golden" / "v1"
EXPECTED = json.loads((GOLDEN / "expected.json").read_text())


@pytest.mark.parametrize("codec", sorted(EXPECTED))
def test_golden_file_decodes_to_recorded_bytes(codec):
    from golden.make_golden import digest

    with Archive(GOLDEN / f"{codec}.skv") as arc:
        arc.reader.verify()
        assert arc.codec.codec_id == codec
        restored = arc.restore(arc.sessions[0])
    assert digest(restored) == EXPECTED[codec]
    original = load_capture(GOLDEN / "capture.safetensors")
    assert torch.equal(restored.tokens, original.tokens)
    if arc.codec.lossless:
        assert digest(original) == EXPECTED[codec]
