"""`seqkv archive list` on a large shard manifest: reading it (schema checked on whole columns)
and printing it, per row, against the Rich table it printed before.

    python -m bench.studies.manifest_listing --sessions 300000 --json out/manifest_listing.json

The manifest is synthetic (no shards: `read_manifest(check_shards=False)`); the shard check
reads every listed shard's header, as the reader did before this change, plus one vectorised
merge of (shard, id) pairs. The Rich table is timed on `--rich-sample` rows (it renders in
time linear in the rows) and given per row.
"""

from __future__ import annotations

import io
import json
import tempfile
from pathlib import Path

from bench import harness
from bench.table import table


def synthetic_manifest(folder: Path, n: int) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from seqkv_cli.archive import COLUMNS, MANIFEST_NAME, META_KEY

    rows = {
        "session_id": [f"agent-{i:07d}" for i in range(n)],
        "shard": [f"shard-{i // 1000:05d}-0123abcd.skv" for i in range(n)],
        "tokens": [50 + i % 4000 for i in range(n)],
        "bytes": [200 + i % 9000 for i in range(n)],
        "shared_prefix": [i % 50 for i in range(n)],
        "log2_pp": [2.5] * n,
        "prefix_key": ["0123456789abcdef"] * n,
    }
    table = pa.table({k: pa.array(v, type=getattr(pa, COLUMNS[k])()) for k, v in rows.items()})
    meta = {"version": 1, "model": {"name": "bench", "fingerprint": "ab" * 32}}
    pq.write_table(
        table.replace_schema_metadata({META_KEY: json.dumps(meta)}), folder / MANIFEST_NAME
    )


def main(argv: list[str] | None = None) -> dict:
    from rich.console import Console

    from seqkv_cli.archive import read_manifest
    from seqkv_cli.commands import _common, archive

    parser = harness.parser(__doc__, model=False)
    parser.add_argument("--sessions", type=int, default=300_000)
    parser.add_argument("--rich-sample", type=int, default=3000)
    args = parser.parse_args(argv)
    harness.start(args)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        synthetic_manifest(folder, args.sessions)
        man, read_s = harness.timed(lambda: read_manifest(folder, check_shards=False))
        sink = Console(file=io.StringIO(), width=160)
        original, _common.console, archive.console = _common.console, sink, sink
        try:
            plain_s = _print(archive, man, rows=None)
            rich_s = _print(archive, man, rows=args.rich_sample)
        finally:
            _common.console = archive.console = original
    n = args.sessions
    return harness.finish(
        args,
        None,
        report,
        sessions=n,
        read_s=read_s,
        plain_print_s=plain_s,
        us_per_row=1e6 * (read_s + plain_s) / n,
        rich_us_per_row=1e6 * rich_s / args.rich_sample,
        rich_sample=args.rich_sample,
    )


def _print(archive, man, rows: int | None) -> float:
    """Seconds to print `man` (its first `rows` rows as a Rich table; all rows plainly)."""
    from unittest import mock

    if rows is not None:
        man.rows = man.rows.head(rows)
    limit = 10**9 if rows is not None else 0
    with (
        mock.patch.object(archive, "RICH_TABLE_ROWS", limit),
        mock.patch("seqkv_cli.archive.read_manifest", return_value=man),
    ):
        _, seconds = harness.timed(lambda: archive._list_manifest(man.root))
    return seconds


def report(result: dict) -> str:
    lines = harness.heading("`seqkv archive list` on a large manifest", result)
    head = ["sessions", "read + schema check", "print (plain)", "per row", "Rich table, per row"]
    cells = [
        f"{result['sessions']:,}", f"{result['read_s']:.2f} s", f"{result['plain_print_s']:.2f} s",
        f"{result['us_per_row']:.1f} µs",
        f"{result['rich_us_per_row']:.0f} µs ({result['rich_sample']:,} rows timed)",
    ]  # fmt: skip
    lines += table(head, [cells], align="rrrrr")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
