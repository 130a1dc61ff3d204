"""docs/API.md and docs/AGENT_MEMORY.md run as written: their python blocks, in order, in one
namespace, with the embedded model (the examples' own asserts check round trips)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[2] / "docs"


def _blocks(name: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", (DOCS / name).read_text(), flags=re.S)


def _run(name: str) -> dict:
    namespace: dict = {"__name__": "doc_example"}
    for number, block in enumerate(_blocks(name)):
        exec(compile(block, f"docs/{name} block {number}", "exec"), namespace)  # our own docs
    return namespace


def test_the_api_page_has_examples_for_every_function():
    text = "".join(_blocks("API.md"))
    for call in ("open_archive(", ".add(", ".load(", ".sessions(", "capture(", "compress("):
        assert call in text, call


@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated")
def test_every_api_example_runs(tmp_path, monkeypatch, embedded_lm, capsys):
    monkeypatch.chdir(tmp_path)
    namespace = _run("API.md")
    printed = capsys.readouterr().out
    assert printed.startswith("replay ")  # the first example's report line
    assert (tmp_path / "memory.skv").is_file() and (tmp_path / "notes.skv").is_file()
    with namespace["seqkv"].open_archive("memory.skv", model=namespace["model"]) as arc:
        ids = [s.id for s in arc.sessions()]
    assert ids == ["chat-42", "chat-42-loose", "chat-42-tokens"]


@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated")
def test_the_agent_memory_loop_runs(tmp_path, monkeypatch, embedded_lm):
    monkeypatch.chdir(tmp_path)
    namespace = _run("AGENT_MEMORY.md")
    with namespace["seqkv"].open_archive("agent.skv", model=namespace["model"]) as arc:
        rows = arc.sessions()
    assert [r.id for r in rows] == ["run-7/turn-1", "run-7/turn-2"]
    assert rows[1].shared_prefix == rows[0].tokens and {r.restore for r in rows} == {"replay"}
    assert {r.load for r in rows} == {"fast"}  # the loop's one-line choice, kept by the file
