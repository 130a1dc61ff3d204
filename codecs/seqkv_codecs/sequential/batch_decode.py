"""Decoding several token streams in lockstep: one model pass per position for all of them.

A decoder must feed token i before it can decode token i + 1, so one session costs one model
step per token. Independent sessions do not wait for each other: stepping them as rows of one
pass (``feed_rows``) amortises the weight reads that dominate a step. A model without
``feed_rows`` is fed session by session, which gives the same tokens. `decode_tokens` is the
one-stream case. The stream format itself (parsing, CRCs, one symbol) is token_coder.py's.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from seqkv_codecs.errors import CodecError, CorruptStreamError
from seqkv_codecs.sequential.drafts import MAX_DRAFT, ROW_BUDGET, DraftIndex, Stream
from seqkv_codecs.sequential.logits_model import LogitsModel, feed_checked
from seqkv_codecs.sequential.probability import frequencies_from_logits
from seqkv_codecs.sequential.rangecoder import RangeDecoder
from seqkv_codecs.sequential.token_coder import (
    decode_one_token,
    parse_token_stream,
    token_crc,
    uniform_row,
)


@dataclass
class _Cursor:
    """Where one session's decoder stands."""

    chunks: list
    out: np.ndarray
    state: object
    pos: int = 0
    chunk: int = -1
    dec: RangeDecoder | None = None
    error: CorruptStreamError | None = None
    stream: Stream | None = None  # what drafts.py has seen of this sequence

    @property
    def live(self) -> bool:
        return self.error is None and self.pos < len(self.out)


def decode_tokens(data: bytes, model: LogitsModel) -> np.ndarray:
    """Decode a stream from `encode_tokens` with the same model; int64 ids (N,)."""
    [result] = decode_tokens_batch([data], model)
    if isinstance(result, Exception):
        raise result
    return result


