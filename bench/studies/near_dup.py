"""Near-duplicate prefixes (paper's Layer 1, "probabilistic prefixes") against exact-prefix dedup.

Usage (the command recorded in docs/BENCHMARKS.md):
    python -m bench.studies.near_dup \\
        --append docs/BENCHMARKS_LOG.md --json bench/results/near_dup.json

Sessions: (a) sample_data/chats.jsonl, where near-01..03 change one adjective at token 5 of the
712-token prefix shared by chat-*; (b) synthetic: the first 700 tokens of prose.txt, one token
substituted by the model's most likely alternative at k in {5, 100, 350, 650} (plus one
inserted token at 100), each with its own 100-token suffix. All captures canonical, fp32.
The exact-prefix trie branches from whichever other session shares the longest prefix.

Per member against its centroid:
* `seq` tokens: the exact-prefix trie stores the member's tokens after the longest common
  prefix; the near-dup delta stores an edit script whose inserted tokens are range-coded
  under the model (copies are free). Both streams are real `encode_edits` output; the delta
  is decoded back and compared.
* per-vector (turbo3, kivi2 without fp16 window) over the positions the delta copies after
  the edit: the member's K/V coded fresh; the residual member - centroid (aligned positions)
  coded with the same quantizer; the centroid's K/V reused as is (0 bits); and the residual
  "where needed": coded only for vectors where reuse would be worse than fresh coding.
* decay: relative L2 of member - centroid K and V per layer, at offsets after the edit.
"""

from __future__ import annotations

import json
import time

import numpy as np
import torch

from bench import harness
from bench.harness import SAMPLE, timed
from bench.table import table

OFFSETS = (1, 10, 100, 500)
CODECS = ({"id": "turbo3"}, {"id": "kivi2", "residual": 0})
KIVI_MEMBERS = ("near-01", "sub@5", "sub@350", "ins@100")  # kivi2 is the slower codec
DECODED = ("chat-", "near-01", "sub@5", "sub@650", "ins@100")  # decode steps per inserted token


def sessions(lm) -> tuple[dict[str, list[int]], dict[str, list[int]]]:
    """Token ids of the chats and of the synthetic family (centroid 'prose' first)."""
    from seqkv_cli.kvcapture.engine import tokenize
    from seqkv_cli.kvcapture.inputs import read_inputs

    chats = {d.id: tokenize(lm, d) for d in read_inputs([str(SAMPLE / "chats.jsonl")])}
    [prose_doc] = read_inputs([str(SAMPLE / "prose.txt")])
    prose = tokenize(lm, prose_doc)
    prefix = prose[:700]
    with torch.inference_mode():
        logits = lm.model(torch.tensor([prefix])).logits[0]
    synth = {"prose": prefix + prose[700:800]}
    for n, (kind, k) in enumerate(
        [("sub", 5), ("sub", 100), ("sub", 350), ("sub", 650), ("ins", 100)]
    ):
        top = logits[k - 1].topk(2).indices.tolist()  # row k-1 predicts token k
        alt = top[0] if top[0] != prefix[k] else top[1]
        edited = [*prefix[:k], alt, *prefix[k + (kind == "sub") :]]
        synth[f"{kind}@{k}"] = edited + prose[800 + 100 * n : 900 + 100 * n]
    return chats, synth


def copy_pairs(edits, start: int, stop: int = 1 << 30) -> tuple[np.ndarray, np.ndarray]:
    """(centroid, member) positions the delta copies, start <= member position < stop."""
    from seqkv_cli.trie import COPY, DELETE, INSERT

    ci, mj, i, j = [], [], 0, 0
    for e in edits:
        if e.op == COPY:
            ci += range(i, i + e.length)
            mj += range(j, j + e.length)
        i += 0 if e.op == INSERT else e.length
        j += 0 if e.op == DELETE else e.length
    ci, mj = np.array(ci, np.int64), np.array(mj, np.int64)
    sel = (mj >= start) & (mj < stop)
    return ci[sel], mj[sel]


