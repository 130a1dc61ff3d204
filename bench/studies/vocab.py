"""Large vocabularies (issue 36): the `seq` token coder at 49,152 vs 151,936 vs 256,000 tokens.

For each vocabulary a tiny random model (hidden 64, 2 layers, built like the tests' models:
its forward is small, so what grows with the vocabulary shows) codes a session of tokens
sampled from the model itself, on the portable canonical path:

* end to end: `encode_tokens` (prefill + one frequency row per position + range coder) and
  the decoder (`decode_tokens_batch`, one model step per token, guesses off), in tokens/s,
  with the compiled row kernels (the default) and with `SEQKV_CODER_KERNELS=off` (the numpy
  definition); the two streams must be the same bytes, or the bench stops;
* per token, on the session's own logits: the model step, the surprisal the restore records
  (runtime's float64 log-softmax), the frequency row (kernel, numpy), the encoder's interval,
  the decoder's search: what each costs at each vocabulary;
* bits: the range-coded payload per position against log2 PP (the mean surprisal), and what
  the 24-bit tables cost over the model's own -log2 p (their floors hold V / 2**24 of the
  mass). A second table: that cost on Gaussian logits, whose entropy is nearer real text's;
* `seq-fast`'s static stream of the same ids (entropy stream version 2 past 65,536 tokens):
  bits per position, encode and decode milliseconds.

    python -m bench.studies.vocab --json bench/results/vocab.json --append docs/BENCHMARKS.md
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from bench import harness

VOCABS = (49_152, 151_936, 256_000)
SHAPE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2}
PRECISION = 24
CHUNK = 1024  # the seq codec's chunk size


def _median_ms(fn, calls: int) -> float:
    """Median wall milliseconds of `fn(i)` over `calls` calls (a shared machine: the median
    is steadier than the mean)."""
    import time

    out = []
    for i in range(calls):
        start = time.perf_counter()
        fn(i)
        out.append(time.perf_counter() - start)
    return float(np.median(out)) * 1e3


def _sample(adapter, n: int, seed: int) -> np.ndarray:
    """Tokens drawn from the model itself, so they cost about its entropy."""
    rng = np.random.default_rng(seed)
    out = np.zeros(n, dtype=np.int64)
    out[0] = rng.integers(adapter.vocab_size)
    track = adapter.start(n)
    for i in range(1, n):
        z = adapter.feed(track, out[i - 1 : i])[0].astype(np.float64)
        p = np.exp(z - z.max())
        out[i] = rng.choice(adapter.vocab_size, p=p / p.sum())
    adapter.tracks.clear()
    return out


def _with_kernels(on: bool):
    os.environ["SEQKV_CODER_KERNELS"] = "on" if on else "off"


def measure(vocab: int, tokens: int, folder: Path) -> dict:
    from bench.gpu.files import tests_conftest
    from seqkv_cli.kvcapture.engine import canonical_model
    from seqkv_cli.runtime.loading import load_model
    from seqkv_cli.sequential.adapter import CanonicalLogits
    from seqkv_codecs.sequential import encode_tokens_with_stats, frequencies_from_logits
    from seqkv_codecs.sequential.batch_decode import decode_tokens_batch

    build = tests_conftest().build_tiny_model
    lm = load_model(str(build(folder / "m", vocab_size=vocab, context=4096, **SHAPE)))
    canon = canonical_model(lm)
    ids = _sample(CanonicalLogits(canon), tokens, seed=vocab)
    row = {"vocab": vocab, "tokens": tokens}
    streams = {}
    for on in (True, False):
        _with_kernels(on)
        key = "kernels" if on else "numpy"
        frequencies_from_logits(np.zeros((1, vocab), np.float32))  # compiled/loaded once
        (data, stats), seconds = harness.timed(
            lambda: encode_tokens_with_stats(
                ids, CanonicalLogits(canon), precision_bits=PRECISION, chunk_size=CHUNK
            )
        )
        row[f"encode_tokens_per_s_{key}"] = round(tokens / seconds, 1)
        [(decoded, _)], seconds = harness.timed(
            lambda data=data: decode_tokens_batch(
                [data], CanonicalLogits(canon), with_states=True, drafts=False
            )
        )
        if isinstance(decoded, Exception) or not np.array_equal(decoded, ids):
            raise SystemExit(f"V={vocab}: the decoder ({key}) did not give the tokens back")
        row[f"decode_tokens_per_s_{key}"] = round(tokens / seconds, 1)
        streams[key] = (data, stats)
    os.environ.pop("SEQKV_CODER_KERNELS", None)
    if streams["kernels"][0] != streams["numpy"][0]:
        raise SystemExit(f"V={vocab}: the kernels wrote other bytes than the numpy definition")
    row["same_bytes"] = True
    row.update(_per_token(canon, ids))
    data, stats = streams["kernels"]
    row.update(_bits(canon, ids, stats))
    row["stream_bytes"] = len(data)
    row.update(_static(ids, vocab))
    return row


def _static(ids: np.ndarray, vocab: int) -> dict:
    """`seq-fast`'s token stream of the same ids: a static rANS table over the vocabulary
    (entropy stream version 2, 16-bit planes, past 65,536 tokens)."""
    from seqkv_codecs.entropy import decode_symbols, encode_symbols

    data, encode_s = harness.best_of(lambda: encode_symbols(ids, vocab), 3)
    decoded, decode_s = harness.best_of(lambda: decode_symbols(data), 3)
    if not np.array_equal(decoded, ids):
        raise SystemExit(f"V={vocab}: the static stream did not give the tokens back")
    return {
        "static_version": data[0],
        "static_bits_per_position": round(len(data) * 8 / len(ids), 3),
        "static_encode_ms": round(encode_s * 1e3, 2),
        "static_decode_ms": round(decode_s * 1e3, 2),
    }


def _per_token(canon, ids: np.ndarray) -> dict:
    """Milliseconds per token of each piece, on the session's own logits."""
    from seqkv_codecs.sequential import (
        find_symbol,
        frequencies_from_logits,
        intervals_from_logits,
        reference_frequencies,
    )

    n = len(ids)
    state = canon.new_state(n)
    logits = canon.forward(state, torch.from_numpy(ids[: n - 1]))  # row i predicts ids[i + 1]
    x, nxt = logits.numpy(), ids[1:]
    calls = min(64, n - 1)
    step_state = canon.new_state(calls + 1)
    out = {
        "step_ms": _median_ms(
            lambda i: canon.forward(step_state, torch.from_numpy(ids[i : i + 1])), calls
        ),
        "surprisal_ms": _median_ms(
            lambda i: canon.surprisal(logits[i : i + 1], torch.from_numpy(nxt[i : i + 1])), calls
        ),
        "frequencies_ms": _median_ms(lambda i: frequencies_from_logits(x[i]), calls),
        "frequencies_numpy_ms": _median_ms(lambda i: reference_frequencies(x[i]), calls),
        "interval_ms": _median_ms(
            lambda i: intervals_from_logits(x[i : i + 1], nxt[i : i + 1], PRECISION), calls
        ),
    }
    rows = frequencies_from_logits(x[:calls])
    targets = np.random.default_rng(0).integers(0, 1 << PRECISION, calls)
    out["search_ms"] = _median_ms(lambda i: find_symbol(rows[i], int(targets[i])), calls)
    return {k: round(v, 3) for k, v in out.items()}


