"""docs/SESSION_CODECS.md, followed as written: its python blocks, in order, in one namespace,
add the `tokens-u32` session codec and round-trip a capture through it; then the CLI and
the damaged-stream refusal the recipe asks for."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from cli_run import error_lines, invoke
from seqkv_cli.sequential import registry

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "docs" / "SESSION_CODECS.md"


@pytest.fixture
def recipe(monkeypatch, capsys, tiny_model_dir, tmp_path) -> dict:
    """The recipe's blocks run with the tiny model, from the repository root; the codec it
    registers is gone again afterwards."""
    monkeypatch.setattr(registry.SESSION_CODECS, "_classes", dict(registry.SESSION_CODECS._classes))
    monkeypatch.chdir(ROOT)
    namespace = {"__name__": "recipe", "model": str(tiny_model_dir), "work": tmp_path}
    blocks = re.findall(r"```python\n(.*?)```", RECIPE.read_text(), flags=re.S)
    assert len(blocks) == 3  # the class, its registration, the round trip
    for number, block in enumerate(blocks):
        exec(compile(block, f"docs/SESSION_CODECS.md block {number}", "exec"), namespace)
    namespace["printed"] = capsys.readouterr().out
    return namespace


def test_the_recipe_adds_a_codec_that_round_trips(recipe):
    assert recipe["printed"] == "32 bits/position of tokens\n"
    assert recipe["written"].sessions == 1 and recipe["written"].positions == 200
    caps = registry.codec_capabilities("tokens-u32")
    assert caps.needs_canonical and caps.lossless and not caps.trie_capable


def test_the_recipes_codec_works_through_the_cli(recipe, tiny_model_dir, tmp_path):
    listed = invoke("codecs")
    assert listed.exit_code == 0 and "tokens-u32" in listed.stdout
    capture_file, out = recipe["made"].path, tmp_path / "cli.skv"
    model = ("--model", tiny_model_dir)
    made = invoke("compress", capture_file, "-o", out, "--codec", "tokens-u32", *model)
    assert made.exit_code == 0, made.output
    checked = invoke("verify", out, "--against", capture_file, *model)
    assert checked.exit_code == 0, checked.output
    # an option the codec cannot take is refused by its capabilities, not by its id
    wrong = invoke("compress", capture_file, "-o", tmp_path / "x.skv", "--codec", "tokens-u32",
                   "--parallel", "2")  # fmt: skip
    assert wrong.exit_code == 2
    assert error_lines(wrong)[0].endswith("--parallel applies to seq, not tokens-u32")


def test_the_recipes_codec_refuses_a_damaged_stream(recipe):
    [(error, track)] = recipe["TokensU32"]().decode_tokens_many([b"\x01\x02\x03"], None)
    assert str(error) == "tokens-u32: the token stream is damaged" and track is None
