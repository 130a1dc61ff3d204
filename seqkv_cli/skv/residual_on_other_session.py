"""Residuals that rest on another session of the same trie segment (`SKB1` parts).

For a session whose first p positions have the same K/V bits as an earlier session of its
segment (llama.cpp slots sharing a system prompt), the encoder may code its residual against
that session's restored K/V for [0, p) and the recompute after it (trie/encode.py). Restore
decodes both sessions' token paths as usual, then applies such parts once the base session
is finished (skv/restore_trie.py). A base never rests on another session itself.
"""

from __future__ import annotations

import numpy as np
import torch

from seqkv_cli.errors import SeqkvError


def residual_base(entry: dict, read) -> int | None:
    """The global index of the session `entry`'s residual rests on, or None (the parts'
    headers are read; every based part must name the same earlier session)."""
    from seqkv_codecs.errors import CodecError
    from seqkv_codecs.residual import BASED_MAGIC, parse_based

    found = set()
    for layer in range(int(entry["shapes"]["num_layers"])):
        for kind in ("key", "value"):
            data = read(f"residual.layers.{layer}.{kind}")
            if data is None or data[:4] != BASED_MAGIC:
                continue
            try:
                found.add(parse_based(data)[0])
            except CodecError as exc:
                raise SeqkvError(f"residual.layers.{layer}.{kind}: {exc}") from None
    if not found:
        return None
    local = int(entry["trie"]["local"])
    if len(found) > 1 or min(found) >= local:
        raise SeqkvError(
            f"its residual rests on sessions {sorted(found)} of its segment; one earlier "
            "session is allowed: the file is damaged"
        )
    return int(entry["index"]) - local + found.pop()


def rest_on(cap, base) -> object:
    """`cap` with its deferred residual parts applied on `base`'s K/V for their positions."""
    from seqkv_cli.sequential.session_codec import kv_bits, kv_from_bits, residual_p95
    from seqkv_codecs.errors import CodecError
    from seqkv_codecs.residual import apply_residual

    for (kind, layer), (_, positions, inner, tail) in sorted(cap.deferred.items()):
        mine = (cap.keys if kind == "key" else cap.values)[layer]
        theirs = (base.keys if kind == "key" else base.values)[layer]
        if (
            theirs.dtype != mine.dtype
            or theirs.shape[0] != mine.shape[0]
            or theirs.shape[2] != mine.shape[2]
            or not 0 < positions <= min(mine.shape[1], theirs.shape[1])
        ):
            raise SeqkvError(
                f"residual.layers.{layer}.{kind} rests on {positions} positions of a session "
                f"of another shape ({tuple(theirs.shape)} vs {tuple(mine.shape)})"
            )
        reference = torch.cat([theirs[:, :positions], mine[:, positions:]], dim=1)
        try:
            if tail is None:
                bits = apply_residual(inner, kv_bits(reference))
            else:
                bits = _apply_rounding(inner, theirs[:, :positions], tail, mine.dtype)
        except CodecError as exc:
            raise SeqkvError(f"residual.layers.{layer}.{kind}: {exc}") from None
        restored = kv_from_bits(np.ascontiguousarray(bits), mine.dtype)
        (cap.keys if kind == "key" else cap.values)[layer] = restored
        if cap.residual_p95 is not None:  # the residual is against the base where it rests
            cap.residual_p95[kind][layer] = residual_p95(reference, restored)
    cap.deferred = {}
    return cap


def _apply_rounding(inner: bytes, shared: torch.Tensor, tail: torch.Tensor, dtype) -> np.ndarray:
    """An SKR2 stream against the base's K/V (exact in float32, so their rounding is the same
    bits) for the shared positions and this session's unrounded recompute after them."""
    from seqkv_cli.kvcapture.capture_file import DTYPE_NAMES
    from seqkv_codecs.rounding_residual import apply_rounding_residual

    if tail.shape[0::2] != shared.shape[0::2]:
        raise SeqkvError("the recompute after a shared prefix has another shape")
    reference = torch.cat([shared.float(), tail.float()], dim=1).contiguous()
    return apply_rounding_residual(inner, reference.numpy(), DTYPE_NAMES[dtype])
