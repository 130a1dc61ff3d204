"""Running a model over token ids and collecting K/V, surprisal and provenance."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from seqkv_cli.clock import created_utc
from seqkv_cli.errors import SeqkvError
from seqkv_cli.kvcapture.capture_file import DTYPES, Capture
from seqkv_cli.runtime.surprisal import surprisal_bits

if TYPE_CHECKING:
    from seqkv_cli.kvcapture.inputs import Document
    from seqkv_cli.runtime.forward import CanonicalForward
    from seqkv_cli.runtime.loading import LoadedModel

CHUNK = 256  # positions per forward call: bounds memory (logits are n x vocab)
HF_NUMERIC_PATH = f"transformers-fp32-chunk{CHUNK}"


class SessionTooLong(SeqkvError):
    """A text too long for the model's context, found before the tokenizer runs."""

    def __init__(self, message: str, at_least: int) -> None:
        super().__init__(message)
        self.at_least = at_least  # tokens the text has at the least


# A tokenizer's output for one huge word can be ~50x its text in memory (a 30 MB row: 1.4 GB
# and a Rust abort), so texts are bounded before tokenizing. A token covers at most as many
# characters as its own string has (byte-level BPE: one character a byte; SentencePiece:
# the text itself); the 2x margin is for normalizers that fold character sequences.
_TOKEN_CHARS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
MAX_COUNTED_TOKEN_CHARS = 256  # a token longer than this counts as this long (docs/MODELS.md)
MAX_TOKENIZER_CHARS = 1 << 24  # characters given to a tokenizer at once, whatever the context


def max_token_chars(tok: object) -> int:
    """The most characters of text any one token of `tok` can cover (computed once)."""
    try:
        return _TOKEN_CHARS[tok]
    except (KeyError, TypeError):
        pass
    pieces = tok.convert_ids_to_tokens(list(range(len(tok))))
    longest = max((len(p) for p in pieces if isinstance(p, str)), default=1)
    # A tokenizer's files can hold one token of megabytes: it would lift the bound for
    # every text. Tokens of real vocabularies are at most a few hundred characters.
    longest = min(longest, MAX_COUNTED_TOKEN_CHARS)
    with contextlib.suppress(TypeError):
        _TOKEN_CHARS[tok] = longest
    return longest


