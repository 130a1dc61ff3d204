"""The seqkv benchmarks, run as modules from the repository root (`python -m bench.run`,
`python -m bench.drafts ...`) on one harness (`bench.harness`); a package so its modules import
as `bench.<name>` and never shadow test helpers with the same short names."""
