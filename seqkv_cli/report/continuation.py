"""What a lossy cache does to generation: perplexity change and greedy agreement.

Both compare the same model continuing from the original cache and from the restored one:

* held-out perplexity: the last h = min(N, n // 2) tokens of the session are scored given the
  cache of the positions before them (restored or original); the change is in bits/token;
* greedy agreement: from the cache of the first n - 1 positions plus the last token, the
  original cache generates N greedy tokens; the restored cache is fed the same tokens
  (teacher forcing, one forward pass) and we count how often its argmax agrees. Generation
  from the restored cache follows the original exactly up to the first disagreement, so that
  index is the number of identical greedy tokens (`greedy_prefix`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MIN_POSITIONS = 4  # fewer leaves no prefix to continue from and nothing to hold out


@dataclass
class ContinuationResult:
    delta_log2_ppl: float
    ppl_ratio: float
    greedy_agreement: float
    greedy_prefix: int


class Continuation:
    """The original session's reference run; `measure` compares a restored cache with it."""

    def __init__(self, lm, original, tokens: int) -> None:
        self.lm, self.n = lm, tokens
        self.ids = original.tokens.to(torch.long)
        self.heldout = min(tokens, len(self.ids) // 2)
        self.ref_bits = self._heldout_bits(original)
        self.greedy = self._greedy(original)

    @staticmethod
    def possible(positions: int) -> bool:
        return positions >= MIN_POSITIONS

    def measure(self, restored) -> ContinuationResult:
        bits = self._heldout_bits(restored)
        inputs = torch.cat([self.ids[-1:], self.greedy[:-1]])
        logits = self._forward(restored, len(self.ids) - 1, inputs)
        agree = (logits.argmax(-1) == self.greedy).tolist()
        prefix = agree.index(False) if False in agree else len(agree)
        delta = bits - self.ref_bits
        return ContinuationResult(delta, 2.0**delta, sum(agree) / len(agree), prefix)

    def _heldout_bits(self, cap) -> float:
        """Mean surprisal (bits) of the last `heldout` tokens given the cache before them."""
        from seqkv_cli.kvcapture.engine import surprisal_bits

        start = len(self.ids) - self.heldout
        logits = self._forward(cap, start - 1, self.ids[start - 1 : -1])
        return float(surprisal_bits(logits, self.ids[start:]).mean())

    @torch.inference_mode()
    def _greedy(self, cap) -> torch.Tensor:
        from seqkv_cli.runtime.hfcompat import forward_with_cache

        cache = _cache(cap, len(self.ids) - 1, self.lm.fp32_model())
        nxt, out = self.ids[-1:], []
        for _ in range(self.n):
            logits, cache = forward_with_cache(self.lm.fp32_model(), nxt[None], cache)
            nxt = logits[0, -1:].argmax(-1)
            out.append(nxt)
        return torch.cat(out)

    @torch.inference_mode()
    def _forward(self, cap, upto: int, inputs: torch.Tensor) -> torch.Tensor:
        """fp32 logits (len(inputs), vocab) of `inputs` after the cache of positions < upto."""
        from seqkv_cli.runtime.hfcompat import forward_with_cache

        logits, _ = forward_with_cache(
            self.lm.fp32_model(), inputs[None], _cache(cap, upto, self.lm.fp32_model())
        )
        return logits[0].float()


def _cache(cap, upto: int, model):
    """A DynamicCache of the first `upto` positions of a capture (fp32, batch 1), on the
    model's device."""
    from seqkv_cli.kvcapture.caches import to_dynamic_cache
    from seqkv_cli.runtime.devices import model_device

    return to_dynamic_cache(cap, torch.float32, model_device(model), upto)