def check_text_length(lm: LoadedModel, text: str, source: str) -> None:
    """Refuse, before the tokenizer allocates anything, a text that must hold more tokens
    than the model's context."""
    if len(text) > MAX_TOKENIZER_CHARS:
        raise SessionTooLong(
            f"{source}: {len(text):,} characters; seqkv gives a tokenizer at most "
            f"{MAX_TOKENIZER_CHARS:,} at once (its memory grows with one word's length): "
            "split it into shorter sessions",
            lm.max_context + 1,
        )
    per_token = 2 * max_token_chars(lm.tokenizer)
    if len(text) > lm.max_context * per_token:
        at_least = max(len(text) // per_token, lm.max_context + 1)
        raise SessionTooLong(
            f"{source}: {len(text):,} characters, at least {at_least:,} tokens: more than the "
            f"model context ({lm.max_context:,}); split it into shorter sessions",
            at_least,
        )


def tokenize(lm: LoadedModel, doc: Document) -> list[int]:
    """Token ids of a document: plain text as is, chat sessions through the chat template
    (a text too long for the context is refused before tokenizing: `SessionTooLong`)."""
    tok = lm.tokenizer
    if getattr(doc, "token_ids", None) is not None:  # given as ids: only their range to check
        ids = list(doc.token_ids)
        if ids and max(ids) >= lm.vocab_size:
            raise SeqkvError(
                f"{doc.source}: token id {max(ids)} is outside the model's vocabulary "
                f"(0..{lm.vocab_size - 1})"
            )
        return ids
    if doc.messages is not None:
        from seqkv_cli.kvcapture.chat_render import render_chat

        text = render_chat(tok, list(doc.messages), str(doc.source))
    else:
        text = doc.text
    check_text_length(lm, text, str(doc.source))
    return list(tok(text, add_special_tokens=False).input_ids)


def run_capture(
    lm: LoadedModel,
    token_ids: list[int],
    *,
    dtype: str = "bf16",
    canonical: bool = True,
    on_progress: Callable[[int], None] | None = None,
    numerics: str | None = None,
) -> Capture:
    """Run `lm` over `token_ids`; return K/V in `dtype`, surprisal and metadata.

    ``numerics`` picks the canonical path (default: the portable one, runtime/numerics.py).
    """
    if dtype not in DTYPES:
        raise SeqkvError(f"unknown dtype '{dtype}'; choose one of {', '.join(DTYPES)}")
    if not token_ids:
        raise SeqkvError("nothing to capture: the input has no tokens")
    ids = torch.tensor(token_ids, dtype=torch.long)
    target = DTYPES[dtype]
    if canonical:
        keys, values, surprisal, path = _canonical(lm, ids, on_progress, numerics, target)
    else:
        keys, values, surprisal, path = _transformers(lm, ids, on_progress, target)
    meta = provenance(lm, dtype=dtype, numeric_path=path, positions=len(token_ids))
    return Capture(ids, keys, values, surprisal, meta)


def _canonical(lm, ids, on_progress, numerics, target: torch.dtype):
    canon = canonical_model(lm, numerics)
    state = canon.new_state(len(ids))
    parts = []
    for start in range(0, len(ids), CHUNK):
        chunk = ids[start : start + CHUNK]
        logits = canon.forward(state, chunk)
        nxt = ids[start + 1 : start + 1 + len(chunk)]
        parts.append(canon.surprisal(logits[: len(nxt)], nxt))
        if on_progress:
            on_progress(len(chunk))
    # Copied out layer by layer in the capture's dtype: a long session's peak is the state
    # plus the capture, not the state plus an fp32 copy of its K/V plus the capture.
    keys = [state.layer_kv(i)[0].to(target, copy=True) for i in range(canon.num_layers)]
    values = [state.layer_kv(i)[1].to(target, copy=True) for i in range(canon.num_layers)]
    return keys, values, torch.cat(parts), canon.numeric_path


def canonical_model(lm: LoadedModel, numerics: str | None = None) -> CanonicalForward:
    """The canonical forward of a loaded model on `numerics`, built once per LoadedModel."""
    from seqkv_cli.runtime.numerics import DEFAULT, PORTABLE_PATHS, build_canonical

    path = numerics or DEFAULT
    key = f"canonical:{path}"
    if key not in lm.extra:
        # The portable path reads the weights where the checkpoint's width holds them; the
        # legacy one multiplies the module's fp32 tensors.
        if path in PORTABLE_PATHS:
            lm.extra[key] = build_canonical(lm.module, path, lm.weights)
        else:
            lm.extra[key] = build_canonical(lm.fp32_model(), path)
    return lm.extra[key]


@torch.inference_mode()
def _transformers(lm, ids, on_progress, target: torch.dtype):
    """An ordinary transformers fp32 run (DynamicCache, default attention), chunked prefill."""
    from transformers import DynamicCache

    from seqkv_cli.runtime.hfcompat import forward_with_cache

    cache = DynamicCache()
    model = lm.fp32_model()
    parts = []
    for start in range(0, len(ids), CHUNK):
        chunk = ids[start : start + CHUNK]
        logits, cache = forward_with_cache(model, chunk[None], cache)
        nxt = ids[start + 1 : start + 1 + len(chunk)]
        parts.append(surprisal_bits(logits[0, : len(nxt)].float(), nxt))
        if on_progress:
            on_progress(len(chunk))
    keys = [layer.keys[0].to("cpu", target, copy=True) for layer in cache.layers]
    values = [layer.values[0].to("cpu", target, copy=True) for layer in cache.layers]
    return keys, values, torch.cat(parts), HF_NUMERIC_PATH


def provenance(lm: LoadedModel, *, dtype: str, numeric_path: str, positions: int) -> dict:
    import transformers

    from seqkv_cli.version import __version__

    return {
        "model_name": lm.name,
        # where to load the model again, only where that names no folder of this machine:
        # a folder's or a .gguf file's path would put the user's directory layout into every
        # archive they share (the name and fingerprint identify the model; older captures
        # that hold a path still load)
        **({"model_source": lm.source} if lm.kind in ("embedded", "hub") else {}),
        "model_fingerprint": lm.fingerprint,
        "tokenizer_fingerprint": lm.tokenizer_fingerprint,
        "dtype": dtype,
        "numeric_path": numeric_path,
        "num_layers": lm.num_layers,
        "num_kv_heads": lm.num_kv_heads,
        "head_dim": lm.head_dim,
        "positions": positions,
        "versions": {
            "seqkv": __version__,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        },
        "created": created_utc(),
    }
