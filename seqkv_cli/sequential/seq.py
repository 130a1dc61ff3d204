"""`seq`: token ids range-coded under the model's own next-token distribution.

About log2 PP bits per position; decoding steps the model once per token. K/V come back by
canonical recomputation plus a residual (session_codec.py).

With ``parallel=k`` (`compress --parallel k`) a session's tokens are coded as k runs, each
given only its own earlier tokens (seqkv_codecs.sequential.parallel_stream): restore steps
the runs side by side (about n / k passes) and recomputes the K/V from all the tokens in one
prefill. Each run loses the context before it, so it costs bits; sessions are then coded
each on its own (flat layout), as a trie's branches already decode side by side.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from seqkv_cli.errors import SeqkvError
from seqkv_cli.sequential.session_codec import SessionCodec

if TYPE_CHECKING:
    from seqkv_cli.runtime.forward import CanonicalForward


class SeqCodec(SessionCodec):
    codec_id = "seq"
    description = (
        "token ids range-coded under the model (≈ log2 PP bits/position) + exact "
        "K/V recomputation + residual; decode steps the model per token"
    )
    steps_model = True

    def __init__(self, *args, parallel: int = 1, **kwargs) -> None:
        from seqkv_codecs.sequential.parallel_stream import MAX_CHUNKS

        super().__init__(*args, **kwargs)
        if isinstance(parallel, bool) or not isinstance(parallel, int):
            raise SeqkvError(f"--parallel must be a whole number, got {parallel!r}")
        if not 1 <= parallel <= MAX_CHUNKS:
            raise SeqkvError(f"--parallel must be in 1..{MAX_CHUNKS}, got {parallel}")
        self.parallel = parallel
        self.trie_capable = parallel == 1  # runs are coded per session: flat layout

    def get_config(self) -> dict:
        config = super().get_config()
        if self.parallel > 1:  # absent from files without runs: their headers are unchanged
            config["parallel"] = self.parallel
        return config

    def encode_tokens(self, tokens, adapter):
        from seqkv_codecs.sequential import encode_tokens_with_stats
        from seqkv_codecs.sequential.parallel_stream import chunk_bounds, pack_parallel

        if self.parallel == 1:
            data, stats = encode_tokens_with_stats(
                tokens, adapter, precision_bits=self.precision_bits, chunk_size=self.chunk_size
            )
            return data, stats.ideal_bits
        streams, ideal = [], 0.0
        for a, b in chunk_bounds(len(tokens), self.parallel):
            data, stats = encode_tokens_with_stats(
                tokens[a:b], adapter, precision_bits=self.precision_bits, chunk_size=self.chunk_size
            )
            streams.append(data)
            ideal += stats.ideal_bits
        adapter.tracks.clear()  # runs saw only themselves: K/V come from the whole session
        return pack_parallel(streams), ideal

    def decode_tokens_many(self, datas, adapter):
        from seqkv_cli.sequential.adapter import drafts_enabled
        from seqkv_codecs.sequential.batch_decode import decode_tokens_batch

        drafts = drafts_enabled()
        if self.parallel == 1:
            return decode_tokens_batch(datas, adapter, with_states=True, drafts=drafts)
        spans, runs = [], []
        for data in datas:  # every run of every session: rows of the same passes
            try:
                parts = self._runs(data)
            except SeqkvError as exc:
                spans.append(exc)
                continue
            spans.append((len(runs), len(runs) + len(parts)))
            runs += parts
        decoded = decode_tokens_batch(runs, adapter, drafts=drafts) if runs else []
        adapter.tracks.clear()  # the runs' states: K/V are recomputed from the whole session
        out = []
        for span in spans:
            if isinstance(span, Exception):
                out.append((span, None))
                continue
            pieces = decoded[span[0] : span[1]]
            failed = next((p for p in pieces if isinstance(p, Exception)), None)
            try:
                out.append((failed, None) if failed else (self._joined(pieces), None))
            except SeqkvError as exc:
                out.append((exc, None))
        return out

    def _runs(self, data: bytes | None) -> list[bytes]:
        from seqkv_codecs.errors import CodecError
        from seqkv_codecs.sequential.parallel_stream import is_parallel, parse_parallel

        if not is_parallel(data):
            raise SeqkvError(
                f"its token stream is not in runs, though the codec has parallel={self.parallel}"
            )
        try:
            return parse_parallel(data)
        except CodecError as exc:
            raise SeqkvError(str(exc)) from None

    @staticmethod
    def _check_runs(lengths: list[int]) -> None:
        """Runs must be the ones chunk_bounds cuts a session of sum(lengths) tokens into:
        checked on the header (screen_tokens) and again on what was decoded (_joined), as
        the decode can be reached without the screen."""
        from seqkv_codecs.sequential.parallel_stream import chunk_bounds

        expected = [b - a for a, b in chunk_bounds(sum(lengths), len(lengths))]
        if len(lengths) > 1 and lengths != expected:
            raise SeqkvError(
                f"its token runs hold {lengths} tokens, not the runs of one session ({expected})"
            )

    @classmethod
    def _joined(cls, pieces: list) -> np.ndarray:
        """The runs' tokens in order, if their lengths are the ones chunk_bounds gives."""
        cls._check_runs([len(p) for p in pieces])
        return np.concatenate(pieces)

    def screen_tokens(self, entry: dict, data: bytes | None, canon: CanonicalForward) -> None:
        """The stream's header must name the model's vocabulary and the session's length."""
        from seqkv_codecs.errors import CodecError
        from seqkv_codecs.sequential.token_coder import read_token_stream_info

        streams = [data if data is not None else b""] if self.parallel == 1 else self._runs(data)
        try:
            infos = [read_token_stream_info(s) for s in streams]
        except CodecError as exc:
            raise SeqkvError(str(exc)) from None
        for info in infos:
            if info.vocab_size != canon.vocab_size:
                raise SeqkvError(
                    f"its token stream was coded with a {info.vocab_size}-token vocabulary; "
                    f"the model has {canon.vocab_size}"
                )
        n = sum(info.n_tokens for info in infos)
        if n != entry["positions"] or n > canon.max_context:
            raise SeqkvError(
                f"its token stream holds {n} tokens; the header says "
                f"{entry['positions']} and the model context is {canon.max_context}"
            )
        self._check_runs([info.n_tokens for info in infos])