def _bits(canon, ids: np.ndarray, stats) -> dict:
    """Payload bits per position against log2 PP, and what the 24-bit tables cost."""
    from seqkv_cli.sequential.adapter import CanonicalLogits

    adapter = CanonicalLogits(canon)
    track = adapter.finish(None, ids)
    surprisal = track.surprisal.numpy()  # -log2 p of tokens 1..n-1 under the model (float64)
    n = len(ids)
    log2_pp = float(surprisal.mean())
    payload = stats.payload_bytes * 8 / n
    return {
        "log2_pp": round(log2_pp, 4),
        "payload_bits_per_position": round(payload, 4),
        "stream_bits_per_position": round(stats.total_bytes * 8 / n, 4),
        "payload_over_log2_pp": round(payload / log2_pp, 5),
        # positions 1..n-1: the 24-bit row's -log2 f / 2**24 over the model's own -log2 p
        "table_cost_bits": round(float((stats.position_bits[1:] - surprisal).mean()), 5),
        "first_token_bits": round(float(stats.position_bits[0]), 3),
    }


def table_cost_on_gaussian_logits(vocabs, scales=(2.0, 5.0, 10.0), rows: int = 8) -> list:
    """KL(softmax || f / 2**24) in bits per token on N(0, s^2) logits: the tables' cost where
    the entropy is low, as real text's is (RANGE_CODER.md §1 gives it at 49,152)."""
    from seqkv_codecs.sequential import frequencies_from_logits

    out = []
    rng = np.random.default_rng(36)
    for vocab in vocabs:
        for scale in scales:
            x = (rng.standard_normal((rows, vocab)) * scale).astype(np.float32)
            z = x.astype(np.float64)
            p = np.exp(z - z.max(1, keepdims=True))
            p /= p.sum(1, keepdims=True)
            q = frequencies_from_logits(x, PRECISION) / 2.0**PRECISION
            entropy = float(-(p * np.log2(p)).sum(1).mean())
            kl = float((p * (np.log2(p) - np.log2(q))).sum(1).mean())
            out.append(
                {"vocab": vocab, "scale": scale, "entropy_bits": round(entropy, 3), "kl": kl}
            )
    return out


