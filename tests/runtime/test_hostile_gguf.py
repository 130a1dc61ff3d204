"""A GGUF file is untrusted input: whatever its bytes say, loading it ends in a model or in
one line (SeqkvError) naming the file and the field, fast, in bounded memory, with nothing
half-written left in the cache (docs/MODELS.md, "GGUF files")."""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import signal
import struct
import tempfile
import tracemalloc
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bench.real_shapes import byte_tokenizer, write_gguf
from seqkv_cli.errors import SeqkvError
from tests.cli_run import assert_error, invoke
from tests.runtime.test_checkpoint import _qtypes, _tiny_config

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

# -- a GGUF file as values, written back to bytes --------------------------------------------

SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?"}
SCALAR |= {10: "<Q", 11: "<q", 12: "<d"}
STRING, ARRAY, UINT32, FLOAT32 = 8, 9, 4, 6


@dataclass
class Lie:
    """A string or array whose encoded length is ``claimed``, whatever ``payload`` holds."""

    payload: object
    claimed: int


@dataclass
class Gguf:
    kvs: list  # [key, value type, value, element type of an array]
    tensors: list  # [name, dims (GGUF order), GGML type, offset into the data]
    data: bytearray
    version: int = 3
    alignment: int = 32
    fields: list = field(default_factory=list)  # (position, size) of each number encoded
    values: list = field(default_factory=list)  # (position, format) of each scalar value

    def set(self, key: str, value, value_type: int | None = None, sub: int | None = None):
        for kv in self.kvs:
            if kv[0] == key:
                kv[1:] = [value_type if value_type is not None else kv[1], value, sub or kv[3]]
                return self
        self.kvs.append([key, value_type if value_type is not None else UINT32, value, sub])
        return self

    def tensor(self, name: str) -> list:
        return next(t for t in self.tensors if t[0] == name)

    def at(self, name: str) -> int:
        """Where tensor ``name``'s bytes start in ``data``."""
        return self.tensor(name)[3]

    def encode(self) -> bytes:
        self.fields, self.values = [], []
        out = bytearray(b"GGUF")
        self._num(out, "<I", self.version)
        self._num(out, "<Q", len(self.tensors))
        self._num(out, "<Q", len(self.kvs))
        for key, value_type, value, sub in self.kvs:
            self._str(out, key)
            self._num(out, "<I", value_type)
            self._value(out, value_type, value, sub)
        for name, dims, ggml_type, offset in self.tensors:
            self._str(out, name)
            self._num(out, "<I", len(dims))
            for d in dims:
                self._num(out, "<Q", d)
            self._num(out, "<I", ggml_type)
            self._num(out, "<Q", offset)
        out += bytes(-len(out) % self.alignment)
        return bytes(out + self.data)

    def _num(self, out: bytearray, fmt: str, value) -> None:
        self.fields.append((len(out), struct.calcsize(fmt)))
        out += struct.pack(fmt, value)

    def _str(self, out: bytearray, text) -> None:
        payload = text.payload if isinstance(text, Lie) else text
        raw = payload.encode() if isinstance(payload, str) else bytes(payload)
        self._num(out, "<Q", text.claimed if isinstance(text, Lie) else len(raw))
        out += raw

    def _value(self, out: bytearray, value_type: int, value, sub) -> None:
        if value_type == STRING:
            self._str(out, value)
        elif value_type == ARRAY:
            items = value.payload if isinstance(value, Lie) else value
            self._num(out, "<I", sub)
            self._num(out, "<Q", value.claimed if isinstance(value, Lie) else len(items))
            for item in items:
                self._value(out, sub, item, None)
        else:
            self.values.append((len(out), SCALAR[value_type]))
            self._num(out, SCALAR[value_type], value)


