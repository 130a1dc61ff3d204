"""What seqkv accepts in a GGUF file, checked before anything else reads the file.

A GGUF file is untrusted input: its header says how many metadata entries and tensors
follow, how long each string and array is, and where each tensor's bytes lie, and gguf-py's
reader and transformers believe those numbers (they allocate and loop by them). So seqkv
parses the header itself first (`parse_layout`): every count and length is checked against
the bytes that remain before it is used, so no loop runs and nothing is allocated beyond
what the file's own length could hold. It refuses a file whose numbers cannot be true, and
one whose model metadata cannot describe its tensors (`check_model`), in one line naming the
file and the key or tensor. Only a file it accepts reaches gguf-py and transformers.

The `Layout` it returns is also what the rest of seqkv uses: the tensor table weights are
read by (re-derived from the file on every load, never trusted from a cache), the extent the
cache key hashes (`content_sha256`: header and tensor bytes, never bytes after the last
tensor), and the tensors whose values `check_finite` checks. The rules and limits are listed
in docs/MODELS.md, "GGUF files"; the format is ggml's (gguf.cpp), whose reader's rules these
follow where it has one.
"""

from __future__ import annotations

import hashlib
import math
import mmap
import os
import re
import stat
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from seqkv_cli.errors import SeqkvError

# -- limits (docs/MODELS.md, "GGUF files") ---------------------------------------------------
MAX_TENSOR_NAME = 63  # bytes; ggml's GGML_MAX_NAME (64) with its NUL: llama.cpp refuses longer
MAX_KEY = 1024  # bytes of a metadata key
MAX_DIMS = 4  # ggml's GGML_MAX_DIMS
MAX_ALIGNMENT = 1 << 20
# Strings in all arrays together: gguf-py's reader (which transformers uses) holds ~1.6 KB of
# Python objects per string, so a file of empty strings would cost ~200 times its size; real
# files hold up to ~410k (a 128k vocabulary and its 280k merges).
MAX_STRINGS = 1 << 20
MAX_CONTEXT = 1 << 24
MAX_HEAD_DIM = 1 << 16  # key/value length and rope dimensions: transformers makes real buffers
KEPT_ARRAY = 4096  # numeric arrays up to this length keep their values (per-layer counts)

DEFAULT_ALIGNMENT = 32
# Smallest encodings, which bound a count by the bytes left: a key-value entry is a key
# length (8), one key byte, a value type (4) and a one-byte value; a tensor info is a name
# length (8), one name byte, n_dims (4), one dim (8), a type (4) and an offset (8).
MIN_KV_BYTES = 8 + 1 + 4 + 1
MIN_TENSOR_INFO_BYTES = 8 + 1 + 4 + 8 + 4 + 8

# GGUF value types: (struct format, size) of the scalars; 8 is a string, 9 an array.
STRING, ARRAY = 8, 9
SCALARS = {
    0: ("<B", 1),
    1: ("<b", 1),
    2: ("<H", 2),
    3: ("<h", 2),
    4: ("<I", 4),
    5: ("<i", 4),
    6: ("<f", 4),
    7: ("<?", 1),
    10: ("<Q", 8),
    11: ("<q", 8),
    12: ("<d", 8),
}
INTEGER_TYPES = {0, 1, 2, 3, 4, 5, 10, 11}
UINT32 = 4


