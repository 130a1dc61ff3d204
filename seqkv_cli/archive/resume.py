"""`seqkv resume`: a session restored into a transformers cache, then generation goes on."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from seqkv_cli.errors import SeqkvError

if TYPE_CHECKING:
    from seqkv_cli.kvcapture.capture_file import Capture
    from seqkv_cli.runtime.loading import LoadedModel


def continue_from(lm: LoadedModel, capture: Capture, prompt: str, max_new_tokens: int) -> list[int]:
    """Greedy continuation of `capture` followed by `prompt`, from its cache (no re-prefill)."""
    from seqkv_cli.kvcapture.caches import to_dynamic_cache

    if capture.positions == 0:
        raise SeqkvError("the session is empty; there is nothing to resume")
    prompt_ids = lm.tokenizer(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"][0]
    if capture.positions + len(prompt_ids) + max_new_tokens > lm.max_context:
        raise SeqkvError("the session, prompt and new tokens exceed the model's context")
    ids = torch.cat([capture.tokens.long(), prompt_ids.long()])
    if len(prompt_ids) == 0:
        # generate() needs at least one uncached token: re-feed the session's last one.
        capture = _drop_last(capture)
    from seqkv_cli.runtime.devices import model_device

    model = lm.fp32_model()  # generation runs transformers' own code on fp32 weights
    on = model_device(model)
    cache = to_dynamic_cache(capture, dtype=torch.float32, device=on)
    with torch.no_grad():
        out = model.generate(
            ids[None].to(on),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=on),
            cache=cache,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=lm.tokenizer.eos_token_id or 0,
        )
    return out[0, len(ids) :].tolist()


def _drop_last(capture):
    from seqkv_cli.kvcapture.capture_file import Capture

    return Capture(
        capture.tokens[:-1],
        [k[:, :-1] for k in capture.keys],
        [v[:, :-1] for v in capture.values],
        capture.surprisal[:-1],
        capture.meta,
    )
