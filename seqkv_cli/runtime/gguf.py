"""GGUF files: what is read once from a file, cached, and the file loaded at its own width.

Parsing a GGUF file's metadata takes seconds (gguf-py reads a 150k-token vocabulary string by
string), and transformers' conversion of its config and tokenizer more. So the first load of
a file writes a small **metadata folder** into the cache, keyed by the file's content hash:
the transformers config, the tokenizer, and the table of tensors (name, type, offset); later
loads read that folder and the weights straight from the file (`checkpoint.gguf_file`),
never a converted copy of them. This module imports no other runtime module but `paths` and
`checkpoint`; `loading` and `embedded` import it, never the reverse.

The file is untrusted: before gguf-py or transformers touch it, `checkpoint.gguf_check`
reads and checks its header (counts, lengths, the tensor table, the model's metadata) on
every load. The cache is not trusted either: its marker records digests of the folder's own
files and of itself, and the tensor table in it must equal the one just read from the file;
a folder that does not match is rebuilt (docs/MODELS.md, "GGUF files").
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from pathlib import Path

from filelock import FileLock

from seqkv_cli.errors import SeqkvError
from seqkv_cli.fsutil import publish_directory
from seqkv_cli.runtime.checkpoint.gguf_check import (
    Layout,
    check_finite,
    content_sha256,
    read_layout,
)
from seqkv_cli.runtime.paths import cache_root

META_MARKER = "seqkv-gguf.json"  # written last: a folder without it is unfinished
# 1 was a whole fp32 conversion (seqkv <= 0.5), 2 a marker without digests: neither is read
META_VERSION = 3
CONVERTED_MARKER = "seqkv-converted.json"  # an fp32 transformers folder (`fp32_folder`)


def one_line(exc: BaseException) -> str:
    """The first line of an exception's message (at most 300 characters), for a one-line error."""
    text = str(exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:300]


def metadata_folder(path: Path, *, progress=None) -> Path:
    """The cached metadata folder of a GGUF file (config, tokenizer, tensor table), made on
    first use; keyed by the file's content hash, so a changed file is read again."""
    return _checked_folder(path, progress)[0]


def _checked_folder(path: Path, progress) -> tuple[Path, Layout, bool]:
    """The metadata folder of ``path``, verified against the file, the file's layout, and
    whether this call wrote the folder."""
    layout = read_layout(path)
    digest = content_sha256(path, layout)
    # The name comes from the hash alone, never from a string in the file.
    target = cache_root() / "models" / f"gguf-{digest[:16]}-v{META_VERSION}"
    written = False
    if _verified(target, layout, digest) is None:
        target.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(str(target) + ".lock"):
            if _verified(target, layout, digest) is None:
                if progress:
                    progress(f"reading {path.name}'s metadata (once)")
                _write_metadata(path, layout, digest, target)
                written = True
    return target, layout, written


