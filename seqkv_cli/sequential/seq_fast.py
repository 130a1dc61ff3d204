"""`seq-fast`: token ids under a static rANS table of the session's own histogram.

Model-free token coding: decoding is one parallel prefill, so it is fast, and costs about the
unigram entropy per position. K/V come back by canonical recomputation plus a residual
(session_codec.py).
"""

from __future__ import annotations

import numpy as np

from seqkv_cli.sequential.adapter import CanonicalLogits
from seqkv_cli.sequential.session_codec import SessionCodec


class SeqFastCodec(SessionCodec):
    codec_id = "seq-fast"
    description = (
        "token ids under a static unigram rANS table + K/V recomputed by one "
        "parallel prefill (fast decode, more bits) + residual"
    )

    def encode_tokens(self, tokens, adapter):
        from seqkv_codecs.entropy import encode_symbols

        data = encode_symbols(tokens, adapter.vocab_size)
        self._prefill(tokens, adapter)
        counts = np.bincount(tokens, minlength=adapter.vocab_size)
        p = counts[counts > 0] / max(len(tokens), 1)
        return data, float(-(counts[counts > 0] * np.log2(p)).sum())

    def decode_tokens_many(self, datas, adapter):
        from seqkv_codecs.entropy import decode_symbols
        from seqkv_codecs.errors import CodecError

        out = []
        for data in datas:
            try:
                tokens = decode_symbols(data, max_symbols=adapter.canon.max_context)
            except CodecError as exc:
                out.append((exc, None))
                continue
            tokens = tokens.astype(np.int64)
            if len(tokens) and int(tokens.max()) >= adapter.vocab_size:
                bad = int(tokens.max())
                out.append((CodecError(f"token id {bad} is outside the vocabulary"), None))
                continue
            out.append((tokens, self._prefill(tokens, adapter)))
        return out

    @staticmethod
    def _prefill(tokens: np.ndarray, adapter: CanonicalLogits):
        """K/V and surprisal by chunked prefill, exactly as a decoder computes them."""
        track = adapter.start(len(tokens))
        for s in range(0, len(tokens), 256):
            adapter.feed(track, tokens[s : s + 256])
        return track
