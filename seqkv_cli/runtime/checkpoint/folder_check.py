"""A model folder checked before transformers builds or fills anything from it.

A folder is untrusted input (users download them from strangers). transformers, given a
folder, runs the folder's own Python where its config asks (``auto_map``), fills any weight
the files lack with random values, builds whatever layer count the config names (10**5
layers: gigabytes, then a hang) and raises tracebacks on inconsistent numbers. So seqkv
reads the folder first, here, in one place:

1. ``config.json``: no ``auto_map`` (code of the folder's own), a ``model_type``
   transformers knows as a causal LM, and numbers within `LIMITS` (docs/MODELS.md), finite
   and consistent (heads divide, rope base and norm epsilon finite and positive).
2. the weight files: ``model.safetensors``, or the shards ``model.safetensors.index.json``
   names (relative paths inside the folder only), each header read with a bounded size and
   every tensor's dtype, shape and byte range checked against the file.
3. the headers against the config: the layers present are exactly the config's layer
   count, the embedding's rows are the vocabulary (pure: `check_tensors`), and every
   tensor the model expects is present with its shape, none left over (`check_names`: the
   module built on the meta device, no memory, names mapped as transformers maps them).

Each refusal is one `SeqkvError` line naming the file and the field or tensor.
"""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from seqkv_cli.errors import SeqkvError

# What seqkv loads from a folder at most (docs/MODELS.md, "Model folders"): far above every
# published causal LM, low enough that nothing is built from a number a file made up.
LIMITS = {
    "num_hidden_layers": 1024,
    "num_attention_heads": 1024,
    "num_key_value_heads": 1024,
    "hidden_size": 65536,
    "intermediate_size": 1 << 20,
    "head_dim": 4096,
    "vocab_size": 1 << 22,
    "max_position_embeddings": 1 << 24,
}
MAX_EXPERTS = 1024  # num_experts / num_local_experts
MAX_CONFIG_BYTES = 4 << 20  # config.json, tokenizer_config.json, the shard index
MAX_HEADER_BYTES = 100 << 20  # a safetensors header (the safetensors library's own limit)
MAX_TENSORS = 1 << 20  # tensors in one folder
MAX_DIMS = 8

# safetensors dtypes and their bytes an element; the float ones are what seqkv loads.
DTYPE_BYTES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
    "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1,
}  # fmt: skip
FLOAT_DTYPES = {"F64", "F32", "F16", "BF16"}

# Layer containers of the families seqkv runs: "model.layers.3.", "transformer.h.3.", ...
_LAYER = re.compile(r"(?:^|\.)(?:layers|h|blocks|layer)\.(\d+)\.")
# Input embeddings by the names the families give them.
_EMBEDDING = re.compile(
    r"(?:^|\.)(?:embed_tokens|wte|embed_in|word_embeddings|tok_embeddings)\.weight$"
)
# A multimodal model's other towers: their layers and embeddings are not the language
# model's (their names and shapes are still checked against the module, `check_names`).
_OTHER_TOWER = re.compile(r"vision|visual|audio|image|multi_modal|mm_projector|speech")
_EPSILONS = ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "norm_eps", "norm_epsilon")


@dataclass(frozen=True)
class TensorInfo:
    dtype: str
    shape: tuple[int, ...]
    file: Path


@dataclass(frozen=True)
class CheckedFolder:
    config: object  # the transformers config, built from the checked config.json
    files: tuple[Path, ...]  # the weight files the load reads
    tensors: dict  # name -> TensorInfo, over every file


# -- config -----------------------------------------------------------------------------------


def read_json(path: Path, limit: int = MAX_CONFIG_BYTES):
    """A JSON file read with a bounded size; refused in one line if it does not parse."""
    try:
        with open(path, "rb") as f:
            data = f.read(limit + 1)
    except OSError as exc:
        raise SeqkvError(f"{path}: cannot read ({exc.strerror or exc})") from None
    if len(data) > limit:
        raise SeqkvError(f"{path}: more than {limit >> 20} MiB; not a model's JSON file")
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise SeqkvError(f"{path}: not valid JSON ({str(exc).splitlines()[0][:120]})") from None


