"""The prose stays true to the repository: every link and every repository path that the docs,
the README, the code and the benches name is there, nothing cites a file outside the
repository, and no text carries the directory layout of the machine it was written on."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TEXT = (".md", ".py", ".sh", ".toml")
# Folders that benches write into: a path there names an output, not a file to read.
OUTPUTS = ("bench/results/",)

REPO_PATH = re.compile(
    r"(?<![\w./-])((?:docs|seqkv_cli|bench|tests|codecs|sample_data|\.ci)/[\w./-]*\w)"
    r"(?=[^\w./-]|$)"
)
MARKDOWN_LINK = re.compile(r"\]\(([^)\s]+)\)")
MACHINE_PATH = re.compile(r"(?<![\w.])/(?:home|root|work|Users|mnt/data)/\w")


def tracked_text() -> list[Path]:
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return [ROOT / f for f in listed if f.endswith(TEXT) and (ROOT / f).is_file()]


def ours(path: Path) -> bool:
    """Every text but this file (its checks' examples are made up)."""
    return str(path.relative_to(ROOT)) != "tests/test_docs.py"


def test_every_repository_path_named_exists():
    missing = []
    for path in filter(ours, tracked_text()):
        text = path.read_text()
        for m in REPO_PATH.finditer(text):
            named = m.group(1)
            follows = text[m.end() : m.end() + 1]
            if (follows in "<{*$" and follows) or named.startswith(OUTPUTS):
                continue  # a pattern (`run-<date>.json`, `gpu_*`) or a bench's output
            if not (ROOT / named).exists():
                line = text.count("\n", 0, m.start()) + 1
                missing.append(f"{path.relative_to(ROOT)}:{line}: {named}")
    assert missing == []


def test_every_markdown_link_resolves():
    broken = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        for m in MARKDOWN_LINK.finditer(path.read_text()):
            target = m.group(1).split("#", 1)[0]
            if not target or re.match(r"^[a-z]+:", target):
                continue  # an anchor in the same page, or a URL
            if not (path.parent / target).exists():
                broken.append(f"{path.relative_to(ROOT)}: {m.group(1)}")
    assert broken == []


def test_nothing_cites_a_file_outside_the_repository():
    # DESIGN.md was never in the repository
    cited = [
        str(p.relative_to(ROOT))
        for p in filter(ours, tracked_text())
        if "DESIGN.md" in p.read_text()
    ]
    assert cited == [p for p in cited if p == "tests/test_docs.py"]


def test_no_text_names_a_folder_of_the_machine_it_was_written_on():
    named = []
    for path in tracked_text():
        if path.name == "test_docs.py":
            continue
        for m in MACHINE_PATH.finditer(path.read_text()):
            named.append(f"{path.relative_to(ROOT)}: {m.group(0)}")
    assert named == []


def test_the_checks_find_what_they_look_for(tmp_path):
    text = "see docs/NO_SUCH.md and docs/FORMAT.md, /home/someone/x, bench/results/out.json"
    names = [m.group(1) for m in REPO_PATH.finditer(text)]
    assert names == ["docs/NO_SUCH.md", "docs/FORMAT.md", "bench/results/out.json"]
    assert [m.group(0) for m in MACHINE_PATH.finditer(text)] == ["/home/s"]
    assert MARKDOWN_LINK.findall("[a](format/NEARDUP.md#x) [b](https://x.org)") == [
        "format/NEARDUP.md#x",
        "https://x.org",
    ]
