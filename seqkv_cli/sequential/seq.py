"""`seq`: token ids range-coded under the model's own next-token distribution.

About log2 PP bits per position; decoding steps the model once per token. K/V come back by
canonical recomputation plus a residual (session_codec.py).
"""

from __future__ import annotations

from seqkv_cli.errors import SeqkvError
from seqkv_cli.sequential.session_codec import SessionCodec


class SeqCodec(SessionCodec):
    codec_id = "seq"
    description = (
        "token ids range-coded under the model (≈ log2 PP bits/position) + exact "
        "K/V recomputation + residual; decode steps the model per token"
    )
    steps_model = True

    def encode_tokens(self, tokens, adapter):
        from seqkv_codecs.sequential import encode_tokens_with_stats

        data, stats = encode_tokens_with_stats(
            tokens, adapter, precision_bits=self.precision_bits, chunk_size=self.chunk_size
        )
        return data, stats.ideal_bits

    def decode_tokens_many(self, datas, adapter):
        from seqkv_cli.sequential.adapter import drafts_enabled
        from seqkv_codecs.sequential.batch_decode import decode_tokens_batch

        return decode_tokens_batch(datas, adapter, with_states=True, drafts=drafts_enabled())

    def screen_tokens(self, entry: dict, data: bytes | None, canon) -> None:
        """The stream's header must name the model's vocabulary and the session's length."""
        from seqkv_codecs.errors import CodecError
        from seqkv_codecs.sequential.token_coder import read_token_stream_info

        try:
            info = read_token_stream_info(data if data is not None else b"")
        except CodecError as exc:
            raise SeqkvError(str(exc)) from None
        if info.vocab_size != canon.vocab_size:
            raise SeqkvError(
                f"its token stream was coded with a {info.vocab_size}-token vocabulary; "
                f"the model has {canon.vocab_size}"
            )
        if info.n_tokens != entry["positions"] or info.n_tokens > canon.max_context:
            raise SeqkvError(
                f"its token stream holds {info.n_tokens} tokens; the header says "
                f"{entry['positions']} and the model context is {canon.max_context}"
            )