def _tensor_types() -> dict[int, tuple[str, int, int]]:
    """GGML type -> (name, elements per block, bytes per block), for the types seqkv can read:
    the ones gguf-py dequantizes (`gguf.quants.dequantize`); integer and f64 tensors are not
    weights it loads."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    from seqkv_cli.runtime.checkpoint.formats import BY_GGUF_TYPE

    try:  # gguf-py's table of the types it dequantizes (a private name: fall back if it moves)
        from gguf.quants import _type_traits
    except ImportError:
        _type_traits = [GGMLQuantizationType(t) for t in BY_GGUF_TYPE]
    readable = {GGMLQuantizationType.F32, GGMLQuantizationType.F16, *_type_traits}
    return {int(t): (t.name, *GGML_QUANT_SIZES[t]) for t in readable if t in GGML_QUANT_SIZES}


_TYPES: dict[int, tuple[str, int, int]] | None = None


def tensor_types() -> dict[int, tuple[str, int, int]]:
    global _TYPES
    if _TYPES is None:
        _TYPES = _tensor_types()
    return _TYPES


@dataclass(frozen=True)
class ArrayValue:
    """A metadata array: its element type and length, and its values if short and numeric."""

    type: int
    count: int
    values: tuple | None = None


@dataclass(frozen=True)
class TensorInfo:
    name: str
    type: int  # GGML type
    dims: tuple[int, ...]  # GGUF order: dims[0] is the row length
    offset: int  # of its first byte in the file
    nbytes: int

    def table_entry(self) -> dict:
        """The entry `checkpoint.gguf_file` reads the tensor by: the shape is gguf-py's numpy
        shape (dims reversed; rows of bytes for block types, including bf16)."""
        shape = [int(n) for n in reversed(self.dims)]
        if self.type not in (0, 1):  # F32, F16 are elements; every other type rows of bytes
            _, block, block_bytes = tensor_types()[self.type]
            shape[-1] = shape[-1] // block * block_bytes
        return {
            "name": self.name,
            "type": self.type,
            "shape": shape,
            "offset": self.offset,
            "nbytes": self.nbytes,
        }


@dataclass(frozen=True)
class Layout:
    """A GGUF file's header as seqkv read and checked it."""

    source: str  # how every refusal starts: "could not read GGUF file <path>"
    version: int
    alignment: int
    metadata: dict  # key -> int | float | bool | str | ArrayValue
    value_types: dict  # key -> its GGUF value type
    tensors: tuple[TensorInfo, ...]
    data_start: int
    data_end: int  # one past the last tensor's last byte: bytes after it are never read
    file_size: int

    def table(self) -> list[dict]:
        return [t.table_entry() for t in self.tensors]

    @property
    def architecture(self) -> str:
        return str(self.metadata["general.architecture"])


def _quoted(text: str) -> str:
    """A string from the file as a message shows it: quoted, control characters escaped, cut."""
    return repr(text[:80] + ("..." if len(text) > 80 else ""))


class _Reader:
    """Little-endian reads at a position, each checked against the end of the buffer."""

    def __init__(self, buf, size: int, source: str) -> None:
        self.buf, self.size, self.source, self.pos = buf, size, source, 0
        self.strings_left = MAX_STRINGS  # in arrays, over the whole file

    def fail(self, what: str) -> SeqkvError:
        return SeqkvError(f"{self.source}: {what}")

    def need(self, n: int, what: str) -> None:
        if n > self.size - self.pos:
            raise self.fail(f"the file ends inside {what} (at byte {self.pos}, {self.size} bytes)")

    def scalar(self, fmt: str, size: int, what: str):
        self.need(size, what)
        value = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += size
        return value

    def u32(self, what: str) -> int:
        return self.scalar("<I", 4, what)

    def u64(self, what: str) -> int:
        return self.scalar("<Q", 8, what)

    def string(self, what: str, limit: int | None = None) -> str:
        n = self.u64(f"the length of {what}")
        if limit is not None and n > limit:
            raise self.fail(f"{what} is {n} bytes long (at most {limit})")
        self.need(n, what)
        raw = bytes(self.buf[self.pos : self.pos + n])
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what} is not UTF-8 text") from None

    def skip_strings(self, count: int, what: str) -> None:
        for _ in range(count):
            self.need(8, what)
            n = struct.unpack_from("<Q", self.buf, self.pos)[0]
            self.pos += 8
            self.need(n, what)
            self.pos += n


