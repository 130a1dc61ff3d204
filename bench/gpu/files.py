"""Whole `.skv` files on a GPU: the `seqkv` command run with --device cpu and --device cuda.

For 1, 8 and 32 sessions (a shared system prompt, then each its own text) of a random-weight
model with the embedded model's shape (no weights need to be on the machine):

* capture on each device: the K/V tensors must be equal (the portable forward);
* compress on each device, trie and flat layouts, `--parallel 4` and the per-vector codecs
  `lossless` and `turbo3` (whose entropy streams the device side codes with the CUDA kernels:
  SEQKV_ENTROPY_GPU_MIN_SYMBOLS=0 sends every stream there, however short), with
  SOURCE_DATE_EPOCH fixed: the files must be byte-identical;
* decompress the CPU's file on the device (and, for one session and for `lossless`, the
  device's on the CPU): K/V equal to the capture (`turbo3`, lossy: the device's restore equal
  to the CPU's);
* decode speed (restored tokens/s of `decompress`, process start and model load included).

Runs as a step of bench/gpu/check.py (imported by it); `--cpu-dry-run` uses the CPU twice,
with a tiny model, to show the code path works where no GPU is.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.table import table

ROOT = Path(__file__).resolve().parents[2]
NEEDS = ("transformers", "safetensors", "typer", "rich", "filelock", "google_crc32c")
CACHE = Path(tempfile.gettempdir()) / "seqkv-gpu-files-cache"
SYSTEM = "<|im_start|>system\nYou are a careful assistant that answers briefly.<|im_end|>\n"


def missing_modules() -> list[str]:
    return [m for m in NEEDS if importlib.util.find_spec(m) is None]


def shape_config(shape: dict) -> dict:
    """transformers config overrides for a model of `shape` (bench/gpu/tokens.py's keys)."""
    return {
        "vocab_size": shape["vocab"],
        "hidden_size": shape["hidden"],
        "intermediate_size": shape["mlp"],
        "num_hidden_layers": shape["layers"],
        "num_attention_heads": shape["heads"],
        "num_key_value_heads": shape["kv_heads"],
        "max_position_embeddings": shape.get("context", 2048),
    }


def tests_conftest():
    """tests/conftest.py, whose model builders the GPU check reuses."""
    from tests import conftest

    return conftest


def build_model(folder: Path, shape: dict, seed: int = 0) -> Path:
    """Random weights of `shape` and a byte-level tokenizer (tests/conftest.py's builder);
    the vocabulary is above the tokenizer's 258 ids: the model's shape counts."""
    return tests_conftest().build_tiny_model(folder, seed=seed, **shape_config(shape))


def write_sessions(folder: Path, count: int, chars: int) -> list[Path]:
    """`count` texts: one system prompt, then a different slice of sample_data prose each."""
    prose = (ROOT / "sample_data" / "prose.txt").read_text(encoding="utf-8")
    folder.mkdir(parents=True, exist_ok=True)
    out = []
    for i in range(count):
        start = (i * 997) % max(1, len(prose) - chars)
        path = folder / f"s{i:02d}.txt"
        path.write_text(SYSTEM + prose[start : start + chars], encoding="utf-8")
        out.append(path)
    return out


def seqkv(*args, device: str) -> float:
    """Run `python -m seqkv_cli ARGS --device DEVICE`; its wall seconds (fails loudly)."""
    # SEQKV_CACHE: fingerprints go next to the run (and platformdirs is not needed).
    env = {**os.environ, "SOURCE_DATE_EPOCH": "1700000000", "SEQKV_CACHE": str(CACHE)}
    if device != "cpu":  # every entropy stream of a per-vector codec on the GPU kernels
        env["SEQKV_ENTROPY_GPU_MIN_SYMBOLS"] = "0"
    env["_TYPER_STANDARD_TRACEBACK"] = "1"  # a plain traceback: its last line names the error
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT), str(ROOT / "codecs"), env.get("PYTHONPATH", "")]
    )
    cmd = [sys.executable, "-m", "seqkv_cli", *map(str, args), "--device", device]
    start = time.perf_counter()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[3:])} failed: {done.stderr.strip()[-1200:]}")
    return time.perf_counter() - start


def same_tensors(a_dir: Path, b_dir: Path) -> bool:
    """Every capture in `a_dir` has the same tokens and K/V as its namesake in `b_dir`."""
    import torch

    from seqkv_cli.kvcapture.capture_file import load_capture  # gpu_check put seqkv on the path

    for path in sorted(a_dir.glob("*.safetensors")):
        a, b = load_capture(path), load_capture(b_dir / path.name)
        pairs = [(a.tokens, b.tokens), *zip(a.keys + a.values, b.keys + b.values, strict=True)]
        if not all(torch.equal(x, y) for x, y in pairs):
            return False
    return True