def refuse_code(raw, where: str) -> None:
    """Refuse a JSON object that asks transformers to import Python the folder ships."""
    if not isinstance(raw, dict):
        return
    for key, value in raw.items():
        if key == "auto_map":
            raise SeqkvError(
                f"{where}: auto_map names Python code shipped with the model; seqkv never runs "
                "a model's own code (a model transformers implements loads without it)"
            )
        if isinstance(value, dict):
            refuse_code(value, where)


def _causal_lm_types() -> set[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _finite_everywhere(value, where: str, path: str = "") -> None:
    """NaN and infinities are valid to Python's JSON reader, never a model's number."""
    if isinstance(value, float) and not math.isfinite(value):
        raise SeqkvError(f"{where}: {_q(path or 'value', 80)} is {value}; numbers must be finite")
    if isinstance(value, dict):
        for k, v in value.items():
            _finite_everywhere(v, where, f"{path}.{k}" if path else str(k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _finite_everywhere(v, where, f"{path}[{i}]")


def check_config(raw, where: str):
    """The transformers config of a config.json's object, or a one-line refusal."""
    if not isinstance(raw, dict):
        raise SeqkvError(f"{where}: not a JSON object")
    refuse_code(raw, where)
    model_type = raw.get("model_type")
    if not isinstance(model_type, str) or model_type not in _causal_lm_types():
        raise SeqkvError(
            f"{where}: model_type {_q(model_type, 60)} is not a causal language model "
            "transformers implements (seqkv never runs a model's own code)"
        )
    _finite_everywhere(raw, where)
    from transformers import AutoConfig

    values = {k: v for k, v in raw.items() if k != "model_type"}
    try:
        config = AutoConfig.for_model(model_type, **values)
    except Exception as exc:  # the config class's own validation: types, ranges
        raise SeqkvError(f"{where}: {_first_line(exc)}") from None
    check_numbers(config, where)
    return config


def _q(value, limit: int) -> str:
    """A value from a file, in a message: a printable name as it is, anything else as its
    repr (newlines and escapes stay visible), cut to ``limit`` characters."""
    text = value if isinstance(value, str) and value.isprintable() else repr(value)
    return text[:limit]


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:300]


def _int(cfg, name: str, where: str, required: bool, low: int = 1, high: int | None = None):
    value = getattr(cfg, name, None)
    if value is None and not required:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise SeqkvError(f"{where}: {name} is {_q(value, 40)}; must be a whole number")
    high = LIMITS.get(name) if high is None else high
    if value < low or (high is not None and value > high):
        bound = f"between {low} and {high:,}" if high is not None else f"at least {low}"
        raise SeqkvError(f"{where}: {name} is {value:,}; seqkv reads {bound}")
    return value


def _positive_float(cfg, name: str, where: str, high: float) -> None:
    value = getattr(cfg, name, None)
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise SeqkvError(f"{where}: {name} is {_q(value, 40)}; must be a number")
    if not (math.isfinite(value) and 0 < value <= high):
        raise SeqkvError(f"{where}: {name} is {value}; must be finite, positive, at most {high:g}")


def check_numbers(config, where: str) -> None:
    """The language model's numbers within `LIMITS`, whole, positive and consistent."""
    from seqkv_cli.runtime.model_config import text_config

    cfg = text_config(config)
    layers = _int(cfg, "num_hidden_layers", where, True)
    heads = _int(cfg, "num_attention_heads", where, True)
    hidden = _int(cfg, "hidden_size", where, True)
    _int(cfg, "vocab_size", where, True)
    _int(cfg, "intermediate_size", where, False)
    _int(cfg, "max_position_embeddings", where, False)
    kv = _int(cfg, "num_key_value_heads", where, False)
    head_dim = _int(cfg, "head_dim", where, False)
    if kv is not None and heads % kv:
        raise SeqkvError(
            f"{where}: num_key_value_heads {kv} does not divide num_attention_heads {heads}"
        )
    if head_dim is None and hidden % heads:
        raise SeqkvError(f"{where}: hidden_size {hidden} is not a multiple of the {heads} heads")
    for name in ("num_experts", "num_local_experts", "n_routed_experts"):
        _int(cfg, name, where, False, high=MAX_EXPERTS)
    experts = getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None)
    if isinstance(experts, int) and experts > 0:
        _int(cfg, "num_experts_per_tok", where, False, high=experts)
    window = getattr(cfg, "sliding_window", None)
    if window is not None and window is not False:
        _int(cfg, "sliding_window", where, False, high=1 << 24)
    for name in _EPSILONS:
        _positive_float(cfg, name, where, 1.0)
    _positive_float(cfg, "rope_theta", where, 1e12)
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None)
    if isinstance(rope, dict) and "rope_theta" in rope:
        theta = rope["rope_theta"]
        if isinstance(theta, bool) or not isinstance(theta, int | float):
            raise SeqkvError(f"{where}: rope_theta is {_q(theta, 40)}; must be a number")
        if not (math.isfinite(theta) and 0 < theta <= 1e12):
            raise SeqkvError(
                f"{where}: rope_theta is {theta}; must be finite, positive, at most 1e12"
            )
    factor = getattr(cfg, "partial_rotary_factor", None)
    if factor is not None and not (isinstance(factor, int | float) and 0 < factor <= 1):
        raise SeqkvError(f"{where}: partial_rotary_factor is {factor}; must be in (0, 1]")
    del layers