def parse_layout(buf, size: int, source: str) -> Layout:
    """The header of the GGUF file whose first ``size`` bytes are ``buf`` (bytes or an mmap),
    checked (`check_model` is separate). Refuses in one line (SeqkvError)."""
    r = _Reader(buf, size, source)
    r.need(4, "the magic bytes")
    if bytes(buf[0:4]) != b"GGUF":
        raise r.fail("not a GGUF file (bad magic bytes)")
    r.pos = 4
    version = r.u32("the version")
    if version in (2 << 24, 3 << 24):
        raise r.fail("a big-endian GGUF file (seqkv reads little-endian ones)")
    if version not in (2, 3):
        raise r.fail(f"GGUF version {version} is not supported (2 or 3)")
    n_tensors = r.u64("the tensor count")
    n_kv = r.u64("the metadata count")
    left = size - r.pos
    if n_tensors > left // MIN_TENSOR_INFO_BYTES:
        raise r.fail(
            f"the header claims {n_tensors} tensors, more than the file's {left} remaining "
            f"bytes can describe"
        )
    if n_kv > left // MIN_KV_BYTES:
        raise r.fail(
            f"the header claims {n_kv} metadata entries, more than the file's {left} "
            f"remaining bytes can hold"
        )

    metadata: dict = {}
    value_types: dict = {}
    for i in range(n_kv):
        key = r.string(f"metadata key #{i}", MAX_KEY)
        if not key:
            raise r.fail(f"metadata key #{i} is empty")
        if key in metadata:
            raise r.fail(f"metadata key {_quoted(key)} appears twice")
        value_types[key], metadata[key] = _value(r, key)

    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if "general.alignment" in metadata and value_types["general.alignment"] != UINT32:
        raise r.fail("general.alignment must be a uint32")  # as ggml requires
    if not (1 <= alignment <= MAX_ALIGNMENT and alignment & (alignment - 1) == 0):
        raise r.fail(
            f"general.alignment is {alignment} (a power of two up to {MAX_ALIGNMENT} expected)"
        )

    infos = []
    names: set[str] = set()
    for i in range(n_tensors):
        name = r.string(f"the name of tensor #{i}", MAX_TENSOR_NAME)
        if not name:
            raise r.fail(f"tensor #{i} has an empty name")
        if name in names:
            raise r.fail(f"tensor {_quoted(name)} appears twice")
        names.add(name)
        n_dims = r.u32(f"the dimension count of tensor {_quoted(name)}")
        if not 1 <= n_dims <= MAX_DIMS:
            raise r.fail(f"tensor {_quoted(name)} has {n_dims} dimensions (1 to {MAX_DIMS})")
        dims = tuple(r.u64(f"the dimensions of tensor {_quoted(name)}") for _ in range(n_dims))
        ggml_type = r.u32(f"the type of tensor {_quoted(name)}")
        offset = r.u64(f"the offset of tensor {_quoted(name)}")
        infos.append((name, dims, ggml_type, offset))

    data_start = -(-r.pos // alignment) * alignment
    if not infos:
        raise r.fail("the file holds no tensors")
    tensors = []
    expected = 0  # ggml's rule: each tensor starts where the one before it ends, aligned
    previous = None
    for name, dims, ggml_type, offset in infos:
        info = _tensor(r, name, dims, ggml_type, offset, alignment, data_start)
        if offset != expected:
            if previous is None:
                where = f"tensor data starts at byte {data_start}"
            else:
                where = f"{_quoted(previous.name)} ends at byte {previous.offset + previous.nbytes}"
            relation = "overlaps what comes before it" if offset < expected else "leaves a gap"
            raise r.fail(
                f"tensor {_quoted(name)} starts at byte {data_start + offset}, which "
                f"{relation} ({where}; tensors must follow one another, aligned)"
            )
        expected = -(-(offset + info.nbytes) // alignment) * alignment
        tensors.append(info)
        previous = info
    last = tensors[-1]
    return Layout(
        source=source,
        version=version,
        alignment=alignment,
        metadata=metadata,
        value_types=value_types,
        tensors=tuple(tensors),
        data_start=data_start,
        data_end=last.offset + last.nbytes,
        file_size=size,
    )


def _value(r: _Reader, key: str):
    """(type, value) of one metadata entry; arrays of strings are skipped over (each length
    checked), not read, and long numeric arrays are not kept."""
    value_type = r.u32(f"the type of {_quoted(key)}")
    if value_type in SCALARS:
        fmt, size = SCALARS[value_type]
        return value_type, r.scalar(fmt, size, f"the value of {_quoted(key)}")
    if value_type == STRING:
        return value_type, r.string(f"the value of {_quoted(key)}")
    if value_type != ARRAY:
        raise r.fail(f"metadata {_quoted(key)} has unknown type {value_type}")
    element = r.u32(f"the element type of {_quoted(key)}")
    count = r.u64(f"the length of {_quoted(key)}")
    left = r.size - r.pos
    if element == STRING:
        if count > left // 8:
            raise r.fail(
                f"metadata {_quoted(key)} claims {count} strings, more than the file's {left} "
                f"remaining bytes can hold"
            )
        if count > r.strings_left:
            raise r.fail(
                f"metadata {_quoted(key)} holds {count} strings, past seqkv's limit of "
                f"{MAX_STRINGS} strings in arrays"
            )
        r.strings_left -= count
        r.skip_strings(count, f"the strings of {_quoted(key)}")
        return ARRAY, ArrayValue(element, count)
    if element not in SCALARS:
        raise r.fail(f"metadata {_quoted(key)} is an array of type {element} (not supported)")
    fmt, size = SCALARS[element]
    if count > left // size:
        raise r.fail(
            f"metadata {_quoted(key)} claims {count} elements of {size} bytes, past the end "
            f"of the file ({left} bytes remain)"
        )
    values = None
    if count <= KEPT_ARRAY:
        values = struct.unpack_from(f"<{count}{fmt[1]}", r.buf, r.pos)
    r.pos += count * size
    return ARRAY, ArrayValue(element, count, values)


def _tensor(r: _Reader, name, dims, ggml_type, offset, alignment, data_start) -> TensorInfo:
    label = f"tensor {_quoted(name)}"
    if any(d < 1 for d in dims):
        raise r.fail(f"{label} has a dimension of 0 ({list(dims)})")
    known = tensor_types().get(ggml_type)
    if known is None:
        raise r.fail(f"{label} has GGML type {ggml_type}, which seqkv cannot read")
    type_name, block, block_bytes = known
    if dims[0] % block:
        raise r.fail(
            f"{label} has rows of {dims[0]} elements, not a whole number of {type_name} "
            f"blocks of {block}"
        )
    elements = math.prod(dims)  # a Python int: no overflow; bounded below by the file length
    nbytes = elements // block * block_bytes
    if offset % alignment:
        raise r.fail(f"{label} has offset {offset}, not a multiple of the alignment {alignment}")
    start = data_start + offset
    if start > r.size or nbytes > r.size - start:
        raise r.fail(
            f"{label} claims {nbytes} bytes at offset {start}, past the end of the file "
            f"({r.size} bytes)"
        )
    return TensorInfo(name, ggml_type, dims, start, nbytes)


# -- the model the metadata describes --------------------------------------------------------

_LAYER = re.compile(r"blk\.(\d+)\.")


def check_model(layout: Layout) -> None:
    """Refuse metadata that cannot describe the file's tensors, or that would make
    transformers build something the file does not hold (a million layers, an endless
    context): one line naming the key."""
    meta = layout.metadata

    def fail(text: str) -> SeqkvError:
        return SeqkvError(f"{layout.source}: {text}")

    def integers(key: str, count: int | None, low: int, high: int | None) -> list[int] | None:
        """The value of ``key`` (absent: None) as a list: one integer, or, where ``count``
        is given, one per layer (an array of that length, as some files record head counts)."""
        value = meta.get(key)
        if value is None:
            return None
        if isinstance(value, ArrayValue):
            if count is None or value.type not in INTEGER_TYPES or value.count != count:
                raise fail(f"{key} must be an integer" + (f" or {count} of them" if count else ""))
            if value.values is None:  # not kept: longer than KEPT_ARRAY
                raise fail(f"{key} holds {value.count} values (seqkv checks at most {KEPT_ARRAY})")
            values = list(value.values)
        elif isinstance(value, int) and not isinstance(value, bool):
            values = [value]
        else:
            raise fail(f"{key} must be an integer, not {type(value).__name__}")
        for v in values:
            if v < low or (high is not None and v > high):
                bound = f"{low} to {high}" if high is not None else f"at least {low}"
                raise fail(f"{key} is {v} ({bound} expected)")
        return values

    def integer(key: str, *, required: bool = False, high: int | None = None) -> int | None:
        values = integers(key, None, 1, high)
        if values is None and required:
            raise fail(f"{key} is missing")
        return values[0] if values else None

    def real(key: str, *, below: float | None = None) -> None:
        value = meta.get(key)
        if value is None:
            return
        if isinstance(value, (bool, str, ArrayValue)):
            raise fail(f"{key} must be a number, not {type(value).__name__}")
        if not (math.isfinite(value) and value > 0 and (below is None or value < below)):
            bound = "finite and above 0" + (f" and below {below:g}" if below else "")
            raise fail(f"{key} is {value!r} ({bound} expected)")

    arch = meta.get("general.architecture")
    if not isinstance(arch, str) or not arch:
        raise fail("general.architecture is missing or not a string")
    tensors = {t.name: t for t in layout.tensors}
    # Every layer has a tensor, so block_count is at most the tensor count: transformers
    # builds the layers it names before any tensor is read.
    blocks = integer(f"{arch}.block_count", required=True, high=len(layout.tensors))
    present = {int(m.group(1)) for name in tensors if (m := _LAYER.match(name))}
    missing = sorted(set(range(blocks)) - present)
    extra = sorted(present - set(range(blocks)))
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"no tensors for layer{'s' if len(missing) > 1 else ''} {_few(missing)}")
        if extra:
            parts.append(f"tensors for layer{'s' if len(extra) > 1 else ''} {_few(extra)}")
        raise fail(f"{arch}.block_count is {blocks}, but the file has {' and '.join(parts)}")

    embed = tensors.get("token_embd.weight")
    if embed is None or len(embed.dims) != 2:
        raise fail("no 2-D tensor 'token_embd.weight' (the token embeddings)")
    width, rows = embed.dims
    hidden = integer(f"{arch}.embedding_length", required=True)
    if hidden != width:
        raise fail(
            f"{arch}.embedding_length is {hidden}, but 'token_embd.weight' has rows of {width}"
        )
    tokens = meta.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, ArrayValue) or tokens.type != STRING:
        raise fail("tokenizer.ggml.tokens is missing or not an array of strings")
    if tokens.count != rows:
        raise fail(
            f"tokenizer.ggml.tokens holds {tokens.count} tokens, but 'token_embd.weight' has "
            f"{rows} rows"
        )
    vocab = integer(f"{arch}.vocab_size")
    if vocab is not None and vocab != rows:
        raise fail(f"{arch}.vocab_size is {vocab}, but 'token_embd.weight' has {rows} rows")

    heads = integers(f"{arch}.attention.head_count", blocks, 1, hidden)
    if heads is None:
        raise fail(f"{arch}.attention.head_count is missing")
    kv_heads = integers(f"{arch}.attention.head_count_kv", blocks, 1, hidden) or heads
    for h, kv in zip(_per_layer(heads, blocks), _per_layer(kv_heads, blocks), strict=True):
        if h % kv:
            raise fail(
                f"{arch}.attention.head_count ({h}) is not a multiple of "
                f"{arch}.attention.head_count_kv ({kv})"
            )
    key_length = integer(f"{arch}.attention.key_length", high=MAX_HEAD_DIM)
    integer(f"{arch}.attention.value_length", high=MAX_HEAD_DIM)
    integer(f"{arch}.rope.dimension_count", high=MAX_HEAD_DIM)
    if key_length is None and any(hidden % h for h in heads):
        raise fail(
            f"{arch}.embedding_length ({hidden}) is not a multiple of "
            f"{arch}.attention.head_count ({heads[0] if len(heads) == 1 else heads}) and "
            f"no {arch}.attention.key_length is given"
        )
    integer(f"{arch}.context_length", high=MAX_CONTEXT)
    real(f"{arch}.rope.freq_base")
    real(f"{arch}.attention.layer_norm_rms_epsilon", below=1.0)
    real(f"{arch}.attention.layer_norm_epsilon", below=1.0)


