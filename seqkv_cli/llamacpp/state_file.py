"""llama.cpp saved states, byte for byte: parse and write what llama.cpp's state files hold.

Two file kinds (llama.cpp's `src/llama-context.cpp`, `src/llama-kv-cache.cpp`; the layouts are
specified in docs/FORMAT.md, "llama.cpp state files"):

* **session** files (`llama_state_save_file`, magic `ggsn`, version 10): token list, the
  model's architecture name, then the KV cache of every sequence;
* **sequence** files (`llama_state_seq_save_file`, magic `ggsq`, version 3): token list, then
  one sequence's KV cache. llama-server's `/slots?action=save` writes these, its token list
  packed as [-1, 1, n, ids..., 0 media chunks].

Only what seqkv can restore exactly is accepted: one sequence in one stream, cells at
positions 0..n-1 covering the token list, K/V in f32, f16 or bf16, no M-RoPE/multimodal cell
extensions, no second (sliding-window) cache. Anything else is refused with one line naming
what was found; `write_state(parse_state(b))` gives back `b` exactly for what is accepted.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from seqkv_cli.errors import SeqkvError
from seqkv_cli.llamacpp.layout import (
    GGML_TYPES,
    MAX_ARCH_BYTES,
    MAX_STREAMS,
    check_arch,
)
from seqkv_codecs.errors import CorruptStreamError
from seqkv_codecs.framing import StreamReader

SESSION_MAGIC = 0x6767736E  # 'ggsn'
SESSION_VERSION = 10
SEQUENCE_MAGIC = 0x67677371  # 'ggsq'
SEQUENCE_VERSION = 3
KINDS = {
    SESSION_MAGIC: ("session", SESSION_VERSION),
    SEQUENCE_MAGIC: ("sequence", SEQUENCE_VERSION),
}
LLAMA_CPP_VERSION = "llama.cpp as vendored by llama-cpp-python 0.3.36"
SERVER_TOKENS_VERSION = 1  # llama-server's packed token list (tools/server/server-common.cpp)
TOKEN_NULL = -1

_OTHER_TYPE_NAMES = {2: "q4_0", 3: "q4_1", 6: "q5_0", 7: "q5_1", 8: "q8_0", 20: "iq4_nl"}


@dataclass
class LayerKV:
    """One layer's cache rows as llama.cpp wrote them (raw bytes, cell-major for K)."""

    k_type: int
    k_row_bytes: int
    k: bytes  # cells x k_row_bytes
    v_type: int
    v_unit: int  # bytes per row (v_trans == 0) or per element (v_trans == 1)
    v_width: int  # n_embd_v_gqa (written only when v_trans == 1; else k-derived, kept 0)
    v: bytes  # cells x row (v_trans 0) or n_embd_v_gqa rows of cells elements (v_trans 1)


@dataclass
class LlamaState:
    """What one llama.cpp state file holds, in the fields seqkv keeps to write it again."""

    kind: str  # "session" | "sequence"
    tokens: list[int]
    token_form: str  # "plain" | "server-v1" (llama-server's packed token list)
    arch: str | None  # session files only
    n_stream: int
    stream: int  # the one stream holding cells
    seq_id: int  # the one sequence every cell belongs to
    v_trans: bool
    layers: list[LayerKV]

    @property
    def cells(self) -> int:
        return len(self.tokens)

    def layout(self) -> dict:
        """The fields (besides tokens and K/V) that make `write_state` give the same bytes."""
        first = self.layers[0]
        return {
            "kind": self.kind,
            "token_form": self.token_form,
            "arch": self.arch,
            "n_stream": self.n_stream,
            "stream": self.stream,
            "seq_id": self.seq_id,
            "v_trans": self.v_trans,
            "k_type": GGML_TYPES[first.k_type][0],
            "v_type": GGML_TYPES[first.v_type][0],
        }


class _Reader:
    """llama.cpp's fields over the codec library's one bounded reader (`framing`): a
    shortfall is one SeqkvError naming the file and the field."""

    def __init__(self, data: bytes, name: str) -> None:
        self.stream, self.name, self.size = StreamReader(data, "llama.cpp state"), name, len(data)

    def take(self, n: int, what: str) -> memoryview:
        try:
            return self.stream.take(n)
        except CorruptStreamError:
            raise SeqkvError(
                f"{self.name}: truncated llama.cpp state ({what} needs {n} bytes at offset "
                f"{self.stream.position}, the file has {self.size})"
            ) from None

    def u32(self, what: str) -> int:
        return struct.unpack("<I", self.take(4, what))[0]

    def i32(self, what: str) -> int:
        return struct.unpack("<i", self.take(4, what))[0]

    def u64(self, what: str) -> int:
        return struct.unpack("<Q", self.take(8, what))[0]

    def left(self) -> int:
        return self.stream.left


