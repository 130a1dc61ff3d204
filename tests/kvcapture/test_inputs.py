import json
import re

import pytest

from conftest import SAMPLE_DATA
from seqkv_cli.errors import SeqkvError
from seqkv_cli.kvcapture.inputs import read_inputs


def test_text_and_jsonl_and_directory():
    docs = read_inputs([str(SAMPLE_DATA / "prose.txt"), str(SAMPLE_DATA / "chats.jsonl")])
    assert docs[0].id == "prose" and docs[0].text.startswith(docs[0].text[:10])
    chats = docs[1:]
    assert len(chats) >= 10
    assert all(d.messages and d.messages[0]["role"] == "system" for d in chats)
    assert chats[0].source.endswith("chats.jsonl:1")


def test_directory_expands_sorted_files():
    docs = read_inputs([str(SAMPLE_DATA)])
    ids = [d.id for d in docs]
    assert "prose" in ids and "sample_code" in ids and "agent-01" in ids
    assert len(ids) == len(set(ids))


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (
            '{"id": "a", "messages": [{"role": "user", "content": "hi"}]}\n{oops\n',
            "bad.jsonl:2: malformed JSON",
        ),
        ('{"id": "a"}\n', "bad.jsonl:1: a row needs exactly one of messages, text, token_ids"),
        ('{"id": "a", "messages": []}\n', "bad.jsonl:1: messages must be a non-empty list"),
        ("[1, 2]\n", 'bad.jsonl:1: expected an object like {"id": ..., "text": ...}'),
        ('{"id": "a", "text": "x", "token_ids": [1]}\n', "(it has text, token_ids)"),
        ('{"id": "a", "token_ids": [1, -2]}\n', "token_ids must be a non-empty list of integers"),
        ('{"id": true, "text": "x"}\n', "bad.jsonl:1: id must be a string or an integer"),
        ('{"id": "a", "messages": [{"role": "user"}]}\n', 'needs string "role" and "content"'),
        ("\n\n", "holds no sessions"),
    ],
)
def test_malformed_jsonl_names_the_line(tmp_path, content, message):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(content)
    with pytest.raises(SeqkvError, match=re.escape(message)):
        read_inputs([str(bad)])


def test_missing_empty_binary_and_duplicate_inputs(tmp_path):
    with pytest.raises(SeqkvError, match="no such input file"):
        read_inputs([str(tmp_path / "nope.txt")])
    (tmp_path / "empty.txt").write_text("  \n")
    with pytest.raises(SeqkvError, match="empty input"):
        read_inputs([str(tmp_path / "empty.txt")])
    (tmp_path / "bin.txt").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(SeqkvError, match="not UTF-8"):
        read_inputs([str(tmp_path / "bin.txt")])
    session = {"id": "x", "messages": [{"role": "user", "content": "hi"}]}
    (tmp_path / "dup.jsonl").write_text(json.dumps(session) + "\n" + json.dumps(session) + "\n")
    with pytest.raises(SeqkvError, match="same session id 'x'"):
        read_inputs([str(tmp_path / "dup.jsonl")])
    with pytest.raises(SeqkvError, match="no inputs"):
        read_inputs([])
