"""Running a model over token ids and collecting K/V, surprisal and provenance."""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Callable

import torch

from seqkv_cli.errors import SeqkvError
from seqkv_cli.kvcapture.capture_file import DTYPES, Capture

CHUNK = 256  # positions per forward call: bounds memory (logits are n x vocab)
HF_NUMERIC_PATH = f"transformers-fp32-chunk{CHUNK}"


def tokenize(lm, doc) -> list[int]:
    """Token ids of a document: plain text as is, chat sessions through the chat template."""
    tok = lm.tokenizer
    if doc.messages is not None:
        if not getattr(tok, "chat_template", None):
            raise SeqkvError(f"{doc.source}: the model's tokenizer has no chat template")
        text = tok.apply_chat_template(list(doc.messages), tokenize=False)
    else:
        text = doc.text
    return list(tok(text, add_special_tokens=False).input_ids)


SURPRISAL_ROWS = 4  # rows per float64 log-softmax: stays in cache (profiled: ~6x faster)


def surprisal_bits(logits: torch.Tensor, next_ids: torch.Tensor) -> torch.Tensor:
    """-log2 P(next | prefix) in float64 for each row of fp32 logits.

    Rows are independent: blocking them changes speed, not a bit of the result.
    """
    ids = next_ids[:, None].long()
    parts = [
        torch.log_softmax(logits[r : r + SURPRISAL_ROWS].double(), dim=-1).gather(
            1, ids[r : r + SURPRISAL_ROWS]
        )[:, 0]
        for r in range(0, len(ids), SURPRISAL_ROWS)
    ]
    lp = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64)
    return -lp / math.log(2)


def run_capture(
    lm,
    token_ids: list[int],
    *,
    dtype: str = "bf16",
    canonical: bool = True,
    on_progress: Callable[[int], None] | None = None,
) -> Capture:
    """Run `lm` over `token_ids`; return K/V in `dtype`, surprisal and metadata."""
    if dtype not in DTYPES:
        raise SeqkvError(f"unknown dtype '{dtype}'; choose one of {', '.join(DTYPES)}")
    if not token_ids:
        raise SeqkvError("nothing to capture: the input has no tokens")
    ids = torch.tensor(token_ids, dtype=torch.long)
    if canonical:
        keys, values, surprisal, path = _canonical(lm, ids, on_progress)
    else:
        keys, values, surprisal, path = _transformers(lm, ids, on_progress)
    target = DTYPES[dtype]
    meta = provenance(lm, dtype=dtype, numeric_path=path, positions=len(token_ids))
    return Capture(
        ids, [k.to(target) for k in keys], [v.to(target) for v in values], surprisal, meta
    )


def _canonical(lm, ids, on_progress):
    from seqkv_cli.runtime.canonical import NUMERIC_PATH

    canon = canonical_model(lm)
    state = canon.new_state(len(ids))
    parts = []
    for start in range(0, len(ids), CHUNK):
        chunk = ids[start : start + CHUNK]
        logits = canon.forward(state, chunk)
        nxt = ids[start + 1 : start + 1 + len(chunk)]
        parts.append(surprisal_bits(logits[: len(nxt)], nxt))
        if on_progress:
            on_progress(len(chunk))
    keys = [state.layer_kv(i)[0].clone() for i in range(canon.num_layers)]
    values = [state.layer_kv(i)[1].clone() for i in range(canon.num_layers)]
    return keys, values, torch.cat(parts), NUMERIC_PATH


def canonical_model(lm):
    """The canonical forward of a loaded model, built once per LoadedModel."""
    from seqkv_cli.runtime.canonical import CanonicalLM, check_row_invariance

    if "canonical" not in lm.extra:
        if not check_row_invariance():
            raise SeqkvError(
                "this machine's BLAS is not row-invariant; canonical numerics "
                "cannot be guaranteed here (use --no-canonical)"
            )
        lm.extra["canonical"] = CanonicalLM(lm.model)
    return lm.extra["canonical"]


@torch.inference_mode()
def _transformers(lm, ids, on_progress):
    """An ordinary transformers fp32 run (DynamicCache, default attention), chunked prefill."""
    from transformers import DynamicCache

    from seqkv_cli.runtime.hfcompat import forward_with_cache

    cache = DynamicCache()
    parts = []
    for start in range(0, len(ids), CHUNK):
        chunk = ids[start : start + CHUNK]
        logits, cache = forward_with_cache(lm.model, chunk[None], cache)
        nxt = ids[start + 1 : start + 1 + len(chunk)]
        parts.append(surprisal_bits(logits[0, : len(nxt)].float(), nxt))
        if on_progress:
            on_progress(len(chunk))
    keys = [layer.keys[0].clone() for layer in cache.layers]
    values = [layer.values[0].clone() for layer in cache.layers]
    return keys, values, torch.cat(parts), HF_NUMERIC_PATH


def provenance(lm, *, dtype: str, numeric_path: str, positions: int) -> dict:
    import transformers

    from seqkv_cli import __version__

    return {
        "model_name": lm.name,
        "model_source": lm.source,
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
        "created": dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }
