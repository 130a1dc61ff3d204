"""Does a `.skv` decode to the same bits on "other machines"? Simulated on this one.

Each variant decodes the file in a fresh subprocess under other kernels: ISA levels
(``ATEN_CPU_CAPABILITY``), MKL instruction sets (``MKL_ENABLE_INSTRUCTIONS``) and torch thread
counts. Every restored session is hashed (tokens, surprisal, every K/V tensor) and compared
with the encoding process's own capture.

    python -m bench.studies.portability --tokens 1000 --threads 2     # the issue's done-when run
    python -m bench.studies.portability --tokens 1000 --skip-mkl      # without the two MKL variants
    python -m bench.studies.portability decode FILE.skv [--model M]    # one child (prints JSON)
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import harness
from bench.harness import ROOT, SAMPLE


def capture_digest(cap) -> str:
    """sha256 over tokens, surprisal (fp64) and every K/V tensor's bytes, in order."""
    import torch

    h = hashlib.sha256()
    tensors = [cap.tokens.long(), cap.surprisal.double(), *cap.keys, *cap.values]
    for t in tensors:
        h.update(str((t.dtype, tuple(t.shape))).encode())
        h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def decode_digests(path: Path, model: str | None) -> dict[str, str]:
    from seqkv_cli.archive import Archive

    with Archive(path, model=model) as arc:
        return {e["id"]: capture_digest(arc.restore(e)) for e in arc.sessions}


def variants(threads: list[int], mkl: bool = True) -> list[dict[str, str]]:
    """Environment variants this CPU can run (an ISA it lacks would die of SIGILL)."""
    out = [{"SEQKV_BENCH_THREADS": str(n)} for n in threads]
    # The native kernels compiled for baseline x86-64 (SSE2), and not run at (the reference).
    out += [{"NUMBA_CPU_NAME": "generic"}, {"SEQKV_PORTABLE_KERNELS": "reference"}]
    out += [{"ATEN_CPU_CAPABILITY": "avx2"}, {"ATEN_CPU_CAPABILITY": "default"}]  # slowest last
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists() and "avx512f" in cpuinfo.read_text():
        out.append({"ATEN_CPU_CAPABILITY": "avx512"})
    if mkl:
        out += [{"MKL_ENABLE_INSTRUCTIONS": "SSE4_2"}, {"MKL_ENABLE_INSTRUCTIONS": "AVX2"}]
    return out


def decode_in_child(path: Path, model: str | None, env_extra: dict[str, str], timeout: float):
    """(digests, seconds) of one subprocess decode under `env_extra`."""
    env = {**os.environ, **env_extra}
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT), str(ROOT / "codecs"), env.get("PYTHONPATH", "")]
    )
    cmd = [sys.executable, "-m", "bench.studies.portability", "decode", str(path)]
    if model:
        cmd += ["--model", model]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["?"]
        raise RuntimeError(f"decode under {env_extra} failed: {tail[0]}")
    return json.loads(proc.stdout.strip().splitlines()[-1]), time.perf_counter() - t0


def _child(args) -> None:
    import torch

    n = os.environ.get("SEQKV_BENCH_THREADS")
    if n:
        torch.set_num_threads(int(n))
    print(json.dumps(decode_digests(Path(args.file), args.model)))


def _bench(args) -> dict:
    from seqkv_cli.archive import compress_captures
    from seqkv_cli.kvcapture.api import capture

    lm = harness.start(args)
    work = Path(tempfile.mkdtemp(prefix="seqkv-port-"))
    text = (SAMPLE / "prose.txt").read_text() + "\n" + (SAMPLE / "sample_code.py").read_text()
    (work / "doc.txt").write_text(text)
    t0 = time.perf_counter()
    [res] = capture([str(work / "doc.txt")], model=lm, out=work / "caps", max_tokens=args.tokens)
    skv = work / "doc.skv"
    compress_captures([res.path], skv, codec="seq", model=lm, check=False)  # children check
    encode_s = time.perf_counter() - t0
    want = {res.capture.meta["session_id"]: capture_digest(res.capture)}
    rows = []
    for env in variants([1, 3, 5, 7], mkl=not args.skip_mkl):
        got, secs = decode_in_child(skv, args.model, env, timeout=3600)
        rows.append((env, got == want, secs))
        print(f"{env}: {'bit-exact' if got == want else 'DIFFERENT'} ({secs:.0f} s)", flush=True)
    summary = (
        f"{res.capture.positions} positions, encoded with {args.threads} threads in "
        f"{encode_s:.0f} s; {sum(ok for _, ok, _ in rows)}/{len(rows)} variants bit-exact"
    )
    return harness.finish(
        args,
        lm,
        lambda _: "\n" + summary,
        positions=res.capture.positions,
        threads=args.threads,
        variants=[{"env": e, "exact": ok, "seconds": s} for e, ok, s in rows],
    )


def main(argv: list[str] | None = None) -> dict | None:
    parser = harness.parser(__doc__, threads=2)
    sub = parser.add_subparsers(dest="cmd")
    dec = sub.add_parser("decode")
    dec.add_argument("file")
    dec.add_argument("--model")
    parser.add_argument("--tokens", type=int, default=1000)
    parser.add_argument("--skip-mkl", action="store_true", help="leave out the MKL variants")
    args = parser.parse_args(argv)
    if args.cmd == "decode":
        return _child(args)
    return _bench(args)


if __name__ == "__main__":
    main()