@torch.no_grad()  # nothing here trains: no autograd graphs
def main(argv: list[str] | None = None) -> dict:
    parser = harness.parser(__doc__, threads=1, model=False)
    parser.add_argument("--vocabs", type=int, nargs="+", default=list(VOCABS))
    parser.add_argument("--tokens", type=int, default=512, help="tokens per session")
    args = parser.parse_args(argv)
    harness.start(args, load=False)

    def one(vocab: int, folder: Path) -> dict:
        return measure(vocab, args.tokens, folder)

    rows = harness.per_case(args.vocabs, one)
    gaussian = table_cost_on_gaussian_logits(args.vocabs)
    return harness.finish(args, None, markdown, rows=rows, gaussian=gaussian)


def markdown(result: dict) -> str:
    rows = result["rows"]
    base = rows[0]
    lines = [
        *harness.heading(
            "Large vocabularies: the `seq` token coder (`bench/studies/vocab.py`)", result
        ),
        "| vocabulary | encode tokens/s (numpy →) kernels | decode tokens/s (numpy →) kernels "
        "| model step ms | surprisal ms | frequency row ms: numpy → kernel | interval ms "
        "| search ms | payload bits/position | log2 PP | ratio | 24-bit table cost bits |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r['vocab']:,} | {r['encode_tokens_per_s_numpy']} → "
            f"**{r['encode_tokens_per_s_kernels']}** | {r['decode_tokens_per_s_numpy']} → "
            f"**{r['decode_tokens_per_s_kernels']}** | {r['step_ms']} | {r['surprisal_ms']} "
            f"| {r['frequencies_numpy_ms']} → {r['frequencies_ms']} | {r['interval_ms']} "
            f"| {r['search_ms']} | {r['payload_bits_per_position']} | {r['log2_pp']} "
            f"| {r['payload_over_log2_pp']} | {r['table_cost_bits']} |"
        )

    def speed(r: dict, way: str) -> str:
        key = f"{way}_tokens_per_s_kernels"
        return f"{r[key] / base[key]:.2f}"

    lines += [
        "",
        f"Tokens/s against {base['vocab']:,} (kernels): "
        + "; ".join(
            f"{r['vocab']:,} encodes at {speed(r, 'encode')} and decodes at {speed(r, 'decode')}"
            for r in rows[1:]
        )
        + ". Kernels and numpy wrote the same bytes at every vocabulary.",
        "",
        "| vocabulary | `seq-fast` stream | bits/position | encode ms | decode ms |",
        "| ---: | --- | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r['vocab']:,} | entropy version {r['static_version']} "
            f"| {r['static_bits_per_position']} | {r['static_encode_ms']} "
            f"| {r['static_decode_ms']} |"
        )
    lines += [
        "",
        "| vocabulary | logits | entropy bits/token | KL(softmax ‖ f / 2**24) bits/token |",
        "| ---: | --- | ---: | ---: |",
    ]
    for g in result["gaussian"]:
        lines.append(
            f"| {g['vocab']:,} | N(0, {g['scale']:g}²) | {g['entropy_bits']} | {g['kl']:.4f} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
