"""Models at real shapes with random weights, written as users' checkpoints are: a sharded bf16
safetensors folder, or a GGUF file of Q8_0 / Q4_K blocks written with the `gguf` package.

No model hub is reachable here, so the shapes of public checkpoints (their config values)
are rebuilt with random weights: memory and speed depend on the shape, not on what the
weights learned. The tokenizer is the embedded model's (its ids fit any larger vocabulary);
the vocabulary of the model — the coder's alphabet — is the shape's own.

    python -m bench.real_shapes qwen2.5-1.5b --folder OUT_DIR
    python -m bench.real_shapes llama-3.2-3b --gguf OUT.gguf --qtype Q8_0

Tensors are made and written one at a time (a shard of at most 2 GB in memory, a GGUF
tensor at a time), so an 8B shape is written on a machine that could not hold it in fp32.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import numpy as np
import torch

# Config values of public checkpoints (their config.json), weights not included.
SHAPES: dict[str, dict] = {
    "qwen2.5-0.5b": {
        "model_type": "qwen2",
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
        "max_position_embeddings": 32768,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
    },
    "qwen2.5-1.5b": {
        "model_type": "qwen2",
        "hidden_size": 1536,
        "intermediate_size": 8960,
        "num_hidden_layers": 28,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
        "max_position_embeddings": 32768,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
    },
    "llama-3.2-3b": {
        "model_type": "llama",
        "hidden_size": 3072,
        "intermediate_size": 8192,
        "num_hidden_layers": 28,
        "num_attention_heads": 24,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "factor": 32.0,
            "high_freq_factor": 4.0,
            "low_freq_factor": 1.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": True,
    },
    "llama-3.1-8b": {
        "model_type": "llama",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "factor": 8.0,
            "high_freq_factor": 4.0,
            "low_freq_factor": 1.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
    },
}
SHARD_BYTES = 2 << 30  # safetensors shards of at most this much, as hub checkpoints are split
STD = 0.02  # transformers' initializer_range: the scale of random linear weights


def config_of(shape: str):
    """The transformers config of a shape (bf16, as the public checkpoints declare)."""
    from transformers import AutoConfig

    values = dict(SHAPES[shape])
    return AutoConfig.for_model(values.pop("model_type"), dtype="bfloat16", **values)


def parameters(config) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every tensor a checkpoint of `config` stores, in the model's order
    (a tied lm_head is not stored: it is the embedding)."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config)
    tied = getattr(config, "tie_word_embeddings", False)
    return [
        (name, tuple(p.shape))
        for name, p in model.named_parameters(remove_duplicate=True)
        if not (tied and name == "lm_head.weight")
    ]


def random_tensor(name: str, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    """A tensor as initialisation would make it: norms 1, biases and weights ~N(0, STD)."""
    if name.endswith("norm.weight"):
        return torch.ones(shape)
    return torch.randn(shape, generator=generator) * STD


def tokenizer_folder() -> Path:
    """The embedded model's folder (its tokenizer files are copied next to each shape)."""
    from seqkv_cli.runtime.embedded import embedded_model_path

    return embedded_model_path()


def write_folder(shape: str, out: Path, seed: int = 0) -> Path:
    """A bf16 safetensors model folder of `shape` at `out` (sharded, with an index)."""
    from safetensors.torch import save_file

    config = config_of(shape)
    out.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    total = 0
    weight_map: dict[str, str] = {}
    names: list[list[str]] = [[]]

    def flush() -> None:
        index = len(names)
        save_file(shards[-1], out / f"part-{index:05d}.safetensors", metadata={"format": "pt"})
        shards[-1] = {}

    for name, dims in parameters(config):
        t = random_tensor(name, dims, generator).to(torch.bfloat16)
        nbytes = t.numel() * 2
        if size and size + nbytes > SHARD_BYTES:
            flush()
            names.append([])
            size = 0
        shards[-1][name] = t
        names[-1].append(name)
        size += nbytes
        total += nbytes
    flush()
    count = len(names)
    for i, group in enumerate(names, start=1):
        final = f"model-{i:05d}-of-{count:05d}.safetensors"
        (out / f"part-{i:05d}.safetensors").rename(out / final)
        weight_map.update(dict.fromkeys(group, final))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    config.save_pretrained(out)
    src = tokenizer_folder()
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (src / f).exists():
            shutil.copy(src / f, out / f)
    return out