def _per_layer(values: list[int], blocks: int) -> list[int]:
    return values if len(values) == blocks else values * blocks


def _few(numbers: list[int]) -> str:
    shown = ", ".join(str(n) for n in numbers[:3])
    return shown + (f" and {len(numbers) - 3} more" if len(numbers) > 3 else "")


# -- a file on disk --------------------------------------------------------------------------


def read_layout(path: Path) -> Layout:
    """The checked layout of the GGUF file at ``path`` (header and model metadata)."""
    source = f"could not read GGUF file {path}"
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):  # a FIFO would block open() for ever
            raise SeqkvError(f"{source}: not a regular file")
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < 24:
                head = f.read(4)
                if len(head) == 4 and head != b"GGUF":
                    raise SeqkvError(f"not a GGUF file: {path} (bad magic bytes)")
                raise SeqkvError(f"{source}: too short for a GGUF file ({size} bytes)")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                layout = parse_layout(mm, size, source)
        check_model(layout)
    except OSError as exc:
        raise SeqkvError(f"{source}: {exc.strerror or exc}") from None
    except (ValueError, TypeError, ArithmeticError, LookupError, struct.error) as exc:
        # A case the checks above missed still ends in one line (the fuzz test calls
        # parse_layout and check_model without this net, so it finds such cases).
        first = (str(exc).splitlines() or [""])[0]
        raise SeqkvError(f"{source}: {type(exc).__name__}: {first}"[:400]) from None
    return layout