def decode(path: Path) -> Gguf:
    from gguf import GGUFReader, GGUFValueType

    reader = GGUFReader(path)
    kvs = []
    for name, f in reader.fields.items():
        if name.startswith("GGUF."):
            continue
        main = int(f.types[0])
        sub = int(f.types[-1]) if main == GGUFValueType.ARRAY else None
        kvs.append([name, main, f.contents(), sub])
    tensors = [
        [
            t.name,
            [int(d) for d in t.shape],
            int(t.tensor_type),
            int(t.data_offset) - reader.data_offset,
        ]
        for t in reader.tensors
    ]
    data = bytearray(path.read_bytes()[reader.data_offset :])
    return Gguf(kvs, tensors, data)


@pytest.fixture(scope="module")
def valid(tmp_path_factory) -> tuple[Gguf, bytes]:
    """A tiny 2-layer llama (a mix of block types, as `test_checkpoint`), as values and bytes."""
    path = tmp_path_factory.mktemp("valid") / "tiny.gguf"
    write_gguf(_tiny_config(tie_word_embeddings=True), path, _qtypes, 3, byte_tokenizer(320))
    g = decode(path)
    assert g.encode() == path.read_bytes()  # the encoder writes what gguf-py writes
    return g, path.read_bytes()


@pytest.fixture
def tiny(valid) -> Gguf:
    return copy.deepcopy(valid[0])


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("SEQKV_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return tmp_path / "cache"


def _write(tmp_path: Path, g: Gguf | bytes, name: str = "hostile.gguf") -> Path:
    path = tmp_path / name
    path.write_bytes(g if isinstance(g, bytes) else g.encode())
    return path


@contextlib.contextmanager
def within(seconds: float):
    """Raise TimeoutError in the block after ``seconds`` (a hang fails, not stalls, the test)."""

    def expire(*_):
        raise TimeoutError(f"took more than {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _no_partial_folders(cache: Path) -> None:
    """After a refused load, nothing in the cache but lock files: no staging folder, and no
    metadata folder (half-made, or whole for a file whose weights then failed to load)."""
    models = cache / "models"
    if not models.exists():
        return
    for p in models.iterdir():
        assert p.suffix == ".lock", p


def _refused(path: Path, cache: Path, fragment: str, seconds: float = 30) -> str:
    from seqkv_cli.runtime.loading import load_model

    with within(seconds), pytest.raises(SeqkvError) as caught:
        load_model(str(path))
    message = str(caught.value)
    assert "\n" not in message and str(path) in message and fragment in message, message
    _no_partial_folders(cache)
    return message


# -- 1. the cache key reads what the model uses, never bytes after it ------------------------


def test_bytes_after_the_last_tensor_are_not_read_and_weights_change_the_identity(
    tmp_path, cache, valid
):
    from seqkv_cli.runtime.gguf import metadata_folder

    clean = _write(tmp_path, valid[1], "clean.gguf")
    padded = _write(tmp_path, valid[1], "padded.gguf")
    with open(padded, "r+b") as f:
        f.truncate(1 << 40)  # a terabyte of sparse zeros after the last tensor
    with within(60):
        folder = metadata_folder(padded)
        assert metadata_folder(clean) == folder  # the same model: the same cache entry
    g = decode(clean)
    g.data[g.at("blk.1.ffn_down.weight") + 7] ^= 0x01  # one bit of one weight
    changed = _write(tmp_path, g, "changed.gguf")
    with within(60):
        assert metadata_folder(changed) != folder


def test_a_fifo_is_refused_without_waiting(tmp_path, cache):
    """`load_model` sends only files here, but `metadata_folder` (the GGUF module's own entry)
    must not wait for a writer that never comes either."""
    from seqkv_cli.runtime.gguf import metadata_folder

    fifo = tmp_path / "pipe.gguf"
    os.mkfifo(fifo)
    with within(10), pytest.raises(SeqkvError, match=r"pipe\.gguf: not a regular file"):
        metadata_folder(fifo)


# -- 2. a tensor table that lies -------------------------------------------------------------


def _past_end(g):
    g.tensor("blk.0.attn_q.weight")[1] = [64, 1 << 14]


def _huge_dims(g):  # elements that overflow 64 bits, so a C reader's product wraps around
    g.tensor("blk.0.attn_q.weight")[1] = [1 << 32, 1 << 32, 1 << 32, 1 << 5]


TABLE_LIES = {
    "past the end": (_past_end, "tensor 'blk.0.attn_q.weight' claims 589824 bytes at offset"),
    "overflowing dims": (_huge_dims, "tensor 'blk.0.attn_q.weight' claims"),
    "zero dim": (lambda g: g.tensor("output_norm.weight").__setitem__(1, [0]), "dimension of 0"),
    "five dims": (
        lambda g: g.tensor("output_norm.weight").__setitem__(1, [64, 1, 1, 1, 1]),
        "tensor 'output_norm.weight' has 5 dimensions",
    ),
    "unknown type": (
        lambda g: g.tensor("output_norm.weight").__setitem__(2, 99),
        "tensor 'output_norm.weight' has GGML type 99",
    ),
    "integer type": (
        lambda g: g.tensor("output_norm.weight").__setitem__(2, 26),
        "tensor 'output_norm.weight' has GGML type 26",
    ),
    "partial block": (
        lambda g: g.tensor("blk.0.attn_q.weight").__setitem__(1, [48, 64]),
        "rows of 48 elements, not a whole number of Q4_0 blocks of 32",
    ),
    "misaligned": (
        lambda g: g.tensor("blk.0.attn_q.weight").__setitem__(3, g.at("blk.0.attn_q.weight") + 4),
        "not a multiple of the alignment 32",
    ),
    "overlapping": (
        lambda g: g.tensor("blk.0.attn_k.weight").__setitem__(3, g.at("blk.0.attn_q.weight")),
        "tensor 'blk.0.attn_k.weight' starts at byte",
    ),
    "duplicate name": (
        lambda g: g.tensor("blk.1.attn_q.weight").__setitem__(0, "blk.0.attn_q.weight"),
        "tensor 'blk.0.attn_q.weight' appears twice",
    ),
    "empty name": (lambda g: g.tensor("output_norm.weight").__setitem__(0, ""), "empty name"),
    "long name": (
        lambda g: g.tensor("output_norm.weight").__setitem__(0, "x" * 300),
        "is 300 bytes long (at most 63)",
    ),
    "escape in a name": (
        lambda g: (
            g.tensor("output_norm.weight").__setitem__(1, [0])
            or g.tensor("output_norm.weight").__setitem__(0, "\x1b[2Jnorm")
        ),
        "tensor '\\x1b[2Jnorm' has a dimension of 0",
    ),
    "bad alignment": (
        lambda g: g.set("general.alignment", 24, UINT32),
        "general.alignment is 24 (a power of two",
    ),
}


@pytest.mark.parametrize("case", sorted(TABLE_LIES))
def test_a_lying_tensor_table_is_refused_by_name(tmp_path, cache, tiny, case):
    mutate, fragment = TABLE_LIES[case]
    mutate(tiny)
    _refused(_write(tmp_path, tiny), cache, fragment)


def test_the_first_table_lie_reads_as_documented(tmp_path, cache, tiny):
    _past_end(tiny)
    path = _write(tmp_path, tiny)
    message = _refused(path, cache, "past the end of the file")
    offset = tiny.at("blk.0.attn_q.weight") + len(tiny.encode()) - len(tiny.data)
    assert message == (
        f"could not read GGUF file {path}: tensor 'blk.0.attn_q.weight' claims 589824 "
        f"bytes at offset {offset}, past the end of the file ({path.stat().st_size} bytes)"
    )


# -- 3. counts that would size memory or loops -----------------------------------------------


def _header(g: Gguf, position: int, value: int, fmt: str = "<Q") -> bytes:
    raw = bytearray(g.encode())
    struct.pack_into(fmt, raw, position, value)
    return bytes(raw)


COUNT_LIES = {
    "tensor count": (lambda g: _header(g, 8, 10**6), "claims 1000000 tensors"),
    "metadata count": (lambda g: _header(g, 16, 10**6), "claims 1000000 metadata entries"),
    "key length": (lambda g: _header(g, 24, 1 << 40), "metadata key #0 is 1099511627776 bytes"),
    "string length": (
        lambda g: g.set("general.name", Lie("tiny", 1 << 40), STRING).encode(),
        "the file ends inside the value of 'general.name'",
    ),
    "string array length": (
        lambda g: g.set("tokenizer.ggml.merges", Lie(["a b"], 1 << 40), ARRAY, STRING).encode(),
        "'tokenizer.ggml.merges' claims 1099511627776 strings",
    ),
    "number array length": (
        lambda g: g.set("tokenizer.ggml.token_type", Lie([1], 1 << 40), ARRAY, 5).encode(),
        "'tokenizer.ggml.token_type' claims 1099511627776 elements",
    ),
    "block count": (
        lambda g: g.set("llama.block_count", 10**6).encode(),
        "llama.block_count is 1000000 (1 to 20 expected)",
    ),
}


@pytest.mark.parametrize("case", sorted(COUNT_LIES))
def test_a_count_that_would_size_memory_is_refused_fast(tmp_path, cache, tiny, case):
    from seqkv_cli.runtime.loading import load_model

    make, fragment = COUNT_LIES[case]
    path = _write(tmp_path, make(tiny))
    with pytest.raises(SeqkvError):  # the code path imported before memory is counted
        load_model(str(_write(tmp_path, _header(tiny, 8, 10**6), "warm.gguf")))
    tracemalloc.start()
    try:
        _refused(path, cache, fragment, seconds=20)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    # No allocation by the claimed count: what is held is the file's size, many times over at
    # most (imports of transformers, were it reached, would be far more).
    assert peak < 64 * path.stat().st_size + (8 << 20), peak


# -- 4. metadata the model is built from -----------------------------------------------------

METADATA_LIES = {
    "no heads": ("llama.attention.head_count", 0, UINT32, "llama.attention.head_count is 0"),
    "kv heads": (
        "llama.attention.head_count_kv",
        3,
        UINT32,
        "llama.attention.head_count (4) is not a multiple of llama.attention.head_count_kv (3)",
    ),
    "missing layer": ("llama.block_count", 3, UINT32, "the file has no tensors for layer 2"),
    "extra layer": ("llama.block_count", 1, UINT32, "the file has tensors for layer 1"),
    "context": ("llama.context_length", 1 << 62, 10, "llama.context_length is 4611686018427387904"),
    "rope nan": ("llama.rope.freq_base", math.nan, FLOAT32, "llama.rope.freq_base is nan"),
    "rope negative": ("llama.rope.freq_base", -1.0, FLOAT32, "llama.rope.freq_base is -1.0"),
    "eps zero": (
        "llama.attention.layer_norm_rms_epsilon",
        0.0,
        FLOAT32,
        "llama.attention.layer_norm_rms_epsilon is 0.0",
    ),
    "eps inf": (
        "llama.attention.layer_norm_rms_epsilon",
        math.inf,
        FLOAT32,
        "llama.attention.layer_norm_rms_epsilon is inf",
    ),
    "eps large": (
        "llama.attention.layer_norm_rms_epsilon",
        2.0,
        FLOAT32,
        "llama.attention.layer_norm_rms_epsilon is 2.0",
    ),
    "width": ("llama.embedding_length", 48, UINT32, "llama.embedding_length is 48, but"),
    "width type": ("llama.embedding_length", "64", STRING, "llama.embedding_length must be an"),
    "vocab": ("llama.vocab_size", 300, UINT32, "llama.vocab_size is 300, but 'token_embd.weight'"),
    "head dim": (
        "llama.attention.key_length",
        1 << 40,
        10,
        "llama.attention.key_length is 1099511627776",
    ),
}


@pytest.mark.parametrize("case", sorted(METADATA_LIES))
def test_metadata_the_model_needs_is_checked_by_key(tmp_path, cache, tiny, case):
    key, value, value_type, fragment = METADATA_LIES[case]
    _refused(_write(tmp_path, tiny.set(key, value, value_type)), cache, fragment)


def test_tensors_that_do_not_fit_the_models_shape_leave_no_cache_entry(tmp_path, cache, tiny):
    """What only the built model can tell (here the MLP width) is refused when the weights
    are read: in one line naming the file, and the metadata folder just made is removed."""
    path = _write(tmp_path, tiny.set("llama.feed_forward_length", 96))
    _refused(path, cache, "the checkpoint holds (128, 64), the model expects (96, 64)")


def test_a_token_list_shorter_than_the_embeddings_is_refused(tmp_path, cache, tiny):
    tokens = next(kv for kv in tiny.kvs if kv[0] == "tokenizer.ggml.tokens")
    types = next(kv for kv in tiny.kvs if kv[0] == "tokenizer.ggml.token_type")
    tokens[2], types[2] = tokens[2][:300], types[2][:300]
    fragment = "tokenizer.ggml.tokens holds 300 tokens, but 'token_embd.weight' has 320 rows"
    _refused(_write(tmp_path, tiny), cache, fragment)


# -- 5. weights that are not numbers ---------------------------------------------------------


def _poison(name: str, raw: bytes, at: int = 0):
    def mutate(g: Gguf) -> None:
        start = g.at(name) + at
        g.data[start : start + len(raw)] = raw

    return mutate


NOT_NUMBERS = {
    "f32 nan": (
        _poison("output_norm.weight", struct.pack("<f", math.nan), 8),
        "output_norm.weight",
    ),
    "f16 inf": (_poison("blk.1.attn_v.weight", b"\x00\x7c", 34), "blk.1.attn_v.weight"),
    "q8_0 scale": (_poison("token_embd.weight", b"\x00\x7e", 34 * 5), "token_embd.weight"),
    "q4_1 min": (_poison("blk.0.ffn_up.weight", b"\x00\xfc", 20 * 3 + 2), "blk.0.ffn_up.weight"),
}


@pytest.mark.parametrize("case", sorted(NOT_NUMBERS))
def test_a_nan_or_infinite_weight_or_scale_is_refused_by_name(tmp_path, cache, tiny, case):
    mutate, name = NOT_NUMBERS[case]
    mutate(tiny)
    _refused(_write(tmp_path, tiny), cache, f"tensor '{name}' holds")


# -- 6. the metadata folder is checked against the file on every load -----------------------


def test_an_edited_metadata_folder_is_rebuilt_not_used(tmp_path, cache, valid):
    from seqkv_cli.runtime.loading import load_model

    path = _write(tmp_path, valid[1], "tiny.gguf")
    first = load_model(str(path))
    folder = first.folder
    want = {k: v.clone() for k, v in first.fp32_model().state_dict().items()}
    config = json.loads((folder / "config.json").read_text())

    def edit_config(marker):
        (folder / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 0.25}))

    def swap_offsets(marker):  # two tensors of one size trade places
        table = {t["name"]: t for t in marker["tensors"]}
        a, b = table["blk.0.ffn_up.weight"], table["blk.1.ffn_up.weight"]
        a["offset"], b["offset"] = b["offset"], a["offset"]

    def remap(marker):
        m = marker["mapping"]
        a, b = "blk.0.ffn_up.weight", "blk.1.ffn_up.weight"
        m[a], m[b] = m[b], m[a]

    def extra_file(marker):
        (folder / "added_tokens.json").write_text(json.dumps({"<|evil|>": 3}))

    for edit in (edit_config, swap_offsets, remap, extra_file):
        marker = json.loads((folder / "seqkv-gguf.json").read_text())
        edit(marker)
        if edit in (swap_offsets, remap):
            (folder / "seqkv-gguf.json").write_text(json.dumps(marker))
        again = load_model(str(path))
        assert again.folder == folder, edit.__name__
        assert again.module.config.rms_norm_eps == config["rms_norm_eps"], edit.__name__
        assert again.fingerprint == first.fingerprint, edit.__name__
        assert not (folder / "added_tokens.json").exists(), edit.__name__
        got = again.fp32_model().state_dict()
        for name, tensor in want.items():
            assert np.array_equal(got[name].numpy(), tensor.numpy()), (edit.__name__, name)