# -- safetensors headers ----------------------------------------------------------------------


def read_header(path: Path) -> dict[str, TensorInfo]:
    """A safetensors file's tensor table, every entry checked against the file's size."""
    try:
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            f.seek(0)
            head = f.read(8)
            if len(head) < 8:
                raise SeqkvError(f"{path}: not a safetensors file (shorter than its header)")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES or 8 + n > size:
                raise SeqkvError(
                    f"{path}: not a safetensors file (a header of {n:,} bytes in {size:,})"
                )
            data = f.read(n)
    except OSError as exc:
        raise SeqkvError(f"{path}: cannot read ({exc.strerror or exc})") from None
    try:
        table = json.loads(data)
    except (ValueError, RecursionError):
        raise SeqkvError(f"{path}: not a safetensors file (its header is not JSON)") from None
    return check_header(table, size - 8 - n, path)


def check_header(table, data_bytes: int, path: Path) -> dict[str, TensorInfo]:
    """The entries of a parsed header, each a known dtype, a shape of whole numbers and a
    byte range inside the data that holds exactly that many elements."""
    if not isinstance(table, dict):
        raise SeqkvError(f"{path}: not a safetensors file (its header is not an object)")
    out: dict[str, TensorInfo] = {}
    for name, entry in table.items():
        if name == "__metadata__":
            continue
        shown = _q(name, 80)
        if not isinstance(entry, dict):
            raise SeqkvError(f"{path}: tensor {shown} has no dtype/shape/offsets entry")
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if not isinstance(dtype, str) or dtype not in DTYPE_BYTES:
            raise SeqkvError(f"{path}: tensor {shown} has unknown dtype {_q(dtype, 20)}")
        if (
            not isinstance(shape, list)
            or len(shape) > MAX_DIMS
            or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
        ):
            raise SeqkvError(f"{path}: tensor {shown} has an invalid shape {_q(shape, 60)}")
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
            or not 0 <= offsets[0] <= offsets[1] <= data_bytes
        ):
            raise SeqkvError(f"{path}: tensor {shown} lies outside the file ({_q(offsets, 60)})")
        if offsets[1] - offsets[0] != math.prod(shape) * DTYPE_BYTES[dtype]:
            raise SeqkvError(
                f"{path}: tensor {shown} holds {offsets[1] - offsets[0]:,} bytes, its shape "
                f"{tuple(shape)} in {dtype} needs {math.prod(shape) * DTYPE_BYTES[dtype]:,}"
            )
        out[name] = TensorInfo(dtype, tuple(shape), path)
    return out


