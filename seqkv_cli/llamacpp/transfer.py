"""`seqkv import llama-state` / `seqkv export llama-state`: llama.cpp saved states in and out of
a trie archive.

Import keeps, per state file, its token list (coded under the model, shared prefixes stored
once) and either llama.cpp's own K/V bytes (exact: the residual against seqkv's canonical
recompute, so export writes the file back byte for byte) or nothing more (tokens only: export
writes seqkv's canonical K/V, close to llama.cpp's but not its bits; or llama.cpp re-prefills
from the token list). The layout fields llama.cpp checks on load (file kind, V transposition,
cache types, stream, sequence id) are kept with the session.

A state file names no model (a session file names its architecture only), so the model is
checked by what the file holds: layer count, KV width, token ids within the vocabulary, and
K/V close to this model's recompute (a state of another GGUF is ~100 % away, one of this GGUF
a few %: llama.cpp quantizes activations for quantized weights).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from seqkv_cli.errors import SeqkvError
from seqkv_cli.llamacpp.convert import (
    INTERLEAVED_KEY_ARCHS,
    from_capture_kv,
    to_capture_kv,
)
from seqkv_cli.llamacpp.layout import check_layout
from seqkv_cli.llamacpp.state_file import LlamaState, parse_state, write_state

META_KEY = "llama_state"
# ‖file K/V - recompute‖ / ‖recompute‖ above this: the state is not of this model. Measured
# on the embedded Q4_1 GGUF: 0.4-5.5 % for its own states, > 100 % for another model's.
MAX_RELATIVE_DIFFERENCE = 0.25
MAX_STATE_BYTES = 1 << 36  # 64 GiB: far past any context seqkv's models have
_MODEL_ARCHS = {"llama": {"llama", "mistral"}}  # GGUF arch -> transformers model types


@dataclass(frozen=True)
class ImportedState:
    id: str
    path: str
    tokens: int
    file_bytes: int
    mode: str  # "exact" | "tokens-only"
    relative_difference: float | None  # file K/V vs the canonical recompute (exact mode)


@dataclass(frozen=True)
class ImportReport:
    archive: str
    states: list[ImportedState]
    added_bytes: int
    file_bytes: int

    @property
    def state_bytes(self) -> int:
        return sum(s.file_bytes for s in self.states)


@dataclass(frozen=True)
class ExportReport:
    path: str
    id: str
    tokens: int
    bytes: int
    kv: str  # "llama.cpp's own (byte-identical to the imported file)" | "seqkv's recompute"


def read_state(path: Path) -> tuple[LlamaState, bytes]:
    try:
        size = path.stat().st_size
        if not path.is_file():
            raise SeqkvError(f"{path} is not a file")
        if size > MAX_STATE_BYTES:
            raise SeqkvError(f"{path}: {size:,} bytes is larger than any state seqkv reads")
        data = path.read_bytes()
    except OSError as exc:
        raise SeqkvError(f"cannot read {path}: {exc.strerror}") from None
    return parse_state(data, str(path)), data


def state_id(path: Path) -> str:
    """A session id from a state file's name (llama-server names slot files freely)."""
    stem = path.name
    for suffix in (".bin", ".state", ".session", ".slot"):
        if stem.endswith(suffix) and len(stem) > len(suffix):
            stem = stem[: -len(suffix)]
            break
    return stem


def gguf_arch(lm) -> str:
    """The GGUF architecture name llama.cpp gives this model (what session files record)."""
    model_type = str(getattr(lm.config, "model_type", ""))
    for arch, types in _MODEL_ARCHS.items():
        if model_type in types:
            return arch
    return model_type


def check_state_against_model(state: LlamaState, lm, name: str) -> None:
    """What can be checked without running the model: architecture, layers, vocabulary."""
    arch = gguf_arch(lm)
    if state.arch is not None and state.arch != arch:
        raise SeqkvError(
            f"{name}: a state of a {state.arch!r} model; the model given ({lm.name}) is "
            f"{arch!r}: pass the GGUF the state was saved with (--model)"
        )
    if len(state.layers) != lm.num_layers:
        raise SeqkvError(
            f"{name}: {len(state.layers)} layers in the state, {lm.num_layers} in the model "
            f"given ({lm.name}): a state of another model? (--model)"
        )
    bad = [t for t in state.tokens if t >= lm.vocab_size]
    if bad:
        raise SeqkvError(
            f"{name}: token id {bad[0]} is outside the vocabulary of {lm.name} "
            f"(0..{lm.vocab_size - 1}): a state of another model? (--model)"
        )
    if len(state.tokens) > lm.max_context:
        raise SeqkvError(
            f"{name}: {len(state.tokens)} tokens, more than {lm.name}'s context ({lm.max_context})"
        )