def parse_state(data: bytes, name: str = "state file") -> LlamaState:
    """A llama.cpp session or sequence state file's contents (refused in one line if seqkv
    cannot restore it exactly)."""
    r = _Reader(data, name)
    magic, version = r.u32("magic"), r.u32("version")
    if magic not in KINDS:
        raise SeqkvError(
            f"{name}: not a llama.cpp state file (magic {magic:#010x}; session files start "
            f"'ggsn', sequence files 'ggsq')"
        )
    kind, supported = KINDS[magic]
    if version != supported:
        raise SeqkvError(
            f"{name}: llama.cpp {kind} state version {version} is not supported (seqkv reads "
            f"version {supported}, {LLAMA_CPP_VERSION})"
        )
    n_words = r.u32("token count")
    if n_words > r.left() // 4:
        raise SeqkvError(f"{name}: truncated llama.cpp state ({n_words} tokens announced)")
    words = list(struct.unpack(f"<{n_words}i", r.take(4 * n_words, "tokens")))
    tokens, form = _unpack_tokens(words, name)
    arch = None
    if kind == "session":
        size = r.u32("architecture name length")
        if size > MAX_ARCH_BYTES:
            raise SeqkvError(f"{name}: architecture name of {size} bytes (hostile or damaged)")
        try:
            arch = bytes(r.take(size, "architecture name")).decode("ascii")
        except UnicodeDecodeError:
            raise SeqkvError(f"{name}: architecture name is not ASCII") from None
        check_arch(arch, name)
    state = _parse_cache(r, name, kind, tokens, form, arch)
    if r.left():
        raise SeqkvError(
            f"{name}: {r.left()} bytes after the KV cache (a sliding-window, hybrid or "
            "recurrent model's second cache?); seqkv reads one attention cache"
        )
    return state


def _unpack_tokens(words: list[int], name: str) -> tuple[list[int], str]:
    if not words or words[0] != TOKEN_NULL:
        if any(t < 0 for t in words):
            raise SeqkvError(f"{name}: negative token id in the token list")
        return words, "plain"
    # llama-server: [-1, version, n, ids..., n_media, media...], padded to 4 bytes.
    if len(words) < 4:
        raise SeqkvError(f"{name}: llama-server token list too short ({len(words)} words)")
    if words[1] != SERVER_TOKENS_VERSION:
        raise SeqkvError(
            f"{name}: llama-server token list version {words[1]} is not supported "
            f"(seqkv reads version {SERVER_TOKENS_VERSION})"
        )
    n = words[2]
    if n < 0 or 3 + n + 1 != len(words):
        raise SeqkvError(
            f"{name}: llama-server token list of {len(words)} words does not hold {n} tokens "
            "and a media count"
        )
    if words[3 + n] != 0:
        raise SeqkvError(
            f"{name}: the slot holds {words[3 + n]} media chunks (images/audio); seqkv "
            "archives text-only states"
        )
    tokens = words[3 : 3 + n]
    if any(t < 0 for t in tokens):
        raise SeqkvError(f"{name}: negative token id in the token list")
    return tokens, "server-v1"


def _pack_tokens(tokens: list[int], form: str) -> list[int]:
    if form == "plain":
        return list(tokens)
    if form == "server-v1":
        return [TOKEN_NULL, SERVER_TOKENS_VERSION, len(tokens), *tokens, 0]
    raise SeqkvError(f"unknown llama.cpp token list form {form!r}")


def _type_name(t: int) -> str:
    if t in GGML_TYPES:
        return GGML_TYPES[t][0]
    return _OTHER_TYPE_NAMES.get(t, f"ggml type {t}")


def _check_type(t: int, what: str, name: str) -> int:
    if t not in GGML_TYPES:
        raise SeqkvError(
            f"{name}: {what} cache type {_type_name(t)} is not supported (seqkv reads f32, "
            "f16 and bf16 caches: llama.cpp's default --cache-type-k/-v f16)"
        )
    return GGML_TYPES[t][1]