def decode_tokens_batch(
    datas: list[bytes], model: LogitsModel, *, with_states: bool = False, drafts: bool = True
) -> list:
    """Decode each stream; a damaged one yields its error in place, the others still decode.

    A model with ``feed_drafts(states, lists)`` (logits of each list, or of the prefix it
    had room for) and ``accept(state, ids, logits, n)`` (keep the first n) gets guessed
    tokens beside each decoded one (drafts.py) unless `drafts` is false; the tokens are the
    same either way.

    With `with_states`, each result is a pair (tokens or error, the model state the decoder
    fed, or None for streams of fewer than two tokens), so a caller can read what the model
    computed on the way (seqkv reads the K/V cache from it).
    """
    cursors: list[_Cursor | Exception] = []
    precision = {}
    for k, data in enumerate(datas):
        try:
            info, chunks = parse_token_stream(data)
        except CorruptStreamError as exc:
            cursors.append(exc)
            continue
        # Each stream is checked on its own: a damaged one fails in place, not the batch.
        if model.vocab_size != info.vocab_size:
            cursors.append(
                CodecError(
                    f"the token stream was coded with a {info.vocab_size}-token vocabulary; "
                    f"this model has {model.vocab_size}: use the model that encoded it"
                )
            )
            continue
        n = info.n_tokens
        limit = getattr(model, "max_context", None)
        if limit is not None and n > limit:
            cursors.append(
                CorruptStreamError(f"token stream claims {n} tokens, past the model's {limit}")
            )
            continue
        try:
            state = model.start(n - 1) if n > 1 else None
        except Exception as exc:  # the model refuses this stream's length (its context, memory)
            cursors.append(CorruptStreamError(f"token stream of {n} tokens: {exc}"))
            continue
        cursors.append(_Cursor(chunks, np.zeros(n, dtype=np.int64), state))
        precision[k] = info.precision_bits
    for k, c in enumerate(cursors):
        if isinstance(c, _Cursor) and c.live:
            _step(c, uniform_row(model.vocab_size, precision[k]), precision[k])
    drafter = DraftIndex() if drafts and hasattr(model, "feed_drafts") else None
    for c in cursors:
        if drafter is not None and isinstance(c, _Cursor):
            c.stream = Stream()
            drafter.extend(c.stream, c.out[: c.pos])
    while True:
        live = [k for k, c in enumerate(cursors) if isinstance(c, _Cursor) and c.live]
        if not live:
            break
        limit = min(MAX_DRAFT, ROW_BUDGET // len(live) - 1) if drafter is not None else 0
        guesses = [_guess(drafter, cursors[k], limit) for k in live] if limit > 0 else []
        if any(g for g, _ in guesses):
            _feed_guesses(model, drafter, [cursors[k] for k in live], guesses, precision, live)
            continue
        logits = _feed(model, [cursors[k] for k in live])
        for row, k in enumerate(live):
            p = precision[k]
            _step(cursors[k], frequencies_from_logits(logits[row], p), p)
            _index(drafter, cursors[k])
    results = [c if isinstance(c, Exception) else (c.error if c.error else c.out) for c in cursors]
    if with_states:
        states = [None if isinstance(c, Exception) else c.state for c in cursors]
        return list(zip(results, states, strict=True))
    return results


def _feed(model, cursors: list[_Cursor]) -> np.ndarray:
    tokens = np.array([c.out[c.pos - 1] for c in cursors], dtype=np.int64)
    feed_rows = getattr(model, "feed_rows", None)
    if feed_rows is not None:
        logits = np.asarray(feed_rows([c.state for c in cursors], tokens))
        if logits.shape != (len(cursors), model.vocab_size):
            raise CodecError(f"feed_rows returned logits of shape {logits.shape}")
        return logits
    rows = [feed_checked(model, c.state, tokens[i : i + 1]) for i, c in enumerate(cursors)]
    return np.concatenate(rows)


def _guess(drafter: DraftIndex, c: _Cursor, limit: int) -> tuple[list[int], int]:
    """Guesses of the tokens after c.pos - 1; the last token is never fed, so at most the
    tokens left before it."""
    return drafter.draft(c.stream, min(limit, len(c.out) - c.pos - 1))


def _index(drafter: DraftIndex | None, c: _Cursor) -> None:
    """Tell the drafter the token `_step` just decoded (nothing if it failed)."""
    if drafter is not None and c.error is None:
        drafter.extend(c.stream, c.out[c.pos - 1 : c.pos])


def _feed_guesses(model, drafter, cursors, guesses, precision, keys) -> None:
    """Feed each cursor's last token and its guesses in one pass; decode while they hold."""
    lists = [[int(c.out[c.pos - 1]), *g] for c, (g, _) in zip(cursors, guesses, strict=True)]
    outs = model.feed_drafts([c.state for c in cursors], lists)
    for c, ids, logits, (_, ngram), k in zip(cursors, lists, outs, guesses, keys, strict=True):
        logits = np.asarray(logits)
        if (
            logits.ndim != 2
            or logits.shape[1] != model.vocab_size
            or not 1 <= len(logits) <= len(ids)
        ):
            raise CodecError(f"feed_drafts returned logits of shape {logits.shape}")
        kept = 0
        for j in range(len(logits)):
            kept = j + 1
            _step(c, frequencies_from_logits(logits[j], precision[k]), precision[k])
            _index(drafter, c)
            if not c.live or j + 1 == len(logits) or int(c.out[c.pos - 1]) != ids[j + 1]:
                break
        model.accept(c.state, ids, logits, kept)
        drafter.record(ngram, len(logits) - 1, kept - 1)


def _step(c: _Cursor, row: np.ndarray, precision: int) -> None:
    """Decode position c.pos with frequency `row`, opening and closing chunks around it."""
    if c.dec is None:
        c.chunk += 1
        c.dec = RangeDecoder(c.chunks[c.chunk][2])
    first, stop, _, crc = c.chunks[c.chunk]
    where = f"token chunk {c.chunk} (positions {first}..{stop - 1})"
    try:
        c.out[c.pos] = decode_one_token(c.dec, row, precision)
        c.pos += 1
        if c.pos == stop:
            if token_crc(c.out[first:stop]) != crc:
                c.error = CorruptStreamError(
                    f"{where} failed its CRC: the decoder's model or numerics differ from the "
                    "encoder's (or the stream is damaged)"
                )
                return
            c.dec.finish_check()
            c.dec = None
    except CorruptStreamError as exc:
        c.error = CorruptStreamError(
            f"{where} could not be decoded ({exc}): the decoder's model or numerics differ "
            "from the encoder's, or the stream is damaged"
        )
