"""External baseline: transformers' own `QuantizedCache` with the optimum-quanto backend.

Optional (`pip install 'seqkv[quanto]'`). Each layer's K/V of a capture is put through a
`QuantoQuantizedLayer` in one prefill-sized update, which quantizes every position (the
full-precision window of `residual_length` only fills up during later decoding steps). The
cost is the in-memory size of the quantized tensors — packed integers plus per-group scale and
shift — and the restored cache is what the layer dequantizes: exactly what generation would
attend to.
"""

from __future__ import annotations

from seqkv_cli.report.row import PARTS, Row

QUANTO_CODECS = {"hf-quanto2": 2, "hf-quanto4": 4}
GROUP_SIZE = 64  # QuantizedCache's default q_group_size; head_dim where 64 does not divide


def quanto_available() -> bool:
    from transformers.utils import is_optimum_quanto_available

    return is_optimum_quanto_available()


def quantize_capture(capture, nbits: int):
    """(restored Capture, bits used) for one capture through QuantoQuantizedLayer."""
    from transformers.cache_utils import QuantoQuantizedLayer

    from seqkv_cli.kvcapture.capture_file import Capture

    dtype = capture.keys[0].dtype
    keys, values, bits = [], [], 0
    for k, v in zip(capture.keys, capture.values, strict=True):
        # quanto groups the flattened (heads, n, head_dim) tensor: 64 must divide it
        group = GROUP_SIZE if k.numel() % GROUP_SIZE == 0 else k.shape[-1]
        layer = QuantoQuantizedLayer(nbits=nbits, q_group_size=group)
        layer.update(k[None].float(), v[None].float())
        for q, out in ((layer._quantized_keys, keys), (layer._quantized_values, values)):
            bits += 8 * _storage_bytes(q)
            out.append(layer._dequantize(q)[0].to(dtype))
    meta = dict(capture.meta)
    restored = Capture(capture.tokens, keys, values, capture.surprisal.clone(), meta)
    return restored, bits


def _storage_bytes(t) -> int:
    """Bytes of a (possibly nested) tensor subclass: the sum of its inner plain tensors."""
    flatten = getattr(type(t), "__tensor_flatten__", None)
    if flatten is None:
        return t.numel() * t.element_size()
    names, _ = t.__tensor_flatten__()
    return sum(_storage_bytes(getattr(t, name)) for name in names)


def quanto_row(session_id: str, cap, group, codec: str, role: str, bits: int) -> Row:
    """The row of one capture through QuantizedCache: all its bits are quantized K/V."""
    n = cap.positions
    return Row(
        id=session_id,
        codec=codec,
        codec_config={"id": codec, "backend": "quanto", "nbits": QUANTO_CODECS[codec]},
        model=group.name,
        model_fingerprint=group.fingerprint,
        source="transformers QuantizedCache",
        role=role,
        lossless=False,
        positions=n,
        dtype=cap.meta.get("dtype", "?"),
        components_per_position=2 * sum(k.shape[0] * k.shape[2] for k in cap.keys),
        log2_ppl=cap.log2_ppl if n > 1 else None,
        breakdown={**dict.fromkeys(PARTS, 0.0), "kv": float(bits)},
    )
