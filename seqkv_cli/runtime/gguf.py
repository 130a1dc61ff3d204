"""GGUF files: reading one with transformers, and converting it once into a cached folder.

Loading a GGUF dequantizes every tensor (~18 s for 135M), so a GGUF is converted once into a
plain safetensors model folder (~1 s to load), keyed by the file's content hash. The embedded
model (`runtime.embedded`) is converted the same way. This module imports no other runtime
module but `paths`; `loading` and `embedded` import it, never the reverse.
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
from pathlib import Path

from filelock import FileLock

from seqkv_cli.errors import SeqkvError
from seqkv_cli.fsutil import publish_directory
from seqkv_cli.runtime.paths import cache_root

CONVERTED_MARKER = "seqkv-converted.json"


def one_line(exc: BaseException) -> str:
    """The first line of an exception's message (at most 300 characters), for a one-line error."""
    text = str(exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:300]


def check_gguf_magic(path: Path) -> None:
    """Refuse a file that does not start with the GGUF magic bytes."""
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise SeqkvError(f"not a GGUF file: {path} (bad magic bytes)")


def load_gguf(path: Path):
    """Load and dequantize a GGUF file with transformers (slow: ~18 s for 135M)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    check_gguf_magic(path)
    try:
        tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype="float32"
        )
    except SeqkvError:
        raise
    except Exception as exc:  # the gguf reader raises many types on damaged files
        raise SeqkvError(f"could not read GGUF file {path}: {one_line(exc)}") from exc
    return model.eval(), tok


def converted_gguf_folder(path: Path, *, progress=None) -> Path:
    """The cached safetensors folder of a GGUF file, converting it on first use.

    The folder is keyed by the file's content hash, so a changed file converts again."""
    check_gguf_magic(path)
    digest = file_sha256(path)[:16]
    target = cache_root() / "models" / f"gguf-{digest}"
    if not (target / CONVERTED_MARKER).exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        convert_gguf(path, target, progress=progress)
    return target


def convert_gguf(gguf: Path, target: Path, *, progress=None) -> Path:
    """Dequantize a GGUF file into a safetensors model folder at `target` (atomically).

    Converters of one target take turns under a lock; the folder is written under a name
    unique to this run and renamed into place, so a converted copy (one with its marker) is
    never deleted, and a run that fails leaves only what was there before."""
    from seqkv_cli.fsutil import run_tag

    target.parent.mkdir(parents=True, exist_ok=True)
    # Not target + ".lock": embedded_model_path holds that one around this call.
    with FileLock(str(target) + ".convert.lock"):
        if (target / CONVERTED_MARKER).exists():
            return target  # another run converted it while this one waited
        if progress:
            progress(f"converting {gguf.name} to safetensors (once)")
        model, tokenizer = load_gguf(gguf)
        staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.{run_tag()}."))
        try:
            save_clean(model, tokenizer, staging)
            (staging / CONVERTED_MARKER).write_text(f'{{"source": "{gguf.name}"}}\n')
            publish_directory(staging, target)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    return target


def save_clean(model, tokenizer, folder: Path) -> None:
    """Save a GGUF-loaded model as a plain (unquantized) transformers folder.

    transformers refuses `save_pretrained` on a model that still carries its GGUF quantizer, so
    the weights are moved into a fresh model built from the config without it.
    """
    from transformers import AutoModelForCausalLM

    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    clean = AutoModelForCausalLM.from_config(config)
    clean.load_state_dict(model.state_dict())
    clean.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def file_sha256(path: Path) -> str:
    """SHA-256 of a file's bytes, read in 4 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()
