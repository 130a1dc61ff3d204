"""Creating a `.skv` file: captures (or token ids) in, one container out, published only once
it restores.

`compress_captures` resolves the codec and asks its capabilities, never its id: a
trie-capable codec writes a trie archive (`compress_sources`: the trie places and codes every
session as one segment, and a one-session segment becomes a compact file where it qualifies);
any other codec writes one set of sections per session (the flat layout). With `check`, the
staged file is restored and compared with every capture before it takes its real name
(`fsutil.publish`), so a file that would not restore is never reported as written.

`capture_and_code` is what `seqkv pipeline` runs: a canonical capture of a session is, by
definition, what the canonical forward computes for its tokens, and that is exactly what the
`seq` encoder's trie walk computes to code them, so one walk does both. Sessions go in as
their token ids, each shared prefix is run once, and every session's K/V and surprisal, as the
walk recomputed them, are written as the capture file `seqkv capture` would write (the same
tensors, bit for bit: the portable forward gives the same bits however a sequence is cut).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from seqkv_cli.archive.identity import load_canonical, same_model, writer_version
from seqkv_cli.archive.restore import Archive
from seqkv_cli.archive.verify import check_restored
from seqkv_cli.clock import created_utc
from seqkv_cli.container import ContainerWriter
from seqkv_cli.container.compact import CODECS as COMPACT_CODECS
from seqkv_cli.container.compact import write_compact, write_compact_archive
from seqkv_cli.container.layout import kv_part, section_name, session_entry
from seqkv_cli.errors import SeqkvError
from seqkv_cli.fsutil import (
    check_output_file,
    discard_quietly,
    publish,
    refuse_output_in_inputs,
    staging_name,
)
from seqkv_cli.kvcapture.api import CaptureResult, Plan
from seqkv_cli.kvcapture.blocks import to_block
from seqkv_cli.kvcapture.capture_file import (
    load_capture,
    load_capture_meta,
    save_capture,
    tokens_as_u4,
)
from seqkv_cli.kvcapture.engine import canonical_model, provenance
from seqkv_cli.runtime.loading import LoadedModel, load_model
from seqkv_cli.runtime.numerics import DEFAULT, PORTABLE_PATHS
from seqkv_cli.runtime.numerics import resolve as resolve_numerics
from seqkv_cli.sequential.registry import (
    capabilities,
    codec_capabilities,
    resolve_codec,
    session_codec_class,
    session_codec_classes,
)
from seqkv_cli.trie import (
    FRESH,
    SegmentBuild,
    Source,
    Trie,
    archive_header,
    build_segment,
    choose_members,
    compact_archive_form,
    compact_form,
    place_sessions,
    segment_sections,
)

if TYPE_CHECKING:
    from seqkv_cli.kvcapture.capture_file import Capture
    from seqkv_cli.kvcapture.inputs import Document
    from seqkv_cli.runtime.forward import CanonicalForward
    from seqkv_cli.sequential.session_codec import SessionCodec
    from seqkv_codecs.base import Codec


@dataclass
class CompressResult:
    path: Path
    sessions: int = 0
    positions: int = 0
    input_kv_bytes: int = 0
    file_bytes: int = 0
    part_bytes: dict[str, int] = field(default_factory=dict)
    layout: str = "flat"  # "flat", "trie" or "compact" (docs/FORMAT.md)


LAYOUTS = ("auto", "trie", "flat", "compact")


def codec_spec(
    codec: str,
    *,
    residual: str = "lossless",
    tolerance: float | None = None,
    numerics: str | None = None,
    parallel: int = 1,
) -> str | dict:
    """The codec config `compress` writes with, from `seqkv compress`'s choices: each option
    that applies to the codec goes into its config, and one that does not is refused in one
    line, asked of the codec's capabilities, never of its id. An unknown id is refused before
    any capture is read. `numerics`: a path name as `--numerics` takes it (None: the captures'
    own portable path, decided by `compress_captures`)."""
    if tolerance is not None and tolerance <= 0:
        raise SeqkvError(f"--tolerance must be > 0, got {tolerance}")
    caps = codec_capabilities(codec)
    spec: str | dict = codec
    if caps is not None and caps.takes_residual:
        spec = {"id": codec, "residual": residual}
        if numerics is not None:
            spec["numerics"] = resolve_numerics(numerics)
        if tolerance is not None:
            spec["tolerance"] = tolerance
    elif tolerance is not None:
        takers = [c.codec_id for c in session_codec_classes() if c.takes_residual]
        raise SeqkvError(f"--tolerance applies to {', '.join(takers)}, not {codec}")
    if parallel != 1:
        cls = session_codec_class(codec)
        if cls is None or not codes_runs(cls):
            takers = [c.codec_id for c in session_codec_classes() if codes_runs(c)]
            raise SeqkvError(f"--parallel applies to {', '.join(takers)}, not {codec}")
        spec = {**({"id": codec} if isinstance(spec, str) else spec), "parallel": parallel}
    resolve_codec(spec)
    return spec


def memory_codec(codec: str | dict, numerics: str | None):
    """The codec a library archive (`open_archive`) keeps new sessions with: a model-backed
    trie codec (seq, seq-fast) without parallel runs; a config without a numeric path takes
    `numerics`, else the portable default (read from a file, a missing path means the legacy
    forward that predates the field)."""
    from seqkv_cli.runtime.numerics import DEFAULT
    from seqkv_cli.sequential.registry import codec_capabilities

    config = dict(codec) if isinstance(codec, dict) else {"id": codec}
    caps = codec_capabilities(str(config.get("id")))
    if caps is None or not (caps.needs_canonical and caps.trie_capable and caps.takes_residual):
        raise SeqkvError(
            f"open_archive keeps sessions with a model-backed trie codec (seq, seq-fast); "
            f"{config.get('id')!r} is not one"
        )
    if config.get("parallel", 1) != 1:
        # A trie stores each session as one branch coded in one run; runs side by side
        # would be recorded and never used (the same bytes, the same load time).
        raise SeqkvError(
            "open_archive: parallel runs (seq --parallel) are not kept in trie archives; "
            "use codec='seq-fast' for a one-prefill load, or `seqkv compress --parallel N` "
            "for whole sessions in a file of their own"
        )
    config.setdefault("numerics", numerics or DEFAULT)
    return resolve_codec(config)


def codes_runs(codec_class: type) -> bool:
    """Whether a session codec can code a session as parallel runs (`compress --parallel`):
    its config takes `parallel`. (The registry's capability flags do not carry it yet.)"""
    return "parallel" in inspect.signature(codec_class).parameters


def _with_default_numerics(codec: str | dict, paths=()) -> str | dict:
    """A config that names no numeric path is written on the portable path the captures were
    made on (so they stay canonical: no residual), else on the default. Only reading keeps the
    old meaning of a missing `numerics` (files from before it existed: legacy)."""
    if isinstance(codec, str) and session_codec_class(codec) is not None:
        codec = {"id": codec}
    if isinstance(codec, dict) and "numerics" not in codec:
        cls = session_codec_class(codec.get("id"))
        if cls is not None and cls.takes_residual:  # the recomputing codecs, which have paths
            made_on = {load_capture_meta(p).get("numeric_path") for p in paths}
            path = made_on.pop() if len(made_on) == 1 else None
            return {**codec, "numerics": path if path in PORTABLE_PATHS else DEFAULT}
    return codec


def compress_captures(
    paths: str | Path | Iterable[str | Path],
    out: str | Path,
    *,
    codec: str | dict = "lossless",
    check: bool = True,
    model: str | LoadedModel | None = None,
    on_progress: Callable[[int], None] | None = None,
    layout: str = "auto",
    near_dup: bool = False,
) -> CompressResult:
    """Encode every capture with `codec` and write the container atomically.

    ``layout="auto"`` (the default) stores prefixes that sessions share once (seqkv_cli/trie)
    for the codecs that can, and one such session as a compact single-session file
    (format 1.2: no capture provenance kept); ``"trie"`` always writes the full trie layout,
    ``"compact"`` insists on the compact one, and ``"flat"`` codes every session on its own.
    With `check`, everything encoded is decoded again and, for lossless codecs, compared bit
    for bit, so a file that would not restore is never reported as written. `paths`: one
    capture file or several.
    """
    paths = [Path(paths)] if isinstance(paths, str | Path) else [Path(p) for p in paths]
    out = Path(out)
    if not paths:
        raise SeqkvError("no captures to compress")
    check_output_file(out)  # the library path too
    refuse_output_in_inputs(out, paths)
    if layout not in LAYOUTS:
        raise SeqkvError(f"unknown layout {layout!r}; use one of {', '.join(LAYOUTS)}")
    coder = resolve_codec(_with_default_numerics(codec, paths))
    caps = capabilities(coder)
    if layout == "compact" and coder.codec_id not in COMPACT_CODECS:
        raise SeqkvError(f"--layout compact holds seq or seq-fast sessions, not {coder.codec_id}")
    if layout in ("trie", "compact") and not caps.trie_capable:
        what = "--parallel runs" if getattr(coder, "parallel", 1) > 1 else coder.codec_id
        raise SeqkvError(f"{what} code each session on its own: use --layout flat (or auto)")
    if layout != "flat" and caps.trie_capable:
        sources = [Source.from_path(path) for path in paths]
        return compress_sources(
            sources, Path(out), coder, check, model, on_progress, near_dup, layout
        )
    if near_dup:
        raise SeqkvError("--near-dup needs the trie layout and a seq or seq-fast codec")
    canon, header_model = None, None
    if caps.needs_canonical:
        canon, header_model = load_canonical(model, coder.numerics)
    result = CompressResult(Path(out))
    sessions, seen = [], set()
    with ContainerWriter(out) as writer:
        for index, path in enumerate(paths):
            cap = load_capture(path)
            header_model = same_model(header_model, cap, path)
            if cap.session_id in seen:
                raise SeqkvError(f"two captures have session id '{cap.session_id}' ({path})")
            seen.add(cap.session_id)
            if canon is not None:
                names, extra = _write_sequential(writer, index, cap, coder, canon, check, result)
                if on_progress:
                    on_progress(cap.positions)
            else:
                names = _write_session(writer, index, cap, coder, check, result, on_progress)
                extra = {}
            sessions.append({**session_entry(index, cap, names), **extra})
            result.sessions += 1
            result.positions += cap.positions
        header = {
            "pipeline": [coder.get_config()],
            "model": header_model,
            "sessions": sessions,
            "meta": {
                "created": created_utc(),
                "writer": writer_version(),
            },
        }
        written = writer.finish(header)
    result.file_bytes = written.file_bytes
    result.part_bytes["header"] = written.file_bytes - written.section_bytes
    return result


def _add_section(writer, result, names, index: int, part: str, data: bytes, group: str) -> None:
    """Write one section of session `index` and count its bytes under `group`."""
    name = section_name(index, part)
    writer.add_section(name, data)
    names.append(name)
    result.part_bytes[group] = result.part_bytes.get(group, 0) + len(data)


def _write_session(writer, index, cap, coder, check, result, on_progress) -> list[str]:
    names: list[str] = []
    tokens = tokens_as_u4(cap.tokens, f"session {cap.session_id}")  # refuses ids that wrap
    _add_section(writer, result, names, index, "tokens", tokens, "tokens")
    surprisal = np.asarray(cap.surprisal.numpy(), dtype="<f8").tobytes()
    _add_section(writer, result, names, index, "surprisal", surprisal, "surprisal")
    for layer in range(len(cap.keys)):
        for kind, tensor in (("key", cap.keys[layer]), ("value", cap.values[layer])):
            block = to_block(tensor, cap.meta["dtype"], kind)
            encoded = coder.encode(block)
            if check:
                _check_block(coder, encoded, block, f"{cap.session_id} layer {layer}")
            _add_section(writer, result, names, index, kv_part(layer, kind), encoded, "kv")
            result.input_kv_bytes += block.nbytes
    if on_progress:
        on_progress(cap.positions)
    return names


def _write_sequential(writer, index, cap, coder, canon: CanonicalForward, check, result):
    enc = coder.encode(cap, canon)
    names: list[str] = []
    for part, data in enc.parts.items():
        group = "tokens" if part == "tokens.seq" else part.split(".", 1)[0]
        _add_section(writer, result, names, index, part, data, group)
    result.input_kv_bytes += cap.kv_bytes()
    if check:
        entry = {"id": cap.session_id, "positions": cap.positions, "dtype": cap.meta["dtype"]}
        restored = coder.decode(entry, enc.parts.get, canon)
        check_restored(cap, restored, coder, "nothing written")
    extra = {
        "token_bits_ideal": round(enc.token_bits_ideal, 3),
        "residual_bytes": enc.residual_bytes,
        "notes": enc.notes,
    }
    return names, extra


def _check_block(coder, encoded: bytes, block, where: str) -> None:
    decoded = coder.decode(encoded)
    if decoded.shape != block.shape or decoded.dtype != block.dtype:
        raise SeqkvError(f"codec {coder.codec_id} changed the shape of {where}; not written")
    if coder.lossless and decoded != block:
        raise SeqkvError(f"codec {coder.codec_id} did not round-trip {where}; not written")


def compress_sources(
    sources: list[Source],
    out: Path,
    coder: SessionCodec | Codec,
    check: bool,
    model: str | LoadedModel | None,
    on_progress: Callable[[int], None] | None,
    near_dup: bool = False,
    layout: str = "auto",
    on_session: Callable[[int, Capture], None] | None = None,
    meta: dict | None = None,
    merge_prefixes: bool = False,
    exclusive: bool = False,
):
    """A new trie archive at `out` from sources (capture files, in-memory captures or
    tokens only); `meta`: entries added to the header's `meta` (a full-layout file only).
    `exclusive`: `out` is created only if it does not exist yet (a hard link never replaces
    a file); None when another writer created it meanwhile (the library's first `add`).

    `layout`: "auto" (one session that qualifies: a compact file), "compact", "smallest"
    or "trie" (`write_new`); `merge_prefixes`: a session that is a prefix of another ends
    inside its node (`trie.plan.insertion_order`). `on_session(index, capture)`: each
    tokens-only source as the walk recomputed it (trie/encode.py), before the archive is
    verified and published."""
    seen, header_model = set(), None
    for src in sources:
        header_model = same_model(header_model, src, src.where)
        if src.session_id in seen:
            raise SeqkvError(f"two captures have session id '{src.session_id}' ({src.where})")
        seen.add(src.session_id)
    lm = canon = None
    if capabilities(coder).needs_canonical:
        lm = model if isinstance(model, LoadedModel) else load_model(model)
        canon, ident = load_canonical(lm, coder.numerics)
        if ident["fingerprint"] != header_model["fingerprint"]:
            raise SeqkvError(
                f"{sources[0].where} comes from a different model "
                f"({header_model['fingerprint'][:12]} vs the loaded {ident['fingerprint'][:12]}); "
                "pass --model with the capture's model"
            )
        header_model = ident
    members = {}
    if near_dup:
        if canon is None:
            raise SeqkvError("--near-dup needs a model-backed codec (seq or seq-fast)")
        members = choose_members(sources)
    trie = Trie()
    ends = place_sessions(trie, sources, members, merge_prefixes)
    build = build_segment(
        trie,
        0,
        sources,
        ends,
        coder,
        canon,
        on_progress,
        members=members,
        on_session=on_session,
        context=FRESH,  # a new file is format 1.6: version-2 tables
    )
    meta = {
        **(meta or {}),
        "created": created_utc(),
        "writer": writer_version(),
    }
    # `.{out}.{host}-{pid}-{random}.staging`: unique to this run, so two compresses to the
    # same output never delete or publish each other's file; named after its writer, so a
    # later run deletes the ones whose writer died (SIGKILL leaves them behind)
    tmp = staging_name(out, ".staging")
    try:
        file_bytes, written = write_new(tmp, out, build, coder, header_model, meta, layout)
        if check:
            verify_against(tmp, sources, coder, lm)
        if not publish(tmp, out, exclusive=exclusive):
            return None
    except BaseException:
        discard_quietly(tmp)
        raise
    result = CompressResult(out, len(sources), sum(len(s.tokens) for s in sources))
    result.input_kv_bytes = sum(_kv_bytes(s.meta, len(s.tokens)) for s in sources)
    result.file_bytes, result.layout = file_bytes, written
    for kind in ("tokens", "residual", "kv", "surprisal"):
        if n := build.bytes_of(kind):
            result.part_bytes[kind] = n
    stored = [d for name, d in build.parts.items() if written == "trie" or name != "index"]
    if written == "trie":
        result.part_bytes["trie tables"] = len(build.parts["index"])
    result.part_bytes["header"] = file_bytes - sum(len(d) for d in stored)
    return result


def write_new(
    tmp: Path,
    out: Path,
    build: SegmentBuild,
    coder: SessionCodec | Codec,
    header_model: dict,
    meta: dict,
    layout: str = "trie",
) -> tuple[int, str]:
    """Write a one-segment trie archive for `out` to its staging file `tmp`: its size and
    layout.

    ``layout="auto"`` writes a one-session segment as a compact file (format 1.2: no JSON
    header, no capture provenance) where it qualifies (a session with a replay record: a
    one-session compact archive, format 1.9), ``"compact"`` insists on a compact
    file (several sessions: a compact archive, format 1.8), ``"smallest"`` (what `archive
    compact` asks for) writes whichever compact file qualifies, and ``"trie"`` always writes
    the full layout. The caller verifies `tmp` and publishes it as `out` or drops it.
    """
    config = coder.get_config()
    if layout in ("auto", "compact", "smallest"):
        form = compact_form(build, config, header_model)
        if not isinstance(form, str):
            return write_compact(tmp, *form), "compact"
        # several sessions, or one with a replay record (which a compact archive's table holds)
        if layout != "auto" or len(build.tables.sessions) == 1:
            many = compact_archive_form(build, config, header_model)
            if not isinstance(many, str):
                return write_compact_archive(tmp, *many), "compact archive"
            form = many
        if layout == "compact":
            raise SeqkvError(f"{out} cannot be a compact file: {form}")
    header = archive_header(config, header_model, meta)
    with ContainerWriter(tmp) as writer:
        for name, data in segment_sections(build, 1):
            writer.add_section(name, data)
        return writer.finish(header).file_bytes, "trie"


def verify_against(
    path: Path, sources: list[Source], coder: SessionCodec | Codec, lm: LoadedModel | None
) -> None:
    """Restore every session of `path` and compare it with its capture; refuse on any miss."""
    by_id = {s.session_id: s for s in sources}
    with Archive(path, model=lm) as arc:
        for entry, restored in arc.restore_many(arc.sessions):
            if isinstance(restored, Exception):
                raise SeqkvError(f"verification failed, nothing written: {restored}")
            src = by_id[entry["id"]]
            if src.recompute:  # K/V are the canonical recompute by definition: tokens decide
                if not np.array_equal(restored.tokens.numpy(), src.tokens):
                    raise SeqkvError(
                        f"verification failed, nothing written: session {src.session_id!r} "
                        "restores other tokens than it was given"
                    )
                continue
            check_restored(src.load(), restored, src.coder_for(coder), "nothing written")


def _kv_bytes(meta: dict, positions: int) -> int:
    size = {"bf16": 2, "fp16": 2, "fp32": 4}.get(meta.get("dtype"), 2)
    return (
        2
        * positions
        * size
        * int(meta["num_layers"])
        * int(meta["num_kv_heads"])
        * int(meta["head_dim"])
    )


def capture_and_code(
    lm: LoadedModel,
    plan: Plan,
    targets: list[Path],
    out: Path,
    *,
    dtype: str,
    numerics: str | None = None,
    on_progress: Callable[[int], None] | None = None,
) -> tuple[CompressResult, list[CaptureResult]]:
    """Write `plan`'s sessions as captures at `targets` and as a `seq` archive at `out`, on
    the canonical path `numerics` (None: the default, as `seqkv capture`)."""
    path = canonical_model(lm, numerics).numeric_path

    def meta(
        doc: Document, ids: list[int]
    ) -> dict:  # what capture_one writes (session_id comes with the source)
        made = provenance(lm, dtype=dtype, numeric_path=path, positions=len(ids))
        return {**made, "source": doc.source}

    sources = [
        Source.tokens_only(doc.id, ids, meta(doc, ids))
        for doc, ids in zip(plan.documents, plan.token_ids, strict=True)
    ]
    captures: dict[int, CaptureResult] = {}

    def write_capture(index: int, cap: Capture) -> None:
        written = save_capture(cap, targets[index])
        captures[index] = CaptureResult(plan.documents[index], cap, targets[index], written)

    coder = resolve_codec({"id": "seq", "numerics": path})
    result = compress_sources(
        sources, Path(out), coder, False, lm, on_progress, on_session=write_capture
    )
    return result, [captures[i] for i in range(len(sources))]