def _parse_cache(r: _Reader, name, kind, tokens, form, arch) -> LlamaState:
    n_stream = r.u32("stream count")
    if not 1 <= n_stream <= MAX_STREAMS:
        raise SeqkvError(f"{name}: {n_stream} KV streams (hostile or damaged)")
    found = None
    for s in range(n_stream):
        cells = r.u32("cell count")
        if cells == 0:
            continue
        if found is not None:
            raise SeqkvError(
                f"{name}: more than one KV stream holds cells (a multi-sequence context); "
                "save each sequence with llama_state_seq_save_file"
            )
        found = (s, _parse_stream(r, name, cells, len(tokens)))
    if found is None:
        raise SeqkvError(f"{name}: the KV cache is empty: nothing to archive")
    stream, (seq_id, v_trans, layers) = found
    return LlamaState(kind, tokens, form, arch, n_stream, stream, seq_id, v_trans, layers)


def _parse_stream(r: _Reader, name: str, cells: int, n_tokens: int):
    if cells != n_tokens:
        raise SeqkvError(
            f"{name}: {n_tokens} tokens but {cells} cached positions; seqkv archives states "
            "whose cache covers exactly their token list"
        )
    if cells > r.left() // 8:
        raise SeqkvError(f"{name}: truncated llama.cpp state ({cells} cells announced)")
    seq_id = None
    for i in range(cells):
        pos, n_seq = r.i32("cell position"), r.u32("cell sequence count")
        if n_seq != 1:
            raise SeqkvError(
                f"{name}: cell {i} belongs to {n_seq} sequences; seqkv archives one sequence"
            )
        sid = r.i32("cell sequence id")
        if pos != i:
            raise SeqkvError(
                f"{name}: cell {i} is at position {pos} (shifted or M-RoPE cells); seqkv "
                "archives caches at positions 0..n-1"
            )
        if seq_id is None:
            seq_id = sid
        elif sid != seq_id:
            raise SeqkvError(f"{name}: cells of sequences {seq_id} and {sid}; seqkv needs one")
    v_trans, n_layer = r.u32("v_trans"), r.u32("layer count")
    if v_trans not in (0, 1) or not 1 <= n_layer <= 1024:
        raise SeqkvError(f"{name}: v_trans {v_trans}, {n_layer} layers (hostile or damaged)")
    keys = []
    for i in range(n_layer):
        k_type = r.i32(f"layer {i} key type")
        size = _check_type(k_type, "key", name)
        row = r.u64(f"layer {i} key row size")
        if row == 0 or row % size:
            raise SeqkvError(f"{name}: layer {i} key rows of {row} bytes (not whole elements)")
        keys.append((k_type, row, bytes(r.take(row * cells, f"layer {i} keys"))))
    layers = []
    for i, (k_type, k_row, k) in enumerate(keys):
        v_type = r.i32(f"layer {i} value type")
        size = _check_type(v_type, "value", name)
        if v_trans:
            unit, width = r.u32(f"layer {i} value element size"), r.u32(f"layer {i} value width")
            total = unit * width * cells
            if unit != size or width == 0:
                raise SeqkvError(
                    f"{name}: layer {i} transposed values of {unit}-byte elements, width "
                    f"{width} (the cache type has {size}-byte elements)"
                )
        else:
            unit, width = r.u64(f"layer {i} value row size"), 0
            total = unit * cells
            if unit == 0 or unit % size:
                raise SeqkvError(
                    f"{name}: layer {i} value rows of {unit} bytes (not whole elements)"
                )
        v = bytes(r.take(total, f"layer {i} values"))
        layers.append(LayerKV(k_type, k_row, k, v_type, unit, width, v))
    return seq_id, bool(v_trans), layers


def write_state(state: LlamaState) -> bytes:
    """The bytes llama.cpp writes (and reads) for `state`."""
    out = bytearray()
    magic = SESSION_MAGIC if state.kind == "session" else SEQUENCE_MAGIC
    out += struct.pack("<II", magic, KINDS[magic][1])
    words = _pack_tokens(state.tokens, state.token_form)
    out += struct.pack(f"<I{len(words)}i", len(words), *words)
    if state.kind == "session":
        arch = (state.arch or "").encode("ascii")
        out += struct.pack("<I", len(arch)) + arch
    out += struct.pack("<I", state.n_stream)
    for s in range(state.n_stream):
        if s != state.stream:
            out += struct.pack("<I", 0)
            continue
        out += struct.pack("<I", state.cells)
        for i in range(state.cells):
            out += struct.pack("<iIi", i, 1, state.seq_id)
        out += struct.pack("<II", int(state.v_trans), len(state.layers))
        for layer in state.layers:
            out += struct.pack("<iQ", layer.k_type, layer.k_row_bytes) + layer.k
        for layer in state.layers:
            if state.v_trans:
                out += struct.pack("<iII", layer.v_type, layer.v_unit, layer.v_width)
            else:
                out += struct.pack("<iQ", layer.v_type, layer.v_unit)
            out += layer.v
    return bytes(out)
