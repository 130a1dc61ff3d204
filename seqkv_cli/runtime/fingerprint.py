"""Model and tokenizer fingerprints: what a capture or container must be decoded with.

Fingerprints hash what the model *computes with* (config values, weight tensors as loaded,
tokenizer), not the files, so the same weights loaded from a GGUF file or from the converted
folder give the same fingerprint. Hashing 135M fp32 weights takes ~1 s, so results are cached
per model folder, keyed by every file the load reads (`folder_cache_key`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from pathlib import Path

# Keys that change with library versions or load options, not with what the model computes.
_VOLATILE_CONFIG_KEYS = {
    "transformers_version",
    "_name_or_path",
    "torch_dtype",
    "dtype",
    "use_cache",
    "quantization_config",
    "output_attentions",
    "output_hidden_states",
    "return_dict",
}


def config_digest(config) -> str:
    data = {k: v for k, v in config.to_dict().items() if k not in _VOLATILE_CONFIG_KEYS}
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()


def tokenizer_fingerprint(tokenizer) -> str:
    h = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        spec = json.loads(backend.to_str())
        h.update(json.dumps(spec.get("model", {}), sort_keys=True).encode())
        h.update(json.dumps(spec.get("added_tokens", []), sort_keys=True).encode())
    else:  # slow tokenizers: the vocabulary is what decides token ids
        h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    template = tokenizer.chat_template or ""
    if isinstance(template, dict):  # named templates: all of them, in a fixed order
        template = json.dumps(template, sort_keys=True)
    h.update(str(template).encode())
    return h.hexdigest()


def weights_digest(model, store=None) -> str:
    """SHA-256 over every tensor of the state dict as fp32 bytes, by sorted name. A weight
    held in ``store`` (a `checkpoint.WeightStore`) is hashed as its fp32 values, a bounded
    chunk at a time: the digest of the same model loaded in fp32."""
    import torch

    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict(keep_vars=True).items()):
        if store is not None and store.update_digest(h, name, tensor):
            continue
        t = tensor.detach().to("cpu").contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}\n".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def model_fingerprint(model, tok_fp: str, store=None) -> str:
    h = hashlib.sha256()
    for part in (config_digest(model.config), weights_digest(model, store), tok_fp):
        h.update(part.encode())
    return h.hexdigest()


# Files up to this size are hashed whole into a folder's cache key (config, tokenizer, chat
# templates: milliseconds); larger ones (weights) by their stat and, for safetensors, header.
_HASHED_WHOLE = 64 << 20


def folder_cache_key(folder: Path) -> str:
    """Identity of the files a load of ``folder`` reads, cheap to compute: the folder's own
    files, the shards its safetensors index names (subfolders included) and its extra chat
    templates, each by name, size, mtime, ctime and inode (a rewrite or an edit shows in
    ctime even where the mtime is set back), small files by their content too, and a
    safetensors file by its header (names, shapes, dtypes, offsets)."""
    folder = Path(folder)
    files = {f.name: f for f in folder.iterdir() if f.is_file()}
    extra = folder / "additional_chat_templates"
    if extra.is_dir():
        files.update({f"{extra.name}/{f.name}": f for f in extra.iterdir() if f.is_file()})
    if (folder / "model.safetensors.index.json").is_file():
        from seqkv_cli.errors import SeqkvError
        from seqkv_cli.runtime.checkpoint.folder_check import weight_files

        # not loadable (SeqkvError): nothing is cached for it, the load refuses it first
        with contextlib.suppress(SeqkvError):
            files.update({f.relative_to(folder).as_posix(): f for f in weight_files(folder)})
    h = hashlib.sha256(str(folder.resolve()).encode())
    for name in sorted(files):
        st = files[name].stat()
        stat = (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev)
        h.update(f"|{name}:{':'.join(map(str, stat))}:".encode())
        h.update(_content_digest(files[name], st.st_size))
    return h.hexdigest()


def _content_digest(path: Path, size: int) -> bytes:
    with open(path, "rb") as f:
        if size <= _HASHED_WHOLE:
            return hashlib.sha256(f.read(_HASHED_WHOLE)).digest()
        if path.suffix != ".safetensors":
            return b""
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else 0
        return hashlib.sha256(head + f.read(min(n, 100 << 20))).digest()
