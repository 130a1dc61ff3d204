"""docs/API.md runs as written: its python blocks, in order, in one namespace, with the
embedded model (the examples' own asserts check round trips and continuations)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parent.parent / "docs" / "API.md"


def _blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)


def test_the_api_page_has_examples_for_every_function():
    text = "".join(_blocks())
    for call in ("open_archive(", ".add(", ".load(", ".sessions(", "capture(", "compress("):
        assert call in text, call


@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated")
def test_every_example_runs(tmp_path, monkeypatch, embedded_lm, capsys):
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "api_doc"}
    for number, block in enumerate(_blocks()):
        code = compile(block, f"docs/API.md block {number}", "exec")
        exec(code, namespace)  # the project's own documentation
    printed = capsys.readouterr().out
    assert printed.startswith("replay ")  # the first example's report line
    assert (tmp_path / "memory.skv").is_file() and (tmp_path / "notes.skv").is_file()
    with namespace["seqkv"].open_archive("memory.skv", model=namespace["model"]) as arc:
        ids = [s.id for s in arc.sessions()]
    assert ids == ["chat-42", "chat-42-loose", "chat-42-tokens"]