# -- 7. through the CLI: one line, exit 2 -----------------------------------------------------


@pytest.mark.parametrize(
    ("mutate", "fragment"),
    [
        (_past_end, "past the end of the file"),
        (lambda g: g.set("llama.block_count", 3), "no tensors for layer 2"),
        (NOT_NUMBERS["q8_0 scale"][0], "tensor 'token_embd.weight' holds"),
        (lambda g: g.set("llama.context_length", 1 << 62, 10), "llama.context_length is"),
    ],
)
def test_seqkv_model_info_refuses_a_hostile_file_in_one_line(
    tmp_path, cache, tiny, mutate, fragment
):
    mutate(tiny)
    path = _write(tmp_path, tiny)
    result = invoke("model", "info", "--model", path)
    assert_error(result, fragment)
    assert str(path) in result.stderr.replace("\n", "")
    _no_partial_folders(cache)


# -- the fuzzer ------------------------------------------------------------------------------

INTERESTING = [0, 1, 2, 3, 4, 5, 31, 32, 63, 64, 255, 256, 1 << 31, (1 << 32) - 1, 1 << 32]
INTERESTING += [10**6, 1 << 40, 1 << 62, 1 << 63, (1 << 64) - 1]


def mutations(base: Gguf):
    """Valid tiny files with one to three mutations each: a number of the header (a count,
    a length, a type, a dim, an offset) set to an edge value, a metadata value changed,
    bytes of the header flipped, bytes cut or inserted, or the file cut short."""
    original = base.encode()
    fields = list(base.fields)  # where encode() put each number
    values = list(base.values)  # and each scalar value (metadata, array elements)
    header = len(original) - len(base.data)

    @st.composite
    def mutated(draw) -> bytes:
        raw = bytearray(original)
        for _ in range(draw(st.integers(1, 3))):
            if not raw:
                break
            kind = draw(
                st.sampled_from(["number", "number", "value", "flip", "cut", "insert", "truncate"])
            )
            if kind == "value":  # a metadata value, which the header check does not bound
                position, fmt = draw(st.sampled_from(values))
                if position + struct.calcsize(fmt) > len(raw):
                    continue
                if fmt in ("<f", "<d"):
                    value = draw(st.floats(allow_nan=True, allow_infinity=True, width=32))
                elif fmt == "<?":
                    value = draw(st.booleans())
                else:
                    bits = 8 * struct.calcsize(fmt)
                    low, high = (
                        (0, 1 << bits) if fmt[1].isupper() else (-(1 << bits - 1), 1 << bits - 1)
                    )
                    value = draw(
                        st.sampled_from([0, 1, 2, 3, 5, 64, 1 << 20]) | st.integers(low, high - 1)
                    )
                    value = min(max(value, low), high - 1)
                struct.pack_into(fmt, raw, position, value)
            elif kind == "number":
                position, size = draw(st.sampled_from(fields))
                if position + size > len(raw):
                    continue
                value = draw(st.sampled_from(INTERESTING) | st.integers(0, (1 << 8 * size) - 1))
                raw[position : position + size] = (value % (1 << 8 * size)).to_bytes(size, "little")
            elif kind == "flip":  # past the magic bytes, which a test of their own covers
                if len(raw) <= 4:
                    continue
                at = draw(st.integers(4, min(header, len(raw)) - 1))
                raw[at] ^= draw(st.integers(1, 255))
            elif kind == "cut":
                if len(raw) <= 4:
                    continue
                at = draw(st.integers(4, min(header, len(raw)) - 1))
                del raw[at : at + draw(st.integers(1, 16))]
            elif kind == "insert":
                at = draw(st.integers(4, max(4, min(header, len(raw)))))
                raw[at:at] = draw(st.binary(min_size=1, max_size=16))
            else:
                del raw[draw(st.integers(0, len(raw))) :]
        return bytes(raw)

    return mutated()