def weight_files(folder: Path) -> tuple[Path, ...]:
    """The safetensors files a load reads, as transformers picks them: model.safetensors, else
    the shards its index names. Shard names must be relative paths inside the folder (a
    "../" or absolute name would read any file on the machine); symlinked files are read
    where they point, as a hub cache's snapshot folders hold them."""
    single = folder / "model.safetensors"
    if single.is_file():
        return (single,)
    index = folder / "model.safetensors.index.json"
    if not index.is_file():
        raise SeqkvError(
            f"{folder}: no model.safetensors or model.safetensors.index.json; seqkv reads "
            "safetensors weights only (never pickled .bin files)"
        )
    data = read_json(index)
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise SeqkvError(f"{index}: weight_map is missing or not an object of names")
    files: dict[str, Path] = {}
    for tensor, name in weight_map.items():
        if not isinstance(name, str):
            raise SeqkvError(f"{index}: weight_map names {_q(name, 60)} for {_q(tensor, 80)}")
        files.setdefault(name, _inside(folder, name, index))
    return tuple(files[n] for n in sorted(files))


def _inside(folder: Path, name: str, index: Path) -> Path:
    parts = PurePosixPath(name).parts
    if (
        not name
        or name.startswith(("/", "\\"))
        or "\\" in name
        or ":" in name
        or any(p in ("..", ".") for p in parts)
        or not name.endswith(".safetensors")
    ):
        raise SeqkvError(
            f"{index}: weight_map names {_q(name, 80)}; shards must be .safetensors files inside "
            "the model folder"
        )
    path = folder.joinpath(*parts)
    if not path.is_file():
        raise SeqkvError(f"{index}: weight_map names {_q(name, 80)}, which is not in the folder")
    return path


def read_tensors(files: tuple[Path, ...]) -> dict[str, TensorInfo]:
    tensors: dict[str, TensorInfo] = {}
    for path in files:
        for name, info in read_header(path).items():
            if name in tensors:
                raise SeqkvError(f"{path}: tensor {_q(name, 80)} is also in {tensors[name].file}")
            tensors[name] = info
        if len(tensors) > MAX_TENSORS:
            raise SeqkvError(f"{path}: more than {MAX_TENSORS:,} tensors in the folder")
    return tensors


# -- headers against the config -----------------------------------------------------------------


def check_tensors(config, tensors: dict[str, TensorInfo], where: str) -> None:
    """What the config says against what the files hold, without building anything: the
    layers present are 0..num_hidden_layers-1, the embedding has vocab_size rows, every
    weight is a float."""
    from seqkv_cli.runtime.model_config import text_config

    cfg = text_config(config)
    if not tensors:
        raise SeqkvError(f"{where}: the weight files hold no tensors")
    layers = cfg.num_hidden_layers
    seen: set[int] = set()
    for name in tensors:
        if _OTHER_TOWER.search(name):
            continue
        m = _LAYER.search(name)
        if m:
            seen.add(int(m.group(1)))
    if seen:
        extra = sorted(i for i in seen if i >= layers)
        if extra:
            raise SeqkvError(
                f"{where}: num_hidden_layers is {layers}, the weights hold layer {extra[0]} "
                f"({len(extra)} layer(s) more); the config and weights disagree"
            )
        absent = sorted(set(range(layers)) - seen)
        if absent:
            raise SeqkvError(
                f"{where}: num_hidden_layers is {layers}, the weights have no layer {absent[0]} "
                f"({len(absent)} missing); the config and weights disagree"
            )
    embeddings = [n for n in tensors if _EMBEDDING.search(n) and not _OTHER_TOWER.search(n)]
    if not embeddings:
        raise SeqkvError(f"{where}: the weights hold no input embedding (embed_tokens.weight)")
    for name in embeddings:
        shape = tensors[name].shape
        if len(shape) != 2 or shape[0] != cfg.vocab_size:
            raise SeqkvError(
                f"{where}: vocab_size is {cfg.vocab_size:,}, the embedding {_q(name, 100)} "
                f"has shape {shape}; the config and weights disagree"
            )
    for name, info in tensors.items():
        if info.dtype not in FLOAT_DTYPES and not _ignorable(config, name):
            raise SeqkvError(
                f"{info.file}: tensor {_q(name, 80)} is {info.dtype}; seqkv reads float "
                "(F32, F16, BF16) weights"
            )


