"""Fidelity of one restored session against its capture, and its marginal-cost windows."""

from __future__ import annotations

import numpy as np
import torch

from seqkv_cli.errors import SeqkvError
from seqkv_cli.report.continuation import Continuation
from seqkv_cli.report.row import Row
from seqkv_cli.report.windows import cost_curve, windows


def measure_fidelity(row: Row, original, restored, where: str) -> None:
    """Exactness, max-abs error, worst per-tensor relative L2 error, attention-output error."""
    from seqkv_cli.archive import attention_error, bit_equal, kv_structure_problems

    if original.positions != restored.positions or not torch.equal(
        original.tokens.to(torch.long), restored.tokens.to(torch.long)
    ):
        raise SeqkvError(
            f"{where}: session {row.id} does not hold the tokens of its capture "
            f"({restored.positions} vs {original.positions} positions); report them separately"
        )
    if problems := kv_structure_problems(original, restored):
        raise SeqkvError(f"{where}: session {row.id}: {problems[0]}; not comparable with it")
    a = torch.stack([*original.keys, *original.values])  # (2 * layers, heads, n, head_dim)
    b = torch.stack([*restored.keys, *restored.values])
    row.exact = bit_equal(a, b)  # the bits, as compress and verify judge them
    diff = (a.float() - b.float()).nan_to_num(nan=float("inf")).flatten(1)
    row.max_abs_error = float(diff.abs().max()) if diff.numel() else 0.0
    norms = a.float().flatten(1).norm(dim=1).clamp_min(1e-30)
    row.rel_l2_error = float((diff.norm(dim=1) / norms).max()) if diff.numel() else 0.0
    row.attention_error = attention_error(
        original.keys, original.values, restored.keys, restored.values
    )


class Continuations:
    """One reference run per original session, shared by every codec's row of that session."""

    def __init__(self, tokens: int) -> None:
        self.tokens = tokens
        self._probes: dict[tuple[str, str], Continuation] = {}

    def apply(self, row: Row, lm, original, restored) -> None:
        """Fill ppl change and greedy agreement; an exact cache changes nothing by definition."""
        if not self.tokens or not Continuation.possible(row.positions):
            return
        if row.exact:
            row.delta_log2_ppl, row.ppl_ratio = 0.0, 1.0
            row.greedy_agreement, row.greedy_prefix = 1.0, self.tokens
            return
        if lm is None:
            return
        key = (row.model_fingerprint, row.id)
        if key not in self._probes:
            self._probes[key] = Continuation(lm, original, self.tokens)
        result = self._probes[key].measure(restored)
        row.delta_log2_ppl, row.ppl_ratio = result.delta_log2_ppl, result.ppl_ratio
        row.greedy_agreement, row.greedy_prefix = result.greedy_agreement, result.greedy_prefix


def attach_windows(
    row: Row, surprisal: np.ndarray | None, size: int, first_token_bits: float | None
) -> None:
    """The row's per-position cost curve and its windows (see `windows`)."""
    from seqkv_cli.sequential.registry import codec_capabilities

    caps = codec_capabilities(row.codec)
    row.surprisal = surprisal
    row.curve = cost_curve(
        caps is not None and caps.steps_model,
        row.positions,
        row.breakdown,
        surprisal,
        first_token_bits,
    )
    row.windows = windows(row.curve, surprisal, size)
