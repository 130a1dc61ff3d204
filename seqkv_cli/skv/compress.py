"""`compress`: captures → one `.skv` container, with a per-vector or a session codec."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

from seqkv_cli.clock import created_utc
from seqkv_cli.container.compact import CODECS as COMPACT_CODECS
from seqkv_cli.container.layout import kv_part, section_name, session_entry
from seqkv_cli.errors import SeqkvError
from seqkv_cli.kvcapture.blocks import to_block
from seqkv_cli.sequential.registry import capabilities, resolve_codec
from seqkv_cli.skv.identity import load_canonical, same_model, writer_version
from seqkv_cli.skv.result import CompressResult

LAYOUTS = ("auto", "trie", "flat", "compact")


def _with_default_numerics(codec: str | dict, paths=()) -> str | dict:
    """A config that names no numeric path is written on the portable path the captures were
    made on (so they stay canonical: no residual), else on the default. Only reading keeps the
    old meaning of a missing `numerics` (files from before it existed: legacy)."""
    from seqkv_cli.kvcapture.capture_file import load_capture_meta
    from seqkv_cli.runtime.numerics import DEFAULT, PORTABLE_PATHS
    from seqkv_cli.sequential.registry import session_codec_class

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
    paths: list[Path],
    out: Path,
    *,
    codec: str | dict = "lossless",
    check: bool = True,
    model=None,
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
    for bit, so a file that would not restore is never reported as written.
    """
    from seqkv_cli.container import ContainerWriter
    from seqkv_cli.kvcapture.capture_file import load_capture

    if not paths:
        raise SeqkvError("no captures to compress")
    from seqkv_cli.fsutil import check_output_file, refuse_output_in_inputs

    check_output_file(Path(out))  # the library path too
    refuse_output_in_inputs(Path(out), [Path(p) for p in paths])
    if layout not in LAYOUTS:
        raise SeqkvError(f"unknown layout {layout!r}; use one of {', '.join(LAYOUTS)}")
    coder = resolve_codec(_with_default_numerics(codec, paths))
    caps = capabilities(coder)
    if layout == "compact" and (coder.codec_id not in COMPACT_CODECS or len(paths) != 1):
        what = f"{len(paths)} sessions" if len(paths) != 1 else f"codec {coder.codec_id}"
        raise SeqkvError(f"--layout compact holds one seq or seq-fast session, not {what}")
    if layout in ("trie", "compact") and not caps.trie_capable:
        what = "--parallel runs" if getattr(coder, "parallel", 1) > 1 else coder.codec_id
        raise SeqkvError(f"{what} code each session on its own: use --layout flat (or auto)")
    if layout != "flat" and caps.trie_capable:
        from seqkv_cli.skv.compress_trie import compress_sources
        from seqkv_cli.trie import Source

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
    from seqkv_cli.kvcapture.capture_file import tokens_as_u4

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


def _write_sequential(writer, index, cap, coder, canon, check, result):
    enc = coder.encode(cap, canon)
    names: list[str] = []
    for part, data in enc.parts.items():
        group = "tokens" if part == "tokens.seq" else part.split(".", 1)[0]
        _add_section(writer, result, names, index, part, data, group)
    result.input_kv_bytes += cap.kv_bytes()
    if check:
        from seqkv_cli.skv.verify import check_restored

        entry = {"id": cap.session_id, "positions": cap.positions, "dtype": cap.meta["dtype"]}
        restored = coder.decode(entry, enc.parts.get, canon)
        check_restored(cap, restored, coder, "nothing written")
    extra = {
        "token_bits_ideal": round(enc.token_bits_ideal, 3),
        "residual_bytes": enc.residual_bytes,
        "notes": enc.notes,
    }
    return names, extra


def same_capture(a, b) -> bool:
    """Tokens, surprisal and every K/V tensor equal bit for bit (see skv/verify.py)."""
    from seqkv_cli.skv.verify import same_capture as same

    return same(a, b)


def _check_block(coder, encoded: bytes, block, where: str) -> None:
    decoded = coder.decode(encoded)
    if decoded.shape != block.shape or decoded.dtype != block.dtype:
        raise SeqkvError(f"codec {coder.codec_id} changed the shape of {where}; not written")
    if coder.lossless and decoded != block:
        raise SeqkvError(f"codec {coder.codec_id} did not round-trip {where}; not written")
