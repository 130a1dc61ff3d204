"""N sessions that share one long prefix, captured cheaply and exactly.

Every session is the chats' shared templated prefix (system prompt + few-shot block, 712
tokens) followed by its own tail of ~200 tokens (a window of a pool of real chat turns, prose
and code). The prefix is run through the canonical forward once; each session continues a
copy of that state with its tail. Canonical numerics do not depend on where a sequence is cut,
so the result is bit-identical to capturing the whole session (checked on session 0 by
`check_exact`), at ~200 instead of ~912 tokens of model work per session.

The same pass yields every position's logits, so it also gives each session's ideal `seq`
token cost on its own (-log2 of the 24-bit frequencies the token coder uses): with the
overhead of the singles compressed for real, that sizes "N separate files" beyond them.
"""

from __future__ import annotations

import numpy as np
import torch

from bench.suite.common import Run

FULL = (712, 200)  # (shared prefix, tail) tokens
QUICK = (64, 16)


def prefix_and_pool(lm, prefix_len: int) -> tuple[list[int], list[int]]:
    """The chats' shared templated prefix, and a pool of other tokens to cut tails from."""
    from bench.harness import SAMPLE
    from bench.suite.inputs import documents
    from seqkv_cli.kvcapture.engine import tokenize
    from seqkv_cli.kvcapture.inputs import read_inputs

    chats = [d for d in read_inputs([str(SAMPLE / "chats.jsonl")]) if d.id.startswith("chat-")]
    ids = [tokenize(lm, d) for d in chats]
    shared = min(
        next((i for i, (a, b) in enumerate(zip(ids[0], x, strict=False)) if a != b), len(x))
        for x in ids[1:]
    )
    if shared < prefix_len:
        raise SystemExit(f"chats share {shared} tokens, fewer than the {prefix_len} wanted")
    pool = [t for x in ids for t in x[shared:]]
    for doc in documents((("prose.txt", "prose"), ("sample_code.py", "sample_code"))):
        pool += tokenize(lm, doc)
    return ids[0][:prefix_len], pool


class SessionFactory:
    """Captures of prefix + tail (and their ideal token bits), from one prefix pass."""

    def __init__(self, run: Run, prefix: list[int], tail_len: int) -> None:
        from seqkv_cli.kvcapture.engine import CHUNK, canonical_model

        self.lm, self.canon, self.tail_len = run.lm, canonical_model(run.lm), tail_len
        self.prefix = torch.tensor(prefix, dtype=torch.long)
        self.state = self.canon.new_state(len(prefix) + tail_len)
        chunks = [
            self.canon.forward(self.state, self.prefix[s : s + CHUNK])
            for s in range(0, len(prefix), CHUNK)
        ]
        self.logits = torch.cat(chunks)
        self.surprisal = self.canon.surprisal(self.logits[:-1], self.prefix[1:])
        first = np.zeros(self.canon.vocab_size, dtype=np.float32)  # the first token: uniform
        self.prefix_bits = _ideal_bits(first[None], prefix[:1])
        self.prefix_bits += _ideal_bits(self.logits[:-1].numpy(), prefix[1:])

    def make(self, session_id: str, tail: list[int]) -> tuple[object, float]:
        """A canonical bf16 capture of prefix + tail, and its ideal `seq` token bits alone."""
        from seqkv_cli.kvcapture.capture_file import Capture
        from seqkv_cli.kvcapture.engine import provenance

        p, ids = len(self.prefix), torch.tensor(tail, dtype=torch.long)
        state = self.state.fork(p, p + len(ids))  # quantized rows come along
        logits = self.canon.forward(state, ids)
        rows = torch.cat([self.logits[-1:], logits[:-1]])
        surprisal = torch.cat([self.surprisal, self.canon.surprisal(rows, ids)])
        n = p + len(ids)
        keys = [state.layer_kv(i)[0].to(torch.bfloat16) for i in range(self.canon.num_layers)]
        values = [state.layer_kv(i)[1].to(torch.bfloat16) for i in range(self.canon.num_layers)]
        meta = provenance(self.lm, dtype="bf16", numeric_path=self.canon.numeric_path, positions=n)
        meta.update({"session_id": session_id, "source": "bench shared-prefix session"})
        tokens = torch.cat([self.prefix, ids])
        cap = Capture(tokens, keys, values, surprisal, meta)
        return cap, self.prefix_bits + _ideal_bits(rows.numpy(), tail)


def _ideal_bits(logits: np.ndarray, tokens: list[int]) -> float:
    """What the token coder spends on `tokens` under these logits rows (24-bit tables)."""
    from seqkv_cli.sequential.seq import SeqCodec
    from seqkv_codecs.sequential import code_length_bits, frequencies_from_logits

    freqs = frequencies_from_logits(logits, SeqCodec().precision_bits)
    return code_length_bits(freqs, np.asarray(tokens))


def tails(pool: list[int], count: int, length: int) -> list[list[int]]:
    """`count` distinct windows of `length` tokens spread over the pool."""
    if len(pool) < length + count:
        raise SystemExit(f"the tail pool has {len(pool)} tokens; too few for {count} tails")
    stride = max(1, (len(pool) - length) // max(count - 1, 1))
    return [pool[i * stride : i * stride + length] for i in range(count)]


def check_exact(run: Run, cap) -> bool:
    """Is the prefix-reuse capture bit-identical to capturing the whole session directly?"""
    from bench.suite.inputs import capture_ids
    from seqkv_cli.archive import same_capture

    direct = capture_ids(run, cap.tokens.tolist(), cap.session_id)
    return same_capture(direct, cap)
