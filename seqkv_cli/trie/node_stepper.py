"""One `seq` node being decoded a token per model pass, its guesses checked by its stream.

Each pass feeds the node's last decoded token (and any guesses of the tokens after it) as
one row; the logits that come back give the next token's frequencies, and the node's range
decoder decodes under them. A guess is kept while the decoded token equals it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from seqkv_cli.errors import SeqkvError
from seqkv_cli.trie.node_source import NodeSource
from seqkv_cli.trie.runs import Run

if TYPE_CHECKING:
    from seqkv_cli.sequential.adapter import CanonicalLogits
    from seqkv_codecs.sequential.drafts import DraftIndex
    from seqkv_codecs.sequential.node_stream import NodeDecoder


class NodeStepper:
    """One `seq` node being decoded a token per model pass."""

    def __init__(
        self, run: Run, decoder: NodeDecoder, row: np.ndarray, drafter: DraftIndex | None = None
    ) -> None:
        from seqkv_codecs.sequential.drafts import Stream

        self.run, self.decoder, self.row = run, decoder, row
        self.precision = decoder.precision
        self.drafter = drafter
        self.stream = Stream(run.prefix) if drafter is not None else None
        self.unfed = False  # a token is decoded that no pass has fed yet

    @classmethod
    def open_or_error(
        cls,
        run: Run | Exception,
        adapter: CanonicalLogits,
        source: NodeSource,
        drafter: DraftIndex | None = None,
    ) -> NodeStepper | Exception:
        """A stepper for the node's run, or the error that prevents it (the run's own, or
        its stream's header)."""
        from seqkv_codecs.errors import CodecError
        from seqkv_codecs.sequential.node_stream import NodeDecoder
        from seqkv_codecs.sequential.probability import frequencies_from_logits
        from seqkv_codecs.sequential.token_coder import uniform_row

        if isinstance(run, Exception):
            return run
        node = source.contents.nodes[run.node]
        try:
            decoder = NodeDecoder(
                source.payload(run.node),
                node.n_tokens,
                node.check,
                source.precision,
                max_tokens=adapter.canon.max_context,
            )
        except CodecError as exc:
            return SeqkvError(f"node {run.node}: {exc}")
        row = (
            uniform_row(adapter.vocab_size, source.precision)
            if run.first_row is None
            else frequencies_from_logits(run.first_row.numpy(), source.precision)
        )
        run.tokens = decoder.out
        return cls(run, decoder, row, drafter)

    def step(self) -> Exception | None:
        """Decode the next token under the current row (unless one waits to be fed); the
        error if the stream does not decode, else None."""
        from seqkv_codecs.errors import CodecError

        if self.unfed:
            return None
        try:
            token = self.decoder.step(self.row)
        except CodecError as exc:
            return SeqkvError(f"node {self.run.node} does not decode: {exc}")
        self.unfed = True
        if self.drafter is not None:
            self.drafter.extend(self.stream, (token,))
        return None

    def guess(self, limit: int) -> tuple[list[int], int]:
        """Guesses of the tokens after the last decoded one, at most those the node has left."""
        left = min(limit, self.run.n_tokens - self.decoder.pos)
        return self.drafter.draft(self.stream, left)

    def verify(
        self, logits: torch.Tensor, drafts: list[int], reached: int
    ) -> tuple[int, Run | Exception | None]:
        """Rows of a pass that fed the last token, then `drafts`: decode under each row while
        the decoded token is the guess fed after it. Returns the rows kept (right guesses + 1)
        and the node's result, if it finished; `reached(pos)` is told every offset reached."""
        from seqkv_codecs.sequential.probability import frequencies_from_logits

        for j in range(len(drafts) + 1):
            freq = frequencies_from_logits(logits[j], self.precision)
            result = self.result_after_pass(logits[j], freq)
            reached(self.decoder.pos)
            if result is not None or j == len(drafts):
                return j + 1, result
            error = self.step()
            if error is not None:
                return j + 1, error
            if self.last_token != drafts[j]:
                return j + 1, None  # decoded right, guessed wrong: the next pass feeds it
        raise AssertionError("unreachable")

    @property
    def last_token(self) -> int:
        return int(self.decoder.out[self.decoder.pos - 1])

    def result_after_pass(self, logits: np.ndarray, freq: np.ndarray) -> Run | Exception | None:
        """Take the pass's logits after the last token: None while the node goes on, else the
        finished run (or the error its stream's final checks raised)."""
        from seqkv_codecs.errors import CodecError

        dec, run = self.decoder, self.run
        self.unfed = False
        run.keep_row(dec.pos, torch.from_numpy(logits.copy()))
        self.row = freq
        if dec.pos < run.n_tokens:
            return None
        if dec.done:  # decoded to its end: the stream's flush and token check must hold
            try:
                dec.close()
            except CodecError as exc:
                return SeqkvError(f"node {run.node}: {exc}")
        return run  # else stopped early: the rest of the node is not needed
