"""The fixed inputs of the benchmark: which sample_data sessions, captured how.

Full mode: prose.txt (1,298 tokens), sample_code.py (1,873), chats.jsonl sessions chat-01 and
near-01 (~850 each): about 4,900 tokens of prose, code and chat. chat-01 and near-01 share
only ~5 tokens, so this set measures per-session coding; cross-session sharing is measured
by the sessions scaling (bench/suite/sessions.py). Quick mode keeps the first 48 tokens of each.
"""

from __future__ import annotations

from pathlib import Path

from bench.harness import SAMPLE
from bench.suite.common import Run

SET = (
    ("prose.txt", "prose"),
    ("sample_code.py", "sample_code"),
    ("chats.jsonl", "chat-01"),
    ("chats.jsonl", "near-01"),
)
QUICK_TOKENS = 48


def documents(chosen=SET) -> list:
    from seqkv_cli.kvcapture.inputs import read_inputs

    docs = {d.id: d for f in {f for f, _ in chosen} for d in read_inputs([str(SAMPLE / f)])}
    return [docs[doc_id] for _, doc_id in chosen]


def capture_set(run: Run, max_tokens: int | None = None) -> list:
    """Canonical bf16 captures of the fixed set, written to files (CaptureResult each)."""
    from seqkv_cli.kvcapture.api import capture_planned, output_paths, plan_capture

    docs = documents()
    limit = max_tokens or (QUICK_TOKENS if run.quick else None)
    plan = plan_capture(run.lm, docs, max_tokens=limit)
    targets = output_paths(run.scratch("set"), docs)
    return list(capture_planned(run.lm, plan, targets, dtype="bf16", canonical=True))


def slice_capture(cap, n: int, session_id: str | None = None):
    """The first `n` positions of a capture: what capturing only those tokens gives.

    Exact for canonical captures (their numerics do not depend on where a sequence stops).
    """
    from seqkv_cli.kvcapture.capture_file import Capture

    if not 1 <= n <= cap.positions:
        raise ValueError(f"cannot keep {n} of {cap.positions} positions")
    meta = {**cap.meta, "positions": n}
    if session_id:
        meta["session_id"] = session_id
    return Capture(
        cap.tokens[:n].clone(),
        [k[:, :n].clone() for k in cap.keys],
        [v[:, :n].clone() for v in cap.values],
        cap.surprisal[: max(n - 1, 0)].clone(),
        meta,
    )


def save(cap, folder: Path) -> Path:
    from seqkv_cli.kvcapture.capture_file import save_capture

    path = Path(folder) / f"{cap.session_id}.safetensors"
    save_capture(cap, path)
    return path


def long_token_ids(lm, n: int) -> list[int]:
    """`n` tokens of one long plain-text document: prose, then code, then the agent chat."""
    from seqkv_cli.kvcapture.inputs import read_inputs

    [agent] = read_inputs([str(SAMPLE / "agent_transcript.jsonl")])
    chat = lm.tokenizer.apply_chat_template(list(agent.messages), tokenize=False)
    parts = [(SAMPLE / f).read_text(encoding="utf-8") for f in ("prose.txt", "sample_code.py")]
    ids = lm.tokenizer("\n\n".join([*parts, chat]), add_special_tokens=False).input_ids
    if len(ids) < n:
        raise SystemExit(f"the long document has {len(ids)} tokens, fewer than {n}")
    return list(ids[:n])


def capture_ids(run: Run, ids: list[int], session_id: str, *, canonical: bool = True):
    """Capture token ids directly (bf16); `canonical=False` is an ordinary transformers run."""
    from seqkv_cli.kvcapture.engine import run_capture

    cap = run_capture(run.lm, ids, dtype="bf16", canonical=canonical)
    cap.meta.update({"session_id": session_id, "source": "bench"})
    return cap


def log2_ppl(caps) -> float:
    """Position-weighted mean surprisal (bits) over a set of captures."""
    bits = sum(float(c.surprisal.double().sum()) for c in caps)
    scored = sum(int(c.surprisal.numel()) for c in caps)
    return bits / scored if scored else float("nan")