# --- GGUF ------------------------------------------------------------------------------------

QK_K = 256


def q4_k_blocks(rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random Q4_K blocks (rows, cols / 256 * 144 bytes) decoding to ~N(0, STD)-sized values:
    fp16 d and dmin, 6-bit scales and mins, 4-bit quants (gguf-py writes no Q4_K itself)."""
    n = rows * (cols // QK_K)
    blocks = np.empty((n, 144), dtype=np.uint8)
    blocks[:, 0:2] = np.full(n, 1e-4, np.float16).view(np.uint8).reshape(n, 2)
    blocks[:, 2:4] = np.full(n, 8e-4, np.float16).view(np.uint8).reshape(n, 2)
    blocks[:, 4:144] = rng.integers(0, 256, size=(n, 140), dtype=np.uint8)
    return blocks.reshape(rows, -1)


def write_gguf(
    shape, out: Path, qtype: str = "Q8_0", seed: int = 0, tokenizer: dict | None = None
) -> Path:
    """A GGUF file of `shape` (a name in SHAPES, or a transformers config): 2-D weights as
    `qtype` blocks (a name, or a callable name -> type for a mix), norms and biases F32, and
    the embedded model's tokenizer padded to the vocabulary (or `tokenizer`'s fields:
    `byte_tokenizer`)."""
    import gguf

    config = config_of(shape) if isinstance(shape, str) else shape
    arch = config.model_type
    writer = gguf.GGUFWriter(out, arch)
    prefix = arch
    writer.add_uint32(f"{prefix}.block_count", config.num_hidden_layers)
    writer.add_uint32(f"{prefix}.context_length", config.max_position_embeddings)
    writer.add_uint32(f"{prefix}.embedding_length", config.hidden_size)
    writer.add_uint32(f"{prefix}.feed_forward_length", config.intermediate_size)
    writer.add_uint32(f"{prefix}.attention.head_count", config.num_attention_heads)
    writer.add_uint32(f"{prefix}.attention.head_count_kv", config.num_key_value_heads)
    rope = getattr(config, "rope_parameters", None) or {}
    theta = rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    writer.add_float32(f"{prefix}.rope.freq_base", float(theta))
    writer.add_float32(f"{prefix}.attention.layer_norm_rms_epsilon", float(config.rms_norm_eps))
    writer.add_uint32(f"{prefix}.vocab_size", config.vocab_size)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_uint32(f"{prefix}.rope.dimension_count", head_dim)
    fields = tokenizer or _embedded_tokenizer(config.vocab_size)
    _write_tokenizer(writer, fields)

    names = gguf.get_tensor_name_map(_gguf_arch(arch), config.num_hidden_layers)
    qtype_of = qtype if callable(qtype) else (lambda name: qtype)
    plan = []
    for name, dims in parameters(config):
        base, _, suffix = name.rpartition(".")
        target = names.get_name(base)
        if target is None:
            raise SystemExit(f"no GGUF name for {name}")
        quant = gguf.GGMLQuantizationType[qtype_of(name)] if len(dims) == 2 else None
        blocked = quant is not None and quant not in (
            gguf.GGMLQuantizationType.F32,
            gguf.GGMLQuantizationType.F16,
        )
        plan.append((f"{target}.{suffix}", name, dims, quant))
        if quant == gguf.GGMLQuantizationType.F16:
            writer.add_tensor_info(
                f"{target}.{suffix}", dims, np.dtype(np.float16), int(np.prod(dims)) * 2
            )
        elif blocked:
            rows, cols = dims
            nbytes = (
                rows * cols // gguf.GGML_QUANT_SIZES[quant][0] * gguf.GGML_QUANT_SIZES[quant][1]
            )
            writer.add_tensor_info(
                f"{target}.{suffix}", (rows, nbytes // rows), np.dtype(np.uint8), nbytes, quant
            )
        else:
            writer.add_tensor_info(
                f"{target}.{suffix}", dims, np.dtype(np.float32), int(np.prod(dims)) * 4
            )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    generator = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    for _, name, dims, quant in plan:
        if quant is None or quant == gguf.GGMLQuantizationType.F32:
            writer.write_tensor_data(random_tensor(name, dims, generator).numpy())
        elif quant == gguf.GGMLQuantizationType.F16:
            writer.write_tensor_data(
                random_tensor(name, dims, generator).numpy().astype(np.float16)
            )
        elif quant == gguf.GGMLQuantizationType.Q4_K:
            writer.write_tensor_data(q4_k_blocks(*dims, rng))
        else:
            rows = []
            for start in range(0, dims[0], 4096):  # quantize a slab at a time (bounded memory)
                n = min(4096, dims[0] - start)
                slab = random_tensor(name, (n, dims[1]), generator).numpy()
                rows.append(gguf.quants.quantize(slab, quant))
            writer.write_tensor_data(np.concatenate(rows))
    writer.close()
    return out


def tokenizer_gguf() -> Path:
    from seqkv_cli.runtime.embedded import embedded_gguf

    return embedded_gguf()


def _gguf_arch(model_type: str):
    import gguf

    return next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == model_type)


def _embedded_tokenizer(vocab: int) -> dict:
    """The embedded GGUF's tokenizer fields, its tokens padded to ``vocab`` with unused ones."""
    import gguf

    fields = gguf.GGUFReader(tokenizer_gguf()).fields
    tokens = list(fields["tokenizer.ggml.tokens"].contents())
    types = list(fields["tokenizer.ggml.token_type"].contents())
    pad = vocab - len(tokens)
    return {
        "model": fields["tokenizer.ggml.model"].contents(),
        "pre": fields["tokenizer.ggml.pre"].contents(),
        "tokens": tokens + [f"<|seqkv_unused_{i}|>" for i in range(pad)],
        "types": types + [gguf.TokenType.UNUSED] * pad,
        "merges": list(fields["tokenizer.ggml.merges"].contents()),
        "bos": fields["tokenizer.ggml.bos_token_id"].contents(),
        "eos": fields["tokenizer.ggml.eos_token_id"].contents(),
        "chat_template": fields["tokenizer.chat_template"].contents(),
    }