def token_costs(canon, name: str, c, base, m: np.ndarray, lcp: int, cap_m):
    """Exact-prefix branch (against `base`) vs near-dup delta (against centroid `c`), bytes."""
    from seqkv_cli.sequential.adapter import CanonicalLogits
    from seqkv_cli.trie import COPY, DELETE, INSERT, Edit, align, decode_edits, encode_edits

    exact = [
        Edit(COPY, lcp),
        Edit(DELETE, len(base) - lcp),
        Edit(INSERT, len(m) - lcp, tuple(m[lcp:].tolist())),
    ]
    exact = [e for e in exact if e.length]
    near = align(c, m)
    exact_b = encode_edits(exact, centroid=base, model=CanonicalLogits(canon))
    near_b = encode_edits(near, centroid=c, model=CanonicalLogits(canon))
    back, decode_s = None, None
    if name.startswith(DECODED):
        back, decode_s = timed(lambda: decode_edits(near_b, c, model=CanonicalLogits(canon)))
    bits = cap_m.surprisal.double().numpy()  # bits[i] = cost of token i + 1
    _, copied = copy_pairs(near, lcp)
    copied = copied[copied > 0]
    return {
        "lcp": lcp,
        "positions": len(m),
        "exact_tokens_coded": len(m) - lcp,
        "near_tokens_coded": sum(e.length for e in near if e.op == INSERT),
        "near_ops": len(near),
        "copied_after_lcp": len(copied),
        "copied_bits": float(bits[copied - 1].sum()),
        "exact_ideal_bits": float(bits[max(lcp, 1) - 1 :].sum()),
        "exact_bytes": len(exact_b),
        "near_bytes": len(near_b),
        "near_exact_roundtrip": None if back is None else bool(np.array_equal(back, m)),
        "near_decode_s": decode_s,
    }, near


def _roundtrip(codec, x: np.ndarray, kind: str) -> tuple[int, np.ndarray]:
    from seqkv_codecs.kvblock import KVBlock

    data = codec.encode(KVBlock(np.ascontiguousarray(x, np.float32), "fp32", kind))
    return len(data), codec.decode(data).to_float32()


def per_vector(cfg: dict, cap_c, cap_m, ci: np.ndarray, mj: np.ndarray) -> dict:
    """Fresh vs residual (same quantizer) vs centroid K/V as is vs 'residual where needed'.

    'Where needed': a vector keeps the centroid's K/V when that is already no worse than
    coding it fresh (||r_v|| <= ||x_v - fresh(x_v)||), else its residual is coded; a 1-bit
    mask per vector says which. Every vector is then (about) as good as fresh coding or better.
    """
    from seqkv_codecs.entropy import encode_symbols
    from seqkv_codecs.registry import get_codec

    codec = get_codec(cfg)
    names = ("fresh", "resid", "reuse", "needed")
    tot = {**{f"{k}_b": 0 for k in names}, **{f"{k}_e2": 0.0 for k in names}}
    tot.update(norm2=0.0, coded=0, worse=0, vectors=0)
    for kind, tc, tm in (("key", cap_c.keys, cap_m.keys), ("value", cap_c.values, cap_m.values)):
        for layer in range(len(tc)):
            x = tm[layer][:, mj].float().numpy()
            r = x - tc[layer][:, ci].float().numpy()
            fb, xf = _roundtrip(codec, x, kind)
            rb, rr = _roundtrip(codec, r, kind)
            f_v, d_v = ((x - xf) ** 2).sum(-1).ravel(), (r**2).sum(-1).ravel()
            keep = d_v > f_v
            err_v = d_v.copy()
            nb = len(encode_symbols(keep.astype(np.uint8), 2))
            if keep.any():
                kept = r.reshape(-1, r.shape[-1])[keep][None]
                kb, kr = _roundtrip(codec, kept, kind)
                nb, err_v[keep] = nb + kb, ((kept - kr) ** 2).sum(-1).ravel()
            for key, value in (
                ("fresh_b", fb),
                ("resid_b", rb),
                ("needed_b", nb),
                ("fresh_e2", f_v.sum()),
                ("resid_e2", ((r - rr) ** 2).sum()),
                ("reuse_e2", d_v.sum()),
                ("needed_e2", err_v.sum()),
                ("norm2", (x**2).sum()),
                ("coded", int(keep.sum())),
                ("worse", int((err_v > f_v * 1.0001).sum())),
                ("vectors", d_v.size),
            ):
                tot[key] += value
    n = tot.pop("norm2")
    out = {k.replace("_e2", "_rel_l2"): float(np.sqrt(v / n)) for k, v in tot.items() if "_e2" in k}
    out.update({k: int(v) for k, v in tot.items() if "_e2" not in k})
    out["positions"] = len(mj)
    return out


