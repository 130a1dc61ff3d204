"""Resolve `--model` (nothing, a folder, a .gguf file or a hub id) into a loaded model."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import socket
import sys
from dataclasses import dataclass, field
from pathlib import Path

from seqkv_cli.errors import SeqkvError
from seqkv_cli.fsutil import atomic_path
from seqkv_cli.runtime import fingerprint as fp
from seqkv_cli.runtime.gguf import one_line
from seqkv_cli.runtime.model_config import ModelShape, ShapeAttributes
from seqkv_cli.runtime.paths import cache_root

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclass
class LoadedModel(ShapeAttributes):
    """A causal LM in eval mode plus what identifies it.

    A model seqkv loaded itself holds its linear and embedding weights in ``weights`` (a
    `checkpoint.WeightStore`, at the checkpoint's width) and meta tensors in their place;
    everything else in the module is fp32. The portable forward reads the store; the
    ordinary transformers paths take `fp32_model()`."""

    module: object  # the transformers model; meta tensors where `weights` holds the weights
    tokenizer: object
    name: str
    source: str
    kind: str  # "embedded" | "folder" | "gguf" | "hub" | "instance"
    fingerprint: str
    tokenizer_fingerprint: str
    folder: Path | None = None
    extra: dict = field(default_factory=dict)
    weights: object = None  # checkpoint.WeightStore | None (a user's model object: None)

    def fp32_model(self):
        """The model with fp32 weights in its modules, as transformers loads it in float32
        (made from the stored weights on the first call: 4 bytes a weight from then on)."""
        if self.weights is not None and self.weights.emptied:
            from seqkv_cli.runtime.devices import model_device

            self.weights.fp32_model(self.module, model_device(self.module))
        return self.module

    @property
    def model(self):
        """`fp32_model()`: what the ordinary transformers paths (and a user) run. seqkv's
        own canonical forward reads `module` and `weights` instead, and never makes it."""
        return self.fp32_model()

    @property
    def config(self):
        return self.module.config

    @property
    def shape(self) -> ModelShape:
        return ModelShape.of(self.config)  # read each time: the config is the model's own

    def describe(self) -> dict:
        return {
            "name": self.name,
            "source": self.source,
            "kind": self.kind,
            "fingerprint": self.fingerprint,
            "tokenizer_fingerprint": self.tokenizer_fingerprint,
            "architecture": type(self.module).__name__,
            "layers": self.num_layers,
            "kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "vocab": self.vocab_size,
            "context": self.max_context,
        }


def load_model(spec: str | None = None, *, progress=None) -> LoadedModel:
    """Load the embedded default (spec None), a local folder, a .gguf file or a hub id, on
    the device the command selected (`runtime.devices`; the CPU unless a command said)."""
    from seqkv_cli.runtime.devices import place

    lm = _load(spec, progress)
    place(lm.module)  # after fingerprinting: the weights were hashed on the CPU (stored
    return lm  # weights stay there: the portable forward moves what it multiplies)


def _load(spec: str | None, progress) -> LoadedModel:
    if not spec:
        from seqkv_cli.runtime.embedded import EMBEDDED_NAME, embedded_gguf

        path = embedded_gguf(progress=progress)
        return _from_gguf_file(
            path, progress, name=EMBEDDED_NAME, kind="embedded", source="embedded"
        )
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise SeqkvError(f"not a model folder: {spec} (no config.json inside)")
        return _from_folder(path, name=path.resolve().name, kind="folder", source=str(path))
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise SeqkvError(f"not a model: {spec} (expected a model folder or a .gguf file)")
        return _from_gguf_file(path, progress, name=path.stem, kind="gguf", source=str(path))
    if _HUB_ID.match(spec) and not spec.endswith(".gguf"):
        return _from_hub(spec)
    raise SeqkvError(f"no such model file or folder: {spec}")


def resolve_model(model=None, *, tokenizer=None, progress=None) -> LoadedModel:
    """A LoadedModel from what a library user has: None (the embedded default), a folder or
    .gguf path, a hub id, a LoadedModel, or a transformers model object already in memory."""
    if isinstance(model, LoadedModel):
        return model
    if model is None or isinstance(model, str | Path):
        return load_model(None if model is None else str(model), progress=progress)
    if not hasattr(model, "config") or not hasattr(model, "state_dict"):
        raise SeqkvError(
            f"model must be a transformers model, a folder, a .gguf file or None, "
            f"not {type(model).__name__}"
        )
    return from_instance(model, tokenizer)


_INSTANCES: list[tuple[object, LoadedModel]] = []  # the last few model objects seen
_INSTANCES_KEPT = 4


def from_instance(model, tokenizer=None) -> LoadedModel:
    """A user's transformers model as a LoadedModel (fingerprinted once per object).

    The canonical forward runs fp32 on the CPU. A model in another dtype or on another
    device gets an fp32 CPU copy built tensor by tensor (no second copy on its device); an
    fp32 CPU model is used as it is (put in eval mode: inference only). Its fingerprint is
    that of the fp32 weights (a bf16 model is a different model from its fp32 checkpoint,
    which it numerically is) with the config and the tokenizer (given, or found beside the
    weights), as for models loaded from a folder. Weights edited in place after the first
    call are not seen: pass a new object."""
    import torch

    for seen, lm in _INSTANCES:
        if seen is model:
            return lm
    params = list(model.parameters())
    if not params:
        raise SeqkvError(f"{type(model).__name__} has no parameters: not a language model")
    first = params[0]
    runner = model
    if first.dtype != torch.float32 or first.device.type != "cpu":
        runner = _fp32_cpu_copy(model)
    runner.eval()
    name_or_path = str(getattr(model.config, "_name_or_path", "") or type(model).__name__)
    if tokenizer is None:
        tokenizer = _tokenizer_beside(name_or_path)
    tok_fp = fp.tokenizer_fingerprint(tokenizer) if tokenizer is not None else "none"
    name = Path(name_or_path).name or name_or_path
    lm = LoadedModel(
        runner,
        tokenizer,
        name,
        name_or_path,
        "instance",
        fp.model_fingerprint(runner, tok_fp),
        tok_fp,
    )
    _INSTANCES.append((model, lm))
    del _INSTANCES[:-_INSTANCES_KEPT]
    return lm


def _fp32_cpu_copy(model):
    """The same architecture with the weights as fp32 CPU tensors, read one at a time."""
    import torch
    from transformers import AutoModelForCausalLM

    try:
        state = {k: v.detach().to("cpu", torch.float32) for k, v in model.state_dict().items()}
        with torch.device("cpu"):
            copy = AutoModelForCausalLM.from_config(
                model.config, dtype=torch.float32, trust_remote_code=False
            )
        copy.load_state_dict(state, strict=True)
    except (RuntimeError, ValueError, TypeError, KeyError) as exc:
        raise SeqkvError(
            f"cannot make an fp32 CPU copy of this {type(model).__name__} for the canonical "
            f"forward (quantized weights?): {one_line(exc)}"
        ) from None
    return copy.eval()


def _tokenizer_beside(name_or_path: str):
    """The tokenizer saved with a model folder, if there is one (never the network)."""
    folder = Path(name_or_path)
    if not folder.is_dir() or not any(
        (folder / f).exists() for f in ("tokenizer.json", "tokenizer_config.json")
    ):
        return None
    from transformers import AutoTokenizer

    try:
        with no_stdin():
            return AutoTokenizer.from_pretrained(
                folder, local_files_only=True, trust_remote_code=False
            )
    except Exception:
        return None


@contextlib.contextmanager
def no_stdin():
    """Loading reads no answer from the user: transformers asks on stdin whether to run a
    model's own code where trust_remote_code is left unset (and a piped "yes" answers it).
    Every load passes trust_remote_code=False; an input() that still comes finds an empty
    stdin (EOFError, refused as a failed load), never the command's piped data."""
    saved = sys.stdin
    sys.stdin = io.StringIO("")
    try:
        yield
    finally:
        sys.stdin = saved


def _from_gguf_file(path: Path, progress, *, name: str, kind: str, source: str) -> LoadedModel:
    # Its metadata (config, tokenizer, tensor table) is read once into the cache, keyed by
    # the file's content hash; the weights are read from the file at its own width.
    from seqkv_cli.runtime.gguf import load_gguf

    with no_stdin():
        model, tok, store, folder = load_gguf(path, progress=progress)
    model_fp, tok_fp = _cached_fingerprints(folder, model, tok, store)
    return LoadedModel(model, tok, name, source, kind, model_fp, tok_fp, folder, weights=store)


def _from_folder(folder: Path, *, name: str, kind: str, source: str) -> LoadedModel:
    from transformers import AutoTokenizer

    from seqkv_cli.runtime.checkpoint.folder import load_folder

    try:
        with no_stdin():
            # the weights first: load_folder checks the folder (no code of its own, in
            # tokenizer_config.json either) before transformers reads anything of it
            # files fingerprinted before are the files checked before: their weights were
            # scanned for NaN then (the scan reads every weight once, as the hash does)
            seen = _read_cached(_cache_file(folder)) is not None
            model, store = load_folder(folder, check_finite=not seen)
            tok = AutoTokenizer.from_pretrained(
                folder, local_files_only=True, trust_remote_code=False
            )
    except SeqkvError:
        raise
    except Exception as exc:
        raise SeqkvError(f"could not load model from {folder}: {one_line(exc)}") from exc
    model_fp, tok_fp = _cached_fingerprints(folder, model, tok, store)
    return LoadedModel(model, tok, name, source, kind, model_fp, tok_fp, folder, weights=store)


def _from_hub(repo_id: str) -> LoadedModel:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from seqkv_cli.runtime.checkpoint.folder import refuse_unfilled

    def load(local_only: bool):
        with no_stdin():
            tok = AutoTokenizer.from_pretrained(
                repo_id, local_files_only=local_only, trust_remote_code=False
            )
            model, info = AutoModelForCausalLM.from_pretrained(
                repo_id,
                dtype="float32",
                local_files_only=local_only,
                trust_remote_code=False,
                output_loading_info=True,
            )
        refuse_unfilled(repo_id, info)  # a weight filled at random is not the model
        return model.eval(), tok

    try:
        model, tok = load(True)
    except SeqkvError:
        raise
    except Exception:
        if os.environ.get("HF_HUB_OFFLINE") or not _hub_reachable():
            raise SeqkvError(
                f"cannot fetch '{repo_id}': the Hugging Face hub is not reachable from here "
                "and the model is not in the local HF cache; pass a local folder or .gguf file"
            ) from None
        try:
            model, tok = load(False)
        except SeqkvError:
            raise
        except Exception as exc:
            raise SeqkvError(f"could not load '{repo_id}' from the hub: {one_line(exc)}") from exc
    tok_fp = fp.tokenizer_fingerprint(tok)
    return LoadedModel(
        model, tok, repo_id, repo_id, "hub", fp.model_fingerprint(model, tok_fp), tok_fp
    )


def _cache_file(folder: Path) -> Path:
    # The entry's name is a hash of the folder's files, never a string from them.
    return cache_root() / "fingerprints" / (fp.folder_cache_key(folder) + ".json")


def _cached_fingerprints(folder: Path, model, tok, store=None) -> tuple[str, str]:
    cache = _cache_file(folder)
    cached = _read_cached(cache)
    if cached is not None:
        return cached
    tok_fp = fp.tokenizer_fingerprint(tok)
    model_fp = fp.model_fingerprint(model, tok_fp, store)
    cache.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(cache) as tmp:
        tmp.write_text(json.dumps({"model": model_fp, "tokenizer": tok_fp}))
    return model_fp, tok_fp


_HEX64 = re.compile(r"^[0-9a-f]{64}$")


def _read_cached(cache: Path) -> tuple[str, str] | None:
    """A cache entry's two fingerprints, or None where it is absent or damaged (not JSON,
    other types, not 64 hex digits): then they are computed again, never trusted."""
    try:
        data = json.loads(cache.read_bytes()[:4096])
    except (OSError, ValueError, RecursionError):
        return None
    if not isinstance(data, dict):
        return None
    model_fp, tok_fp = data.get("model"), data.get("tokenizer")
    if all(isinstance(v, str) and _HEX64.match(v) for v in (model_fp, tok_fp)):
        return model_fp, tok_fp
    return None


def _hub_reachable(host: str = "huggingface.co") -> bool:
    try:
        socket.getaddrinfo(host, 443)
        return True
    except OSError:
        return False