def byte_tokenizer(vocab: int) -> dict:
    """A GPT-2 style byte-level tokenizer: one token per byte (the first 256 ids), one merge
    ("ab"), then unused ones up to ``vocab`` (tiny test models, no download)."""
    import gguf
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    alphabet = [*bytes_to_unicode().values(), "ab"]
    pad = vocab - len(alphabet)
    return {
        "model": "gpt2",
        "pre": "default",
        "tokens": alphabet + [f"<|unused_{i}|>" for i in range(pad)],
        "types": [gguf.TokenType.NORMAL] * len(alphabet) + [gguf.TokenType.UNUSED] * pad,
        "merges": ["a b"],
        "bos": 0,
        "eos": 1,
        "chat_template": None,
    }


def _write_tokenizer(writer, fields: dict) -> None:
    writer.add_tokenizer_model(fields["model"])
    writer.add_tokenizer_pre(fields["pre"])
    writer.add_token_list(fields["tokens"])
    writer.add_token_types(fields["types"])
    if fields["merges"]:
        writer.add_token_merges(fields["merges"])
    writer.add_bos_token_id(fields["bos"])
    writer.add_eos_token_id(fields["eos"])
    writer.add_add_bos_token(False)
    if fields["chat_template"]:
        writer.add_chat_template(fields["chat_template"])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("shape", choices=sorted(SHAPES))
    p.add_argument("--folder", type=Path, help="write a bf16 safetensors folder here")
    p.add_argument("--gguf", type=Path, help="write a GGUF file here")
    p.add_argument("--qtype", default="Q8_0", choices=("Q8_0", "Q4_K"))
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if not args.folder and not args.gguf:
        p.error("give --folder and/or --gguf")
    if args.folder:
        print(write_folder(args.shape, args.folder, args.seed))
    if args.gguf:
        print(write_gguf(args.shape, args.gguf, args.qtype, args.seed))


if __name__ == "__main__":
    main()