def decay(cap_c, cap_m, ci: np.ndarray, mj: np.ndarray, first: int) -> dict:
    """Relative L2 of member - centroid per layer at each offset after the edit (1 = first
    copied token), and averaged over distance bins."""
    out = {}
    dist = mj - first + 1
    bins = [(1, 1), (2, 10), (11, 100), (101, 500), (501, 10**9)]
    for kind, tc, tm in (("key", cap_c.keys, cap_m.keys), ("value", cap_c.values, cap_m.values)):
        rel = np.stack(
            [
                np.linalg.norm((tm[li][:, mj] - tc[li][:, ci]).float().numpy(), axis=(0, 2))
                / np.linalg.norm(tm[li][:, mj].float().numpy(), axis=(0, 2))
                for li in range(len(tc))
            ]
        )  # (layers, positions)
        out[kind] = {
            "offsets": {o: rel[:, dist == o][:, 0].tolist() for o in OFFSETS if (dist == o).any()},
            "bins": {
                f"{a}-{b}" if b < 10**9 else f">{a - 1}": float(
                    rel[:, (dist >= a) & (dist <= b)].mean()
                )
                for a, b in bins
                if ((dist >= a) & (dist <= b)).any()
            },
        }
    return out


def measure(lm, canon, family: dict[str, list[int]], centroid: str, members: list[str]) -> list:
    from seqkv_cli.kvcapture.engine import run_capture
    from seqkv_cli.trie import common_prefix_len, near_prefix, plt_distance

    caps = {n: run_capture(lm, family[n], dtype="fp32") for n in [centroid, *members]}
    c = np.array(family[centroid], np.int64)
    rows = []
    for name in members:
        m = np.array(family[name], np.int64)
        # The trie branches from the stored session sharing the longest prefix.
        lcp, base = max((common_prefix_len(family[o], m), o) for o in family if o != name)
        row, edits = token_costs(canon, name, c, np.array(family[base]), m, lcp, caps[name])
        end, edited = near_prefix(c, m)
        ci, mj = copy_pairs(edits, lcp, end)
        bits = caps[name].surprisal.double().numpy()
        row.update(
            member=name,
            centroid=centroid,
            branch_from=base,
            near_prefix=end,
            near_prefix_edited=edited,
            plt_exact_bits=plt_distance(bits, common_prefix_len(c, m)),
        )
        if len(mj):
            row["decay"] = decay(caps[centroid], caps[name], ci, mj, int(mj[0]))
            row["per_vector"] = {
                cfg["id"]: per_vector(cfg, caps[centroid], caps[name], ci, mj)
                for cfg in CODECS
                if cfg["id"] != "kivi2" or name in KIVI_MEMBERS
            }
        rows.append(row)
        print(f"  {name}: {json.dumps({k: v for k, v in row.items() if k != 'decay'})}")
    return rows


def _checked(row: dict) -> str:
    if row["near_exact_roundtrip"] is None:
        return "not decoded"
    return f"{'yes' if row['near_exact_roundtrip'] else 'NO'} ({row['near_decode_s']:.1f})"