HASH_CHUNK = 1 << 22


def content_sha256(path: Path, layout: Layout) -> str:
    """SHA-256 of the file's first ``layout.data_end`` bytes: header, metadata, tensor table
    and every tensor's bytes; bytes after the last tensor are not part of the model (so a
    file padded with a terabyte of zeros hashes as fast as the file without them). For a file
    without such bytes this is the file's own SHA-256."""
    h = hashlib.sha256()
    left = layout.data_end
    try:
        with open(path, "rb") as f:
            while left:
                chunk = f.read(min(HASH_CHUNK, left))
                if not chunk:
                    raise SeqkvError(f"{layout.source}: the file is shorter than when it was read")
                h.update(chunk)
                left -= len(chunk)
    except OSError as exc:
        raise SeqkvError(f"{layout.source}: {exc.strerror or exc}") from None
    return h.hexdigest()


# -- weights that are not numbers ------------------------------------------------------------

FINITE_CHUNK = 1 << 24  # bytes of a tensor read and looked at at once (bounded memory)
# bits that are all ones in a non-finite value: (unsigned view, exponent mask)
_FLOAT_BITS = {
    "f32": (np.uint32, 0x7F800000),
    "f16": (np.uint16, 0x7C00),
    "bf16": (np.uint16, 0x7F80),
}
_HALF_MASK = 0x7C00


