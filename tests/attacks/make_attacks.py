"""Write the hostile-file corpus ONCE: each a small .skv with valid CRCs and one attack.

Every file passes its checksums (tests/forge.py signs them again), so only the parsers behind
the CRC stand between it and a traceback, a hang or a huge allocation. expected.json names
each file's attack and the one-line refusal the CLI must print (a substring of it). Usage:
python -m tests.attacks.make_attacks tests/attacks
"""

from __future__ import annotations

import json
import struct
import sys
import tempfile
import zlib
from pathlib import Path

from seqkv_cli.trie.tables import encode_tables
from tests.forge import put_together, read_tables, take_apart


def _sources(folder: Path) -> list[Path]:
    from seqkv_cli.kvcapture.capture_file import save_capture
    from tests.archive.test_bounded_parsers import _capture

    out = []
    for k, tokens in enumerate(([5, 6, 7, 8, 9, 10], [5, 6, 7, 11, 12])):
        out.append(folder / f"s{k}.safetensors")
        save_capture(_capture(f"s{k}", tokens, k), out[-1])
    return out


def _names(sections, raw: bytes) -> None:
    """Replace the zlib'd names at the end of t1/index with `raw`, compressed."""
    from tests.archive.test_structure_fuzz import _names_length

    table = sections["t1/index"]
    head = bytearray(table[: len(table) - _names_length(table)])
    packed = zlib.compress(raw, 9)
    value = len(packed)
    while value >= 0x80:
        head.append((value & 0x7F) | 0x80)
        value >>= 7
    head.append(value)
    sections["t1/index"] = bytes(head + packed)


def attacks():
    def names_bomb(h, s):
        _names(s, b" " * (64 << 20))

    def names_deep(h, s):
        deep = "[" * 100_000 + "]" * 100_000
        _names(
            s,
            ('{"profiles":[{"shapes":{}}],"sessions":[["s0",{"x":' + deep + '}],["s1"]]}').encode(),
        )

    def node_huge(h, s):
        t = read_tables(s["t1/index"])
        t.nodes[-1].n_tokens = 1 << 40
        s["t1/index"] = encode_tables(t, 0)

    def turbo_8191(h, s):
        h["sessions"][0]["shapes"]["head_dim"] = 8191
        for name in [n for n in s if n.startswith("s0/layers.")]:
            data = bytearray(s[name])
            struct.pack_into("<H", data, 11, 8191)
            s[name] = bytes(data)

    def positions_huge(h, s):
        h["sessions"][0]["positions"] = 1 << 40

    def precision_float(h, s):
        h["pipeline"] = [
            {"id": "seq", "precision_bits": 24.5, "chunk_size": 1024, "residual": "lossless"}
        ]

    def fewer_layers(h, s):
        h["sessions"][0]["shapes"]["num_layers"] = 1

    def meta_int(h, s):
        h["sessions"][0]["capture_meta"] = 2

    def surprisal_short(h, s):
        s["s0/surprisal"] = s["s0/surprisal"][:-3]

    def block_shape(h, s):
        data = bytearray(s["s1/layers.0.key"])
        struct.pack_into("<I", data, 7, 4)  # seq_len 4, the entry says 5
        s["s1/layers.0.key"] = bytes(data)

    def kv_blocks_past_end(h, s):
        t = read_tables(s["t1/index"])
        t.nodes[0].kv_lengths = (1 << 30, *t.nodes[0].kv_lengths[1:])
        s["t1/index"] = encode_tables(t, 0)

    return [
        (
            "names_zlib_bomb",
            "lossless-trie",
            names_bomb,
            "trie session names inflate from 64 KB to 64 MiB",
            "inflate past",
        ),
        (
            "names_deep_json",
            "lossless-trie",
            names_deep,
            "trie session names nest 100,000 levels deep",
            "do not decompress",
        ),
        (
            "node_huge_length",
            "lossless-trie",
            node_huge,
            "a trie node claims 2**40 tokens",
            "impossible length",
        ),
        (
            "turbo_head_dim_8191",
            "turbo3-flat",
            turbo_8191,
            "a turbo3 block and its entry declare head_dim 8191 (110 s, 2.9 GB before)",
            "declares head_dim 8191",
        ),
        (
            "positions_huge",
            "lossless-flat",
            positions_huge,
            "a session claims 2**40 positions",
            "over the limit",
        ),
        (
            "precision_float",
            "lossless-flat",
            precision_float,
            "a seq pipeline with precision_bits 24.5 (TypeError before)",
            "precision_bits",
        ),
        (
            "fewer_layers",
            "turbo3-flat",
            fewer_layers,
            "the header says 1 layer, the file holds 2 (restored half, exit 0, before)",
            "other layers",
        ),
        (
            "capture_meta_int",
            "lossless-flat",
            meta_int,
            "capture_meta is an integer (TypeError before)",
            "malformed session entry",
        ),
        (
            "surprisal_short",
            "lossless-flat",
            surprisal_short,
            "a surprisal section 3 bytes short (ValueError before)",
            "inconsistent lengths",
        ),
        (
            "block_wrong_shape",
            "lossless-flat",
            block_shape,
            "a K/V block whose header says 4 positions, its entry 5",
            "expected bf16 (1, 5, 8)",
        ),
        (
            "kv_blocks_past_end",
            "lossless-trie",
            kv_blocks_past_end,
            "a trie node's K/V block length runs 1 GiB past its part",
            "run past",
        ),
    ]


def main(out: Path) -> None:
    from seqkv_cli.archive import compress_captures

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        caps = _sources(folder)
        bases = {}
        for codec in ("lossless", "turbo3"):
            for layout in ("flat", "trie"):
                path = folder / f"{codec}-{layout}.skv"
                compress_captures(caps, path, codec=codec, layout=layout)
                bases[f"{codec}-{layout}"] = path
        expected = {}
        for name, base, change, what, refusal in attacks():
            header, sections = take_apart(bases[base])
            change(header, sections)
            (out / f"{name}.skv").write_bytes(put_together(header, sections))
            expected[f"{name}.skv"] = {"attack": what, "refusal": refusal}
    (out / "expected.json").write_text(json.dumps(expected, indent=2) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
