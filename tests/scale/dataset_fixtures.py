"""Session datasets for the scale tests: chats under a few shared system prompts."""

from __future__ import annotations

import json
import random
from pathlib import Path

PROMPTS = [
    f"You are the support assistant of shop {n}. Answer in one short paragraph, cite order "
    "numbers exactly, and never promise a refund you cannot give."
    for n in range(3)
]
TOPICS = ["a late parcel", "a broken kettle", "an invoice", "a password", "gift cards"]


def chat_rows(count: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for i in range(count):
        rows.append(
            {
                "id": f"chat-{i:04d}",
                "messages": [
                    {"role": "system", "content": PROMPTS[i % len(PROMPTS)]},
                    {"role": "user", "content": f"Question {i}: {rng.choice(TOPICS)}?"},
                ],
            }
        )
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path