def report(result: dict) -> str:
    rows, clusters = result["rows"], result["clusters"]
    lines = [
        *harness.heading("Near-duplicate prefixes", result),
        f"{result['seconds']:.0f} s in all.",
        "",
        "Clusters of the 16 chats (`cluster`, 5% edits, >= 32 aligned tokens): "
        + "; ".join(f"centroid {c['centroid']} + {len(c['members'])} members" for c in clusters),
        "",
        "`seq` tokens, bytes per member (real streams, edit framing and CRCs included; the "
        "delta was decoded back, stepping the model per inserted token, where marked):",
        "",
    ]
    head = [
        "member", "centroid", "LCP", "near prefix (edited)", "tokens coded: exact / delta",
        "copied after LCP (bits)", "exact-trie B", "near-dup B", "gain B", "d_T(LCP) bits",
        "delta decoded exactly (s)",
    ]  # fmt: skip
    cells = [
        [r["member"], r["centroid"], r["lcp"], f"{r['near_prefix']} ({r['near_prefix_edited']})",
         f"{r['exact_tokens_coded']} / {r['near_tokens_coded']}",
         f"{r['copied_after_lcp']} ({r['copied_bits']:.0f})", r["exact_bytes"], r["near_bytes"],
         r["exact_bytes"] - r["near_bytes"], f"{r['plt_exact_bits']:.1f}", _checked(r)]
        for r in rows
    ]  # fmt: skip
    lines += table(head, cells)
    lines += [
        "",
        "Per-vector codecs over the positions the delta copies after the edit (bits per "
        "position; relative L2 error of K and V together):",
        "",
    ]
    head = [
        "member", "codec", "positions", "fresh b/pos (err)", "residual, same quantizer b/pos (err)",
        "centroid K/V as is: err", "residual where needed b/pos (err)", "vectors coded",
        "vectors worse than fresh",
    ]  # fmt: skip
    cells = [
        [r["member"], cid, p["positions"],
         f"{p['fresh_b'] * 8 / p['positions']:,.0f} ({p['fresh_rel_l2']:.3f})",
         f"{p['resid_b'] * 8 / p['positions']:,.0f} ({p['resid_rel_l2']:.3f})",
         f"{p['reuse_rel_l2']:.3f}",
         f"{p['needed_b'] * 8 / p['positions']:,.0f} ({p['needed_rel_l2']:.3f})",
         f"{p['coded'] / p['vectors']:.1%}", p["worse"]]
        for r in rows
        for cid, p in r.get("per_vector", {}).items()
    ]  # fmt: skip
    lines += table(head, cells)
    lines += [
        "",
        "Residual decay: relative L2 of member - centroid K / V at offsets after the edit "
        "(mean over 30 layers; layer 29 in brackets):",
        "",
    ]
    decays = []
    for r in rows:
        if "decay" not in r:
            continue
        cells = [r["member"]]
        for o in OFFSETS:
            k, v = r["decay"]["key"]["offsets"].get(o), r["decay"]["value"]["offsets"].get(o)
            cells.append(
                "—"
                if k is None
                else f"{np.mean(k):.3f} / {np.mean(v):.3f} [{k[-1]:.3f} / {v[-1]:.3f}]"
            )
        decays.append(cells)
    lines += table(["member", *(f"offset {o}" for o in OFFSETS)], decays)
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    parser = harness.parser(__doc__)
    args = parser.parse_args(argv)
    from seqkv_cli.kvcapture.engine import canonical_model
    from seqkv_cli.trie import cluster

    start = time.perf_counter()
    lm = harness.start(args)
    canon = canonical_model(lm)
    chats, synth = sessions(lm)
    clusters = cluster({k: np.array(v) for k, v in chats.items()})
    [big] = [c for c in clusters if len(c.members) == len(chats) - 1]
    control = next(m for m in big.members if m.startswith("chat-"))  # an exact-prefix member
    rows = measure(lm, canon, chats, big.centroid, [control, "near-01", "near-02", "near-03"])
    rows += measure(lm, canon, synth, "prose", [n for n in synth if n != "prose"])
    seconds = time.perf_counter() - start
    clusters_json = [c._asdict() for c in clusters]
    return harness.finish(args, lm, report, rows=rows, clusters=clusters_json, seconds=seconds)


if __name__ == "__main__":
    main()