def _write_metadata(gguf: Path, layout: Layout, digest: str, target: Path) -> None:
    """Config, tokenizer and tensor table of `gguf` into `target`, atomically (a staging
    folder renamed into place, so a run that fails leaves only what was there before; a
    folder there that failed verification is replaced)."""
    from seqkv_cli.fsutil import run_tag

    # Once per file (the folder is keyed by the bytes checked): later loads do not pay it.
    check_finite(gguf, layout)
    try:
        config, tokenizer, mapping = _read_metadata(gguf, layout)
    except SeqkvError:
        raise
    except Exception as exc:  # the gguf reader raises many types on damaged files
        raise SeqkvError(f"could not read GGUF file {gguf}: {one_line(exc)}") from exc
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.{run_tag()}."))
    try:
        config.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        marker = {
            "source": gguf.name,
            "version": META_VERSION,
            "content_sha256": digest,
            "architecture": layout.architecture,
            "mapping": mapping,
            "tensors": layout.table(),
            "files": _file_digests(staging),
        }
        marker["marker_sha256"] = _marker_digest(marker)
        (staging / META_MARKER).write_text(json.dumps(marker))
        publish_directory(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _file_digests(folder: Path) -> dict[str, str]:
    """SHA-256 of each file of a metadata folder but the marker (config, tokenizer files)."""
    digests = {}
    for f in sorted(folder.iterdir()):
        if f.name == META_MARKER:
            continue
        if not f.is_file() or f.is_symlink():
            digests[f.name] = "not a plain file"
            continue
        with open(f, "rb") as fh:
            digests[f.name] = hashlib.file_digest(fh, "sha256").hexdigest()
    return digests


def _marker_digest(marker: dict) -> str:
    body = {k: v for k, v in marker.items() if k != "marker_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def _verified(folder: Path, layout: Layout, digest: str) -> dict | None:
    """The marker of ``folder`` if the folder is the one this file makes: its version, the
    file's content hash, the tensor table just read from the file, its own digest, and its
    files exactly those it lists with the bytes it recorded; None otherwise (rebuild it)."""
    try:
        marker = json.loads((folder / META_MARKER).read_text())
        ok = (
            isinstance(marker, dict)
            and marker.get("version") == META_VERSION
            and marker.get("content_sha256") == digest
            and marker.get("marker_sha256") == _marker_digest(marker)
            and marker.get("architecture") == layout.architecture
            and marker.get("tensors") == layout.table()
            and isinstance(marker.get("mapping"), dict)
            and all(isinstance(v, str) for v in marker["mapping"].values())
            and marker.get("files") == _file_digests(folder)
        )
    except (OSError, ValueError, TypeError, AttributeError):
        return None
    return marker if ok else None


def _read_metadata(gguf: Path, layout: Layout):
    """(config, tokenizer, name mapping) of a GGUF file whose layout has been checked."""
    from transformers import AutoConfig, AutoTokenizer

    from seqkv_cli.runtime.checkpoint.gguf_file import empty_model, name_mapping, processor_of

    tokenizer = AutoTokenizer.from_pretrained(
        gguf.parent, gguf_file=gguf.name, trust_remote_code=False
    )
    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name, trust_remote_code=False)
    model = empty_model(config)
    # What a transformers folder of this model records (save_pretrained of the model): the
    # config is part of the model's fingerprint.
    config.architectures = [type(model).__name__]
    mapping = name_mapping(model, processor_of(config, layout.architecture))
    return config, tokenizer, mapping


def tensor_table(folder: Path) -> tuple[list[dict], str, dict[str, str]]:
    """The tensor table, GGUF architecture name and name mapping a metadata folder recorded."""
    try:
        marker = json.loads((folder / META_MARKER).read_text())
        if marker.get("version") != META_VERSION:
            raise ValueError("another version")
        return list(marker["tensors"]), str(marker["architecture"]), dict(marker["mapping"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise SeqkvError(f"damaged GGUF metadata cache {folder}: {one_line(exc)}") from None


def load_gguf(path: Path, *, progress=None):
    """(model, tokenizer, store, metadata folder) of a GGUF file: the model holds its weights
    as the file's blocks in the store (`checkpoint.gguf_file`)."""
    from transformers import AutoConfig, AutoTokenizer

    from seqkv_cli.runtime.checkpoint.gguf_file import load_gguf_weights

    folder, layout, written = _checked_folder(path, progress)
    try:
        config = AutoConfig.from_pretrained(folder, trust_remote_code=False)
        tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=False)
        _, architecture, mapping = tensor_table(folder)
        # The table read from the file just now (the folder's copy was checked equal to it).
        model, store = load_gguf_weights(path, config, layout.table(), architecture, mapping)
    except Exception as exc:
        if written:  # a file whose tensors do not fit its own metadata leaves no cache entry
            shutil.rmtree(folder, ignore_errors=True)
        if isinstance(exc, SeqkvError) and str(path) in str(exc):
            raise
        code = exc.exit_code if isinstance(exc, SeqkvError) else None
        raise SeqkvError(f"could not load GGUF file {path}: {one_line(exc)}", code) from exc
    return model, tokenizer, store, folder


def fp32_folder(gguf: Path, target: Path, *, progress=None) -> Path:
    """A plain transformers fp32 folder of a GGUF file at `target` (for users who want one:
    `seqkv_cli.embedded_model_folder()`); seqkv itself never loads it. Converters of one
    target take turns under a lock; the folder is published whole or not at all."""
    from seqkv_cli.fsutil import run_tag

    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".convert.lock"):
        if (target / CONVERTED_MARKER).exists():
            return target  # another run converted it while this one waited
        if progress:
            progress(f"writing {gguf.name} as an fp32 transformers folder (once)")
        model, tokenizer, store, _ = load_gguf(gguf, progress=progress)
        store.fp32_model(model)
        staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.{run_tag()}."))
        try:
            model.save_pretrained(staging)
            tokenizer.save_pretrained(staging)
            (staging / CONVERTED_MARKER).write_text(json.dumps({"source": gguf.name}) + "\n")
            publish_directory(staging, target)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    return target