def _model_class(config):
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]


def _ignorable(config, name: str) -> bool:
    """A leftover transformers itself declares harmless for the class (old checkpoints'
    attention masks, rotary caches)."""
    patterns = getattr(_model_class(config), "_keys_to_ignore_on_load_unexpected", None) or []
    return any(re.search(p, name) for p in patterns)


def check_names(config, tensors: dict[str, TensorInfo], where: str) -> None:
    """Every tensor the model expects is in the files with its shape, and nothing else is
    (tied output embeddings may be absent where the config ties them). The module is built
    on the meta device (shapes, no memory) and the files' names mapped as transformers maps
    them when it loads (its renamings and per-expert stacking, whose stacked shapes it
    checks itself)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=False)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    tied = set(_tied_names(model, config))
    rename = _renamer(model, expected)
    found: dict[str, str] = {}  # target name -> file name
    for name, info in tensors.items():
        target, converted = rename(name)
        if target not in expected:
            if _ignorable(config, name):
                continue
            raise SeqkvError(
                f"{info.file}: tensor {_q(name, 100)} is not part of a {config.model_type} model "
                "of this config (unexpected weight)"
            )
        if not converted and tuple(info.shape) != expected[target]:
            raise SeqkvError(
                f"{info.file}: tensor {_q(name, 100)} has shape {tuple(info.shape)}, the config "
                f"makes it {expected[target]}"
            )
        found[target] = name
    missing = sorted(n for n in expected if n not in found and n not in tied)
    if missing:
        raise SeqkvError(
            f"{where}: the weights have no {_q(missing[0], 100)}"
            + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
            + "; seqkv never fills a missing weight"
        )


def _tied_names(model, config) -> list[str]:
    from seqkv_cli.runtime.model_config import text_config

    tie = getattr(config, "tie_word_embeddings", None)
    if tie is None:
        tie = getattr(text_config(config), "tie_word_embeddings", False)
    if not tie:
        return []
    keys = getattr(model, "_tied_weights_keys", None) or {}
    return list(keys) if isinstance(keys, dict | list | tuple | set) else []


def _renamer(model, expected: dict):
    """checkpoint name -> (model name, whether a converter stacks it), by transformers' own
    key mapping where this version has one; names as they are otherwise."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, rename_source_key

        transforms = get_model_conversion_mapping(model)
        renamings = [t for t in transforms if not isinstance(t, WeightConverter)]
        converters = [t for t in transforms if isinstance(t, WeightConverter)]
    except ImportError:  # another transformers version: exact names only
        return lambda name: (name, False)

    prefix = getattr(model, "base_model_prefix", None) or None

    def rename(name: str):
        target, pattern = rename_source_key(name, renamings, converters, prefix, expected)
        return target, pattern is not None

    return rename


def check_folder(folder: Path) -> CheckedFolder:
    """Everything above, for a folder: its checked config, weight files and tensor table."""
    config_path = folder / "config.json"
    config = check_config(read_json(config_path), str(config_path))
    for name in ("tokenizer_config.json", "processor_config.json"):
        if (folder / name).is_file():
            refuse_code(read_json(folder / name), str(folder / name))
    files = weight_files(folder)
    tensors = read_tensors(files)
    check_tensors(config, tensors, str(folder))
    check_names(config, tensors, str(folder))
    return CheckedFolder(config, files, tensors)