FUZZ = settings(
    max_examples=2000,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
MEMORY_MULTIPLE = 16  # peak Python allocation of a check, in file sizes (plus 256 KiB)


def _fuzz_checker(valid, examples: int, memory: bool) -> dict:
    """Mutated files through the header parser and the model checks: each is accepted (then
    every tensor lies inside the file, one after another) or refused in one line; with
    ``memory``, no check allocates more than MEMORY_MULTIPLE times the file's size."""
    from seqkv_cli.runtime.checkpoint.gguf_check import check_model, parse_layout

    outcomes = {"accepted": 0, "refused": 0}

    @settings(FUZZ, max_examples=examples)
    @given(mutations(copy.deepcopy(valid[0])))
    def check(raw: bytes) -> None:
        if memory:
            tracemalloc.reset_peak()
            before = tracemalloc.get_traced_memory()[0]
        try:
            layout = parse_layout(raw, len(raw), "fuzz.gguf")
            check_model(layout)
        except SeqkvError as exc:
            assert "\n" not in str(exc) and str(exc).startswith("fuzz.gguf: ")
            outcomes["refused"] += 1
        else:
            end = layout.data_start
            for t in layout.tensors:
                assert t.offset >= end and t.offset + t.nbytes <= len(raw)
                end = t.offset + t.nbytes
            outcomes["accepted"] += 1
        if memory:
            peak = tracemalloc.get_traced_memory()[1] - before
            assert peak <= MEMORY_MULTIPLE * len(raw) + (256 << 10), peak

    if memory:
        tracemalloc.start()
    try:
        check()
    finally:
        if memory:
            tracemalloc.stop()
    assert sum(outcomes.values()) >= examples and min(outcomes.values()) > 0, outcomes
    return outcomes


def test_the_checker_ends_in_a_layout_or_one_line_on_any_mutation(valid):
    """2,000 mutated files (validation only, in memory)."""
    _fuzz_checker(valid, 2000, memory=False)


def test_the_checker_allocates_by_the_files_size_not_by_its_claims(valid):
    """Fewer, with every allocation traced (tracemalloc slows each one)."""
    _fuzz_checker(valid, 300, memory=True)


def test_loading_ends_in_a_model_or_one_line_on_any_mutation(valid):
    """Fewer, whole loads (gguf-py and transformers included) of mutated files."""
    from seqkv_cli.runtime.loading import load_model

    @settings(FUZZ, max_examples=60)
    @given(mutations(copy.deepcopy(valid[0])))
    def load(raw: bytes) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "fuzz.gguf"
            path.write_bytes(raw)
            old = os.environ.get("SEQKV_CACHE")
            os.environ["SEQKV_CACHE"] = str(Path(tmp) / "cache")
            try:
                with within(120):
                    load_model(str(path))
            except SeqkvError as exc:
                assert "\n" not in str(exc)
                _no_partial_folders(Path(tmp) / "cache")
            finally:
                if old is None:
                    os.environ.pop("SEQKV_CACHE")
                else:
                    os.environ["SEQKV_CACHE"] = old

    load()


def test_a_block_type_without_a_known_scale_layout_is_checked_by_its_values(tmp_path):
    """IQ4_NL (not one of `formats`' kinds): dequantized a piece at a time and checked."""
    from seqkv_cli.runtime.checkpoint.gguf_check import check_finite, parse_layout

    blocks = bytearray(2 * 18)  # two blocks of 32: an fp16 scale and 16 bytes of quants
    blocks[0:2] = struct.pack("<e", 0.5)
    for scale, refused in ((0.25, False), (math.inf, True)):
        blocks[18:20] = struct.pack("<e", scale)
        g = Gguf([["general.architecture", STRING, "llama", None]], [["x", [64], 20, 0]], blocks)
        raw = g.encode()
        path = _write(tmp_path, raw, "iq4.gguf")
        layout = parse_layout(raw, len(raw), "iq4.gguf")
        if refused:
            with pytest.raises(SeqkvError, match=r"iq4\.gguf: tensor 'x' holds NaN or infinite"):
                check_finite(path, layout)
        else:
            check_finite(path, layout)


def test_strings_in_arrays_are_capped_over_the_whole_file(valid, monkeypatch):
    """gguf-py holds ~1.6 KB a string: the count over all arrays is capped (MAX_STRINGS)."""
    from seqkv_cli.runtime.checkpoint import gguf_check

    raw = valid[1]
    gguf_check.parse_layout(raw, len(raw), "tiny.gguf")  # 320 tokens and 1 merge
    monkeypatch.setattr(gguf_check, "MAX_STRINGS", 320)
    with pytest.raises(SeqkvError, match=r"'tokenizer\.ggml\.merges' holds 1 strings, past seqkv"):
        gguf_check.parse_layout(raw, len(raw), "tiny.gguf")


def test_per_layer_head_counts_are_checked_layer_by_layer(valid):
    """Head counts may be one per layer (an array); each is checked, and an array too long to
    have been kept is refused rather than skipped."""
    import dataclasses

    from seqkv_cli.runtime.checkpoint.gguf_check import ArrayValue, check_model, parse_layout

    layout = parse_layout(valid[1], len(valid[1]), "tiny.gguf")
    key = "llama.attention.head_count_kv"
    for value, fragment in (
        (ArrayValue(4, 2, (2, 2)), None),
        (ArrayValue(4, 2, (2, 3)), "head_count (4) is not a multiple of " + key + " (3)"),
        (ArrayValue(4, 3, (2, 2, 2)), key + " must be an integer or 2 of them"),
        (ArrayValue(4, 2, None), key + " holds 2 values (seqkv checks at most 4096)"),
    ):
        changed = dataclasses.replace(layout, metadata={**layout.metadata, key: value})
        if fragment is None:
            check_model(changed)
        else:
            with pytest.raises(SeqkvError) as caught:
                check_model(changed)
            assert fragment in str(caught.value)


def test_files_beside_the_gguf_are_not_part_of_the_model(tmp_path, cache, valid, monkeypatch):
    """A tokenizer or chat template file next to the .gguf (a folder of downloads) is not
    mixed into the model read from the file (transformers, given gguf_file, reads only the
    file today: this guards that it stays so)."""
    from seqkv_cli.runtime.loading import load_model

    (tmp_path / "alone").mkdir()
    (tmp_path / "beside").mkdir()
    alone = load_model(str(_write(tmp_path / "alone", valid[1], "tiny.gguf")))
    beside = tmp_path / "beside"
    path = _write(beside, valid[1], "tiny.gguf")
    (beside / "added_tokens.json").write_text(json.dumps({"<|evil|>": 320}))
    (beside / "chat_template.jinja").write_text("{{ 'evil' }}")
    (beside / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ 'evil' }}"}))
    monkeypatch.setenv("SEQKV_CACHE", str(tmp_path / "another cache"))  # read afresh
    lm = load_model(str(path))
    assert len(lm.tokenizer) == len(alone.tokenizer) and "<|evil|>" not in lm.tokenizer.get_vocab()
    assert lm.tokenizer.chat_template == alone.tokenizer.chat_template
    assert lm.tokenizer_fingerprint == alone.tokenizer_fingerprint