def one_count(work: Path, model: Path, count: int, chars: int, devices: tuple[str, str]) -> dict:
    """One session count. The CPU side of the device machine only prefills (capture, compress
    --no-verify) except for one session, which it also decodes: stepping thousands of tokens
    on a CPU would not fit a device call."""
    cpu, dev = devices
    texts = write_sessions(work / "texts", count, chars)
    caps = {}
    for d in devices:
        caps[d] = work / f"caps-{d}"
        seqkv("capture", *texts, "-o", caps[d], "--model", model, "--truncate", device=d)
    captures = sorted(caps[cpu].glob("*.safetensors"))
    row = {"sessions": count, "capture_tensors_identical": same_tensors(caps[cpu], caps[dev])}
    variants = {"trie": []}
    if count <= 8:
        variants["flat"] = ["--layout", "flat"]
        variants["parallel-4"] = ["--layout", "flat", "--parallel", "4"]
        variants["lossless"] = ["--codec", "lossless"]
        variants["turbo3"] = ["--codec", "turbo3"]
    for name, extra in variants.items():
        files = {}
        for d in devices:
            files[d] = work / f"{name}-{d}.skv"
            # --no-verify: each file is decoded below, on the other device, and compared.
            seqkv("compress", *captures, "-o", files[d], "--model", model, *extra, "--no-verify",
                  device=d)  # fmt: skip
        row[f"{name}_bytes_identical"] = files[cpu].read_bytes() == files[dev].read_bytes()
        row[f"{name}_bytes"] = files[cpu].stat().st_size
        if name == "turbo3":  # lossy: the device's restore must equal the CPU's, bit for bit
            outs = {}
            for d in devices:
                outs[d] = work / f"{name}-{cpu}-on-{d}"
                seqkv("decompress", files[cpu], "-o", outs[d], "--model", model, device=d)
            row[f"{name}_{cpu}_file_on_{dev}_restores_capture"] = same_tensors(outs[cpu], outs[dev])
            continue
        # per-vector files decode fast on the CPU too: those cross both ways
        both = (count == 1 and name == "trie") or name == "lossless"
        crossings = [(cpu, dev)] + ([(dev, cpu)] if both else [])
        for src, dst in crossings:
            out = work / f"{name}-{src}-on-{dst}"
            seconds = seqkv("decompress", files[src], "-o", out, "--model", model, device=dst)
            row[f"{name}_{src}_file_on_{dst}_restores_capture"] = same_tensors(caps[cpu], out)
            row[f"{name}_decode_seconds_on_{dst}"] = seconds
    from safetensors import safe_open

    tokens = 0
    for path in captures:
        with safe_open(path, "pt") as f:
            tokens += f.get_slice("tokens").get_shape()[0]
    row["tokens"] = tokens
    for d in devices:
        seconds = row.get(f"trie_decode_seconds_on_{d}")
        row[f"trie_tokens_per_s_on_{d}"] = tokens / seconds if seconds else None
    return row


def whole_files(device: str, shape: dict, counts: tuple[int, ...], chars: int) -> dict:
    lacking = missing_modules()
    if lacking:
        return {"skipped": f"this Python lacks {', '.join(lacking)} (see bench/gpu/check.sh)"}
    rows = []
    with tempfile.TemporaryDirectory(prefix="seqkv-gpu-files-") as tmp:
        work = Path(tmp)
        model = build_model(work / "model", shape)
        for count in counts:
            print(f"  files: {count} sessions", flush=True)
            case = work / f"n{count}"
            case.mkdir()
            size = chars if count == 1 else max(chars // 2, 16)  # many sessions: shorter ones
            rows.append(one_count(case, model, count, size, ("cpu", device)))
    return {"device": device, "shape": shape, "chars_per_session": chars, "rows": rows}


def markdown(result: dict) -> list[str]:
    if "skipped" in result:
        return ["", f"Whole `.skv` files: skipped — {result['skipped']}."]
    dev = result["device"]
    lines = [
        "",
        f"Whole `.skv` files written by `seqkv` with --device cpu and --device {dev} "
        f"(SOURCE_DATE_EPOCH fixed; random weights of shape {result['shape']}).",
        "",
    ]
    head = [
        "sessions", "tokens", "capture K/V equal", "trie bytes identical", "flat bytes identical",
        "parallel-4 bytes identical", "lossless bytes identical", "turbo3 bytes identical",
        "cross-device restores equal", "trie tokens/s cpu", f"trie tokens/s {dev}",
    ]  # fmt: skip
    rows = []
    for r in result["rows"]:
        cross = all(v for k, v in r.items() if k.endswith("_restores_capture"))
        cells = [f"{r['sessions']}", f"{r['tokens']:,}", _yes(r["capture_tensors_identical"])]
        cells += [
            _flag(r.get(f"{name}_bytes_identical"))
            for name in ("trie", "flat", "parallel-4", "lossless", "turbo3")
        ]
        cells += [_yes(cross), _rate(r["trie_tokens_per_s_on_cpu"])]
        cells.append(_rate(r[f"trie_tokens_per_s_on_{dev}"]))
        rows.append(cells)
    return lines + table(head, rows)


def _rate(value: float | None) -> str:
    return "—" if value is None else f"{value:.1f}"


def _flag(flag: bool | None) -> str:
    return "—" if flag is None else _yes(flag)


def _yes(flag: bool) -> str:
    return "yes" if flag else "**NO**"
