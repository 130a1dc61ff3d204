"""The seqkv benchmark suite (`python bench/run.py`); a package so its modules import as
`bench.<name>` and never shadow test helpers with the same short names."""
