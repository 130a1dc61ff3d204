"""`python -m seqkv_cli ...`: the `seqkv` command without an installed entry point (e.g. a
checkout on a lent GPU machine, bench/gpu/check.sh)."""

from seqkv_cli.cli import main

main()