def import_states(
    paths: list[Path],
    archive: Path,
    *,
    model=None,
    tokens_only: bool = False,
    ids: list[str] | None = None,
) -> ImportReport:
    """Archive llama.cpp state files in `archive` (created, or appended to)."""
    from seqkv_cli.api import open_archive
    from seqkv_cli.fsutil import check_output_file, refuse_output_in_inputs

    paths = [Path(p) for p in paths]
    if not paths:
        raise SeqkvError("no state files given")
    archive = Path(archive)
    check_output_file(archive)
    refuse_output_in_inputs(archive, paths)
    ids = list(ids) if ids is not None else [state_id(p) for p in paths]
    if len(ids) != len(paths):
        raise SeqkvError(f"{len(ids)} ids for {len(paths)} state files")
    seen: dict[str, Path] = {}
    for sid, path in zip(ids, paths, strict=True):
        if sid in seen:
            raise SeqkvError(f"{path} and {seen[sid]} would both be session {sid!r}; rename one")
        seen[sid] = path
    with open_archive(archive, model=model) as arc:
        lm = arc.lm
        items, states = [], []
        for sid, path in zip(ids, paths, strict=True):
            state, data = read_state(path)
            check_state_against_model(state, lm, str(path))
            states.append((sid, path, state, len(data)))
            meta = {META_KEY: _layout_meta(state, data)}
            if tokens_only:
                items.append({"session_id": sid, "input_ids": state.tokens, "meta": meta})
                continue
            types = {(layer.k_type, layer.v_type) for layer in state.layers}
            if len(types) > 1 or len(set(next(iter(types)))) > 1:
                raise SeqkvError(
                    f"{path}: K and V caches of different types ({state.layout()['k_type']} "
                    f"keys, {state.layout()['v_type']} values); exact import keeps one type "
                    "per session: use --tokens-only"
                )
            keys, values = to_capture_kv(
                state, lm.num_kv_heads, lm.head_dim, _interleaved(state.arch, lm)
            )
            items.append(
                {
                    "session_id": sid,
                    "input_ids": state.tokens,
                    "cache": _as_cache(keys, values),
                    "residual": "lossless",
                    "meta": meta,
                    "max_relative_difference": MAX_RELATIVE_DIFFERENCE,
                }
            )
        reports = arc.add_many(items)
    mode = "tokens-only" if tokens_only else "exact"
    imported = [
        ImportedState(sid, str(path), len(state.tokens), size, mode, rep.relative_difference)
        for (sid, path, state, size), rep in zip(states, reports, strict=True)
    ]
    return ImportReport(str(archive), imported, reports[0].added_bytes, reports[0].file_bytes)


def export_state(
    archive: Path,
    session_id: str,
    out: Path,
    *,
    model=None,
    kind: str | None = None,
    flash_attn: bool | None = None,
    cache_type: str | None = None,
) -> ExportReport:
    """Write session `session_id` of `archive` as a llama.cpp state file `out`."""
    from seqkv_cli.api import open_archive
    from seqkv_cli.fsutil import atomic_path, check_output_file, refuse_output_in_inputs

    out, archive = Path(out), Path(archive)
    check_output_file(out)
    refuse_output_in_inputs(out, [archive])
    if kind not in (None, "session", "sequence"):
        raise SeqkvError(f"--kind must be session or sequence, not {kind!r}")
    if cache_type not in (None, "f32", "f16", "bf16"):
        raise SeqkvError(f"--cache-type must be f32, f16 or bf16, not {cache_type!r}")
    with open_archive(archive, model=model) as arc:
        lm = arc.lm
        stored = arc.meta(session_id).get(META_KEY)
        cap = arc.load_capture(session_id)
    where = f"{archive}: session {session_id!r}"
    layout = export_layout(stored, gguf_arch(lm), where, kind, flash_attn, cache_type)
    tokens = cap.tokens.tolist()
    state = from_capture_kv(cap.keys, cap.values, tokens, layout, _interleaved(layout["arch"], lm))
    data = write_state(state)
    try:  # the writer only ever publishes what the reader accepts
        parse_state(data, str(out))
    except SeqkvError as exc:
        raise SeqkvError(f"{where}: not exported, the state would not read back ({exc})") from None
    own = cap.meta.get("numeric_path") == "user-cache"
    same = isinstance(stored, dict) and hashlib.sha256(data).hexdigest() == stored.get("sha256")
    if own and same:
        kv = "llama.cpp's own (byte-identical to the imported file)"
    elif own:
        kv = "llama.cpp's own, in the layout asked for"
    else:
        kv = "seqkv's canonical recompute (llama.cpp's own K/V were not stored)"
    with atomic_path(out) as tmp:
        tmp.write_bytes(data)
    return ExportReport(str(out), session_id, len(tokens), len(data), kv)


def export_layout(stored, arch: str, where: str, kind=None, flash_attn=None, cache_type=None):
    """The layout to write: the session's stored one (else llama.cpp's defaults) with the
    options applied, every field checked as the parser would check the file (`check_layout`).
    `stored` is the session's metadata, which any archive or `add(meta=...)` can set."""
    if stored is None:
        layout = default_layout()
    elif isinstance(stored, dict):
        layout = dict(stored)
    else:
        raise SeqkvError(
            f"{where}: its {META_KEY!r} metadata is {type(stored).__name__}, not the layout "
            "seqkv stores on import"
        )
    if kind is not None:
        layout["kind"] = kind
    if flash_attn is not None:
        layout["v_trans"] = not flash_attn
    if cache_type is not None:
        layout["k_type"] = layout["v_type"] = cache_type
    if layout.get("kind") == "session" and not layout.get("arch"):
        layout["arch"] = arch
    return check_layout(layout, where)


def _interleaved(arch: str | None, lm) -> bool:
    return (arch or gguf_arch(lm)) in INTERLEAVED_KEY_ARCHS


def _layout_meta(state: LlamaState, data: bytes) -> dict:
    layout = {k: v for k, v in state.layout().items() if v is not None}
    layout["sha256"] = hashlib.sha256(data).hexdigest()
    layout["file_bytes"] = len(data)
    return layout


def default_layout() -> dict:
    """What llama.cpp's defaults load: a sequence file (llama-server's slot format), f16
    cache, flash attention on (llama.cpp's `-fa auto` on CPU), one stream, sequence 0."""
    return {
        "kind": "sequence",
        "token_form": "plain",
        "n_stream": 1,
        "stream": 0,
        "seq_id": 0,
        "v_trans": False,
        "k_type": "f16",
        "v_type": "f16",
    }


def _as_cache(keys, values):
    """The K/V as the legacy tuple cache `MemoryArchive.add` takes: (1, heads, n, hd)."""
    return tuple((k[None], v[None]) for k, v in zip(keys, values, strict=True))
