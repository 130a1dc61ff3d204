"""`seqkv archive add`: new sessions become one more segment; nothing committed is rewritten.

The archive stays locked from reading its tables to committing the segment, so two adders
run one after the other and the second branches off the first's sessions. A crash before the
commit point leaves the file at its previous state (seqkv_cli/container/append.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from seqkv_cli.archive.identity import fingerprint_matches, load_canonical, model_identity
from seqkv_cli.archive.restore import Archive
from seqkv_cli.container import locked_for_append
from seqkv_cli.container.format import LAYOUT_RECORDS, REPLAY_MINOR, SEGMENT_CODECS_MINOR
from seqkv_cli.errors import SeqkvError
from seqkv_cli.runtime.loading import LoadedModel, load_model
from seqkv_cli.sequential.load_modes import check_mode, load_mode, mode_codec
from seqkv_cli.sequential.registry import capabilities, resolve_codec
from seqkv_cli.trie import (
    MAX_POSITIONS,
    NodeSource,
    PartReader,
    Source,
    WarmStates,
    archive_header,
    check_context,
    expanded,
    grow_segment,
    index_sections,
    load_trie,
    refuse_empty,
    segment_sections,
)


@dataclass
class AddResult:
    sessions: int
    positions: int
    new_tokens: int  # tokens no earlier session had at the same prefix
    added_bytes: int
    file_bytes: int


def add_captures(
    path: Path,
    capture_paths: list[Path],
    model: str | LoadedModel | None = None,
    on_wait: Callable[[], None] | None = None,
    load: str | None = None,
) -> AddResult:
    if not Path(path).is_file():
        raise SeqkvError(f"no such archive: {path} (create it with `seqkv compress`)")
    return add_sources(path, [Source.from_path(p) for p in capture_paths], model, on_wait, load)


def add_sources(
    path: Path,
    sources: list[Source],
    model: str | LoadedModel | None = None,
    on_wait: Callable[[], None] | None = None,
    load: str | None = None,
    warm: WarmStates | None = None,
) -> AddResult:
    """Append sessions (capture files or in-memory captures) to the trie archive `path`.

    `load` ("small" or "fast", sequential/load_modes.py) codes them for that load time; None
    keeps the archive's own codec. `warm` (the library API's): the canonical state of the
    session this process appended last, continued by a session that extends it."""
    if not Path(path).is_file():
        raise SeqkvError(f"no such archive: {path} (create it with `seqkv compress`)")
    refuse_empty(sources)
    with locked_for_append(path, on_wait) as appender:
        if appender.compact:
            model = _expand_compact(appender, model, path)
    if appender.compact:  # now a full-layout archive: lock it again (a waiter may be first)
        return add_sources(path, sources, model, on_wait, load, warm)
    with locked_for_append(path, on_wait) as appender:
        reader = appender.reader
        header = reader.header
        stage = header["pipeline"][0] if header["pipeline"] else {}
        if "trie" not in header and isinstance(stage, dict) and stage.get("parallel", 1) != 1:
            raise SeqkvError(
                f"{path} codes each session as runs (seq --parallel): sessions cannot be added "
                "to it; compress them into another file"
            )
        if "trie" not in header:
            raise _flat(path)
        # bounded before the model is known; _model_side checks the model's own context
        contents = load_trie(reader, Path(path), max_context=MAX_POSITIONS)
        coder = resolve_codec(header["pipeline"][0])
        segment_coder = _segment_coder(coder, load, reader, path)
        _check_new(sources, contents, header, path)
        before = reader.slot.committed_end  # a torn tail of a killed add is dropped, not kept
        segment = len(contents.segments) + 1
        canon, source = _model_side(coder, contents, reader, model, header, path)
        # a file older than 1.6 takes version-1 tables, so the seqkv that wrote it still reads it
        versioned = reader.layout == LAYOUT_RECORDS
        packed = reader.version >= (1, SEGMENT_CODECS_MINOR)  # packed ids: a 1.7 file
        if reader.version < (1, REPLAY_MINOR):  # its readers know replay records as JSON only
            contents.context = replace(contents.context, binary_replay=False)
        build = grow_segment(
            contents, source, sources, segment_coder, canon, versioned, coder, packed, warm
        )
        written = appender.commit([], segment_sections(build, segment))
    new_tokens = sum(n.n_tokens for n in build.tables.nodes)
    positions = sum(len(s.tokens) for s in sources)
    return AddResult(
        len(sources), positions, new_tokens, written.file_bytes - before, written.file_bytes
    )


def appendable_codec(path: Path, lm: LoadedModel):
    """The codec of the existing archive `path`, which must be a trie archive of `lm` (same
    weights, dtype and tokenizer): checked before any model work, so a wrong file or model
    costs one line, not a capture."""
    with Archive(path, model=lm) as arc:
        if arc.trie is None:
            raise _flat(path)
        want = arc.model.get("fingerprint", "?")
        if not fingerprint_matches(want, lm.fingerprint):
            raise SeqkvError(
                f"{path} holds sessions of model {arc.model.get('name', '?')} "
                f"(fingerprint {want[:16]}); the model given has {lm.fingerprint[:16]} "
                "(same weights, dtype and tokenizer are needed)"
            )
        return arc.codec


def _flat(path) -> SeqkvError:
    return SeqkvError(
        f"{path} keeps sessions separately (flat layout); "
        "convert it with `seqkv archive compact` first"
    )


def _segment_coder(coder, load: str | None, reader, path):
    """The codec of the new segment: the archive's, or the one `load` asks for, which a file
    older than 1.7 cannot name (the seqkv that wrote it would read it as damaged)."""
    if load is None:
        return coder
    check_mode(load)
    if not capabilities(coder).needs_canonical:
        raise SeqkvError(
            f"{path} keeps K/V with the per-vector codec {coder.codec_id}: its load time is "
            "one pass over the blocks; load= applies to seq and seq-fast archives"
        )
    wanted = mode_codec(coder, load)
    if wanted is not coder and reader.version < (1, SEGMENT_CODECS_MINOR):
        major, minor = reader.version
        raise SeqkvError(
            f"{path} is format {major}.{minor}, whose sessions all load one way "
            f"({load_mode(coder)}); `seqkv archive compact` rewrites it as format "
            f"1.{SEGMENT_CODECS_MINOR}, which keeps a load mode per session"
        )
    return wanted


def _expand_compact(appender, model, path):
    """Rewrite a compact file (one session, or a compact archive) as the full trie archive
    it stands for (same token bytes, nothing decoded), so it can take a segment; the model,
    loaded and checked against the file's fingerprint, is returned for the append that
    follows."""
    lm = model if isinstance(model, LoadedModel) else load_model(model)
    want = appender.reader.compact.fingerprint
    if not fingerprint_matches(want, lm.fingerprint):
        raise SeqkvError(
            f"{path} was compressed with fingerprint {want}; the loaded model has "
            f"{lm.fingerprint[:16]}; pass --model with the right one"
        )
    ident = model_identity(lm)
    reader = appender.reader
    what = "compact archive" if reader.archive else "compact single-session file"
    header = archive_header(reader.compact.pipeline_config(), ident, {"expanded_from": what})
    index, payload = expanded(reader, str(path))  # a new 1.6 file
    appender.rewrite(header, index_sections(1, index, payload))
    return lm


def _check_new(sources: list[Source], contents, header: dict, path) -> None:
    have = {s.id for s in contents.sessions}
    seen: set[str] = set()
    want = (header.get("model") or {}).get("fingerprint")
    for src in sources:
        if src.session_id in have or src.session_id in seen:
            raise SeqkvError(f"{path} already has a session '{src.session_id}'; ids must be unique")
        seen.add(src.session_id)
        got = src.meta.get("model_fingerprint")
        if want and got != want:
            raise SeqkvError(
                f"{src.where} comes from a different model ({str(got)[:12]} vs {want[:12]}); "
                "an archive holds sessions of one model"
            )


def _model_side(coder, contents, reader, model, header, path):
    """The canonical model (checked against the archive's) and a reader of node tokens."""
    if not capabilities(coder).needs_canonical:
        return None, NodeSource(contents, PartReader(reader, contents.embedded), 1 << 32, 24)

    canon, ident = load_canonical(model, coder.numerics)
    want = (header.get("model") or {}).get("fingerprint")
    if ident["fingerprint"] != want:
        raise SeqkvError(
            f"{path} was compressed with fingerprint {str(want)[:16]}; the loaded model has "
            f"{ident['fingerprint'][:16]}; pass --model with the right one"
        )
    check_context(contents, canon.max_context, path)
    parts = PartReader(reader, contents.embedded)
    source = NodeSource(contents, parts, canon.vocab_size, coder.precision_bits)
    return canon, source
