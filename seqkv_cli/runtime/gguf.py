"""GGUF files: what is read once from a file, cached, and the file loaded at its own width.

Parsing a GGUF file's metadata takes seconds (gguf-py reads a 150k-token vocabulary string by
string), and transformers' conversion of its config and tokenizer more. So the first load of
a file writes a small **metadata folder** into the cache, keyed by the file's content hash:
the transformers config, the tokenizer, and the table of tensors (name, type, offset); later
loads read that folder and the weights straight from the file (`checkpoint.gguf_file`),
never a converted copy of them. This module imports no other runtime module but `paths` and
`checkpoint`; `loading` and `embedded` import it, never the reverse.
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
from seqkv_cli.runtime.paths import cache_root

META_MARKER = "seqkv-gguf.json"  # written last: a folder without it is unfinished
META_VERSION = 2  # 1 was a whole fp32 conversion (seqkv <= 0.5), no longer read
CONVERTED_MARKER = "seqkv-converted.json"  # an fp32 transformers folder (`fp32_folder`)


def one_line(exc: BaseException) -> str:
    """The first line of an exception's message (at most 300 characters), for a one-line error."""
    text = str(exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:300]


def check_gguf_magic(path: Path) -> None:
    """Refuse a file that does not start with the GGUF magic bytes."""
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise SeqkvError(f"not a GGUF file: {path} (bad magic bytes)")


def metadata_folder(path: Path, *, progress=None) -> Path:
    """The cached metadata folder of a GGUF file (config, tokenizer, tensor table), made on
    first use; keyed by the file's content hash, so a changed file is read again."""
    check_gguf_magic(path)
    target = cache_root() / "models" / f"gguf-{file_sha256(path)[:16]}-v{META_VERSION}"
    if not (target / META_MARKER).exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(str(target) + ".lock"):
            if not (target / META_MARKER).exists():
                if progress:
                    progress(f"reading {path.name}'s metadata (once)")
                _write_metadata(path, target)
    return target


def _write_metadata(gguf: Path, target: Path) -> None:
    """Config, tokenizer and tensor table of `gguf` into `target`, atomically (a staging
    folder renamed into place, so a run that fails leaves only what was there before)."""
    from seqkv_cli.fsutil import run_tag

    try:
        config, tokenizer, table, architecture, mapping = _read_metadata(gguf)
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
            "architecture": architecture,
            "mapping": mapping,
            "tensors": table,
        }
        (staging / META_MARKER).write_text(json.dumps(marker))
        publish_directory(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _read_metadata(gguf: Path):
    from gguf import GGUFReader
    from transformers import AutoConfig, AutoTokenizer

    from seqkv_cli.runtime.checkpoint.gguf_file import empty_model, name_mapping, processor_of

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = empty_model(config)
    # What a transformers folder of this model records (save_pretrained of the model): the
    # config is part of the model's fingerprint.
    config.architectures = [type(model).__name__]
    reader = GGUFReader(gguf)
    field = reader.fields["general.architecture"]
    architecture = bytes(field.parts[field.data[0]]).decode("utf-8")
    mapping = name_mapping(model, processor_of(config, architecture))
    table = [
        {
            "name": t.name,
            "type": int(t.tensor_type),
            "shape": [int(n) for n in t.data.shape],
            "offset": int(t.data_offset),
            "nbytes": int(t.n_bytes),
        }
        for t in reader.tensors
    ]
    return config, tokenizer, table, architecture, mapping


def tensor_table(folder: Path) -> tuple[list[dict], str, dict[str, str]]:
    """The tensor table, GGUF architecture name and name mapping a metadata folder recorded."""
    try:
        marker = json.loads((folder / META_MARKER).read_text())
        if marker.get("version") != META_VERSION:
            raise ValueError("another version")
        return list(marker["tensors"]), str(marker["architecture"]), dict(marker["mapping"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise SeqkvError(f"damaged GGUF metadata cache {folder}: {one_line(exc)}") from None


def load_gguf(path: Path, *, progress=None):
    """(model, tokenizer, store, metadata folder) of a GGUF file: the model holds its weights
    as the file's blocks in the store (`checkpoint.gguf_file`)."""
    from transformers import AutoConfig, AutoTokenizer

    from seqkv_cli.runtime.checkpoint.gguf_file import load_gguf_weights

    folder = metadata_folder(path, progress=progress)
    try:
        config = AutoConfig.from_pretrained(folder)
        tokenizer = AutoTokenizer.from_pretrained(folder)
        model, store = load_gguf_weights(path, config, *tensor_table(folder))
    except SeqkvError:
        raise
    except Exception as exc:
        raise SeqkvError(f"could not load GGUF file {path}: {one_line(exc)}") from exc
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


def file_sha256(path: Path) -> str:
    """SHA-256 of a file's bytes, read in 4 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()
