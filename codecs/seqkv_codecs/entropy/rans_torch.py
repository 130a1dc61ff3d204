"""The lane-interleaved rANS of rans_numpy written with torch ops, for CPU and CUDA tensors.

Same tables, same arithmetic (int64 tensors hold the 32-bit states), same word order, so the
bytes match the numpy backend exactly. The step loops avoid host reads: the words a decode step
needs are found with a prefix sum instead of ``nonzero``, so CUDA is synchronised only once every
``_CHECK_EVERY`` steps. torch is imported inside the functions only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from seqkv_codecs.entropy import stream
from seqkv_codecs.entropy.freq import decoder_tables, encoder_table
from seqkv_codecs.errors import CorruptStreamError

if TYPE_CHECKING:
    import torch

_CHECK_EVERY = 256  # steps between host reads of the word position (a CUDA sync each)


def encode_symbols_torch(
    symbols: torch.Tensor, alphabet_size: int, *, lanes: int | None = None
) -> bytes:
    """Entropy-code a 1-D integer tensor; the work stays on the tensor's device."""
    import torch

    alphabet_size = stream.check_alphabet(alphabet_size)
    if (
        symbols.ndim != 1
        or symbols.dtype.is_floating_point
        or symbols.dtype.is_complex
        or symbols.dtype == torch.bool
    ):
        raise ValueError(
            f"symbols must be a 1-D integer tensor, got {symbols.ndim}-D {symbols.dtype}"
        )
    sym = symbols if symbols.dtype == torch.uint8 else symbols.to(torch.int64)
    n = sym.numel()
    if n:
        stream.check_range(*(int(v) for v in torch.aminmax(sym)), alphabet_size)
    counts = torch.bincount(sym, minlength=alphabet_size).cpu().numpy().astype(np.int64)
    return stream.encode_stream(
        counts,
        n,
        alphabet_size,
        lanes,
        lambda freqs, precision, lanes: _encode(sym, freqs, precision, lanes),
    )


def _encode(
    sym: torch.Tensor, freqs: np.ndarray, precision: int, lanes: int
) -> tuple[np.ndarray, np.ndarray]:
    import torch

    dev = sym.device
    n = sym.numel()
    steps, last = stream.step_shape(n, lanes)
    table = encoder_table(freqs).astype(np.int64)
    packed = torch.from_numpy(table).to(dev)
    fdiv = torch.from_numpy((table & 0xFFFF).astype(np.float64)).to(dev)
    total = 1 << precision
    flags = torch.zeros((steps, lanes), dtype=torch.bool, device=dev)
    low = torch.empty((steps, lanes), dtype=torch.int32, device=dev)
    x = torch.full((lanes,), stream.STATE_LOW, dtype=torch.int64, device=dev)
    for t in range(steps - 1, -1, -1):
        k = last if t == steps - 1 else lanes
        xs = x[:k]
        s = sym[t * lanes : t * lanes + k].long()
        e = torch.index_select(packed, 0, s)
        f = e & 0xFFFF
        flag = torch.ge(xs, f << (32 - precision), out=flags[t, :k])
        torch.bitwise_and(xs, 0xFFFF, out=low[t, :k])
        xs >>= flag.view(torch.uint8) << 4
        # floor(x / f) via float64, exact for x < 2**32 and f < 2**16 (as in rans_numpy)
        q = torch.div(xs, torch.index_select(fdiv, 0, s)).long()
        xs += q * (total - f)
        xs += e >> 16
    words = np.compress(flags.cpu().numpy().ravel(), low.cpu().numpy().ravel()).astype(np.uint16)
    return x.cpu().numpy().astype(np.uint32), words


def decode_symbols_torch(
    data: bytes | memoryview,
    device: str | torch.device | None = None,
    *,
    max_symbols: int | None = None,
) -> torch.Tensor:
    """Decode a stream on ``device``: uint8 tensor for alphabets <= 256 symbols, else uint16."""
    import torch

    parsed = stream.unpack(data, max_symbols)
    dev = torch.device(device or "cpu")
    wide = parsed.alphabet_size > 256
    work = torch.int32 if wide else torch.uint8  # torch's uint16 lacks most ops
    if parsed.states.size == 0:  # zero or one distinct symbol
        out = torch.full((parsed.n_symbols,), int(np.argmax(parsed.freqs)), dtype=work, device=dev)
    else:
        out = _decode(parsed, dev, work)
    return out.to(torch.uint16) if wide else out


def _decode(parsed: stream.Stream, dev: torch.device, work: torch.dtype) -> torch.Tensor:
    import torch

    n, precision, n_words = parsed.n_symbols, parsed.precision, parsed.words.size
    slot_sym, slot_packed = decoder_tables(parsed.freqs, precision)
    slot_sym = torch.from_numpy(slot_sym).to(dev, work)
    slot_packed = torch.from_numpy(slot_packed.astype(np.int64)).to(dev)
    # padded at both ends: lane j of a step reads words[pos + (renormalising lanes <= j)]
    words = torch.from_numpy(np.concatenate(([0], parsed.words, [0])).astype(np.int64)).to(dev)
    x = torch.from_numpy(parsed.states.astype(np.int64)).to(dev)
    out = torch.empty(n, dtype=work, device=dev)
    lanes = x.numel()
    steps, last = stream.step_shape(n, lanes)
    mask = (1 << precision) - 1
    pos = torch.zeros((), dtype=torch.int64, device=dev)
    for t in range(steps):
        k = last if t == steps - 1 else lanes
        xs = x[:k]
        slot = xs & mask
        torch.index_select(slot_sym, 0, slot, out=out[t * lanes : t * lanes + k])
        e = torch.index_select(slot_packed, 0, slot)
        xs >>= precision
        xs *= e & 0xFFFF
        xs += e >> 16
        need = (xs < stream.STATE_LOW).long()
        ends = torch.cumsum(need, 0)
        ends += pos
        # past the last word (corrupt data) read the pad word; the end check reports it
        w = torch.index_select(words, 0, ends.clamp_(max=n_words + 1))
        xs <<= need << 4
        xs |= w.mul_(need)
        pos = ends[-1]
        if t % _CHECK_EVERY == _CHECK_EVERY - 1 and int(pos) > n_words:
            raise CorruptStreamError(f"rANS stream ran out of words at symbol {t * lanes}")
    if int(pos) != n_words:
        raise CorruptStreamError("rANS stream word count does not match what its lanes read")
    if not bool((x == stream.STATE_LOW).all()):
        raise CorruptStreamError("rANS lanes did not end in their initial state")
    return out
