"""Draft tokens for draft-and-verify decoding: n-gram lookup over what is already decoded.

A token decoder must step the model once per token, but a model pass over a few rows costs
little more than over one (the weights are read once). The decoder feeds the token it just
decoded plus a guess of the next few; the arithmetic decoder then decodes the real token at
each guessed position from the stored stream, so every correct guess is a token gained and
the first wrong one is still decoded correctly — the guesses change only how many passes a
session takes, never a decoded bit (the forward gives a row the same bits whatever rows sit
beside it; docs/NUMERICS.md).

Guesses come from the decoded text itself: the latest earlier occurrence of the last n tokens
(n = 3 down to 1) in any stream of this restore — the session's own prefix (prompt lookup)
and the sessions decoded beside it (agent snapshots and chats repeat each other). How many
tokens to guess follows the measured acceptance of each n: a guess is worth its row when the
chance that it and all guesses before it are right exceeds `ROW_WORTH`, the cost of one more
row relative to a pass (measured on the portable forward of SmolLM2-135M at 300 positions:
2 rows 1.07 x one row, 4 rows 1.20 x, 8 rows 1.44 x).
"""

from __future__ import annotations

MAX_NGRAM = 3  # 4-grams added nothing measurable on sample_data (tau 1.43 vs 1.42)
MAX_ENTRIES = 1 << 17  # per n-gram length: bounds the index (~80 MB) on very long restores
MAX_DRAFT = 7  # with the token decoded last: 8 rows, one row block of the forward
ROW_WORTH = 0.1
ROW_BUDGET = 16  # rows of one pass, decoded tokens and guesses of all sequences together


class Stream:
    """One sequence being decoded: `context` (the tokens before it, for its first n-grams)
    and its own tokens as they are decoded."""

    def __init__(self, context=()) -> None:
        self.context = [int(t) for t in list(context)[-MAX_NGRAM:]]
        self.tokens: list[int] = []

    def tail(self, n: int) -> tuple[int, ...] | None:
        """The last `n` tokens of context + tokens, or None if there are fewer."""
        if len(self.tokens) >= n:
            return tuple(self.tokens[-n:])
        have = self.context + self.tokens
        return tuple(have[-n:]) if len(have) >= n else None


class DraftIndex:
    """The n-grams of every stream of one restore, each pointing at what followed it last."""

    def __init__(self, max_draft: int = MAX_DRAFT) -> None:
        self.max_draft = max_draft
        # n-gram -> (stream, index of the token that followed it)
        self._where: list[dict] = [{} for _ in range(MAX_NGRAM + 1)]
        # accepted / tried draft tokens per n-gram length (a prior of one in three: two
        # guesses at first, none after a few misses, more as they prove right)
        self._stats = [[1.0, 3.0] for _ in range(MAX_NGRAM + 1)]
        self.proposed = 0  # draft tokens fed
        self.accepted = 0  # of them, right

    def extend(self, stream: Stream, tokens) -> None:
        """`tokens` were decoded next in `stream`: index the n-grams they complete."""
        for t in tokens:
            t = int(t)
            for n in range(1, MAX_NGRAM + 1):
                key = stream.tail(n)
                if key is not None:
                    where = self._where[n]
                    if len(where) >= MAX_ENTRIES:
                        where.clear()  # start over: older text is the least likely source
                    where[key] = (stream, len(stream.tokens))
            stream.tokens.append(t)

    def draft(self, stream: Stream, limit: int) -> tuple[list[int], int]:
        """Up to `limit` guesses of the tokens after `stream`'s last one, and the n-gram
        length they came from (0: none)."""
        limit = min(limit, self.max_draft)
        if limit <= 0:
            return [], 0
        for n in range(MAX_NGRAM, 0, -1):
            key = stream.tail(n)
            hit = None if key is None else self._where[n].get(key)
            if hit is None:
                continue
            source, at = hit
            guess = source.tokens[at : at + limit]
            accepted, tried = self._stats[n]
            rate = accepted / tried
            worth, chance = 0, rate
            while worth < len(guess) and chance > ROW_WORTH:
                worth += 1
                chance *= rate
            return guess[:worth], n
        return [], 0

    def record(self, n: int, drafted: int, accepted: int) -> None:
        """`drafted` guesses from `n`-grams were fed and the first `accepted` were right."""
        if n <= 0 or drafted <= 0:
            return
        tried = min(accepted + 1, drafted)  # guesses after the first wrong one say nothing
        self._stats[n][0] += accepted
        self._stats[n][1] += tried
        self.proposed += drafted
        self.accepted += accepted