def check_finite(path: Path, layout: Layout) -> None:
    """Refuse a file with a NaN or infinite float weight, or a block whose fp16 scale is one
    (every value of the block would be NaN or infinite): one line naming the tensor. Float
    tensors and the block scales of `formats`' kinds are checked by their bits, vectorised;
    other block types (IQ, TQ, MXFP4...) are dequantized a piece at a time."""
    from seqkv_cli.runtime.checkpoint.formats import BY_GGUF_TYPE

    try:
        with open(path, "rb") as f:
            for t in layout.tensors:
                kind = BY_GGUF_TYPE.get(t.type)
                if kind is None:
                    bad, what = _dequantized_not_finite(f, t), "NaN or infinite values"
                elif kind.block == 1:
                    bad, what = _floats_not_finite(f, t, kind), "NaN or infinite values"
                else:
                    bad, what = _scales_not_finite(f, t, kind), "a NaN or infinite block scale"
                if bad:
                    raise SeqkvError(f"{layout.source}: tensor {_quoted(t.name)} holds {what}")
    except OSError as exc:
        raise SeqkvError(f"{layout.source}: {exc.strerror or exc}") from None


def _pieces(f, t: TensorInfo, unit: int, chunk: int = FINITE_CHUNK):
    """The bytes of tensor ``t`` as uint8 arrays of whole ``unit``s, about ``chunk`` each."""
    step = max(1, chunk // unit) * unit
    f.seek(t.offset)
    for start in range(0, t.nbytes, step):
        n = min(step, t.nbytes - start)
        raw = f.read(n)
        if len(raw) != n:
            raise SeqkvError(f"the GGUF file ends inside tensor {_quoted(t.name)}")
        yield np.frombuffer(raw, np.uint8)


def _floats_not_finite(f, t: TensorInfo, kind) -> bool:
    dtype, mask = _FLOAT_BITS[kind.name]
    size = np.dtype(dtype).itemsize
    return any(np.any((piece.view(dtype) & mask) == mask) for piece in _pieces(f, t, size))


def _scales_not_finite(f, t: TensorInfo, kind) -> bool:
    for piece in _pieces(f, t, kind.block_bytes):
        blocks = piece.reshape(-1, kind.block_bytes)
        for at in kind.halves:
            half = blocks[:, at] | (blocks[:, at + 1].astype(np.uint16) << 8)
            if np.any((half & _HALF_MASK) == _HALF_MASK):
                return True
    return False


def _dequantized_not_finite(f, t: TensorInfo) -> bool:
    from gguf import GGMLQuantizationType, dequantize

    _, _, block_bytes = tensor_types()[t.type]
    # a piece's fp32 values take up to ~16 times its bytes: pieces of 1/16 the size
    for piece in _pieces(f, t, block_bytes, FINITE_CHUNK // 16):
        with np.errstate(all="ignore"):
            values = dequantize(piece.reshape(1, -1), GGMLQuantizationType(t.type))
        if not np.isfinite(values).all():
            return True
    return False
