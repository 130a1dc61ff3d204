"""The seqkv benchmarks, run as modules from the repository root on one harness
(`bench.harness`) and one table renderer (`bench.table`):

- `bench.suite`: the benchmark suite, every codec on the embedded model in one run
  (`python -m bench.suite.run`);
- `bench.gpu`: the checks for a lent GPU machine (`bash bench/gpu/check.sh`);
- `bench.studies`: one measurement each (`python -m bench.studies.drafts ...`), quoted with
  its command in docs/BENCHMARKS.md.

A package, so that its modules import as `bench.<folder>.<name>` and never shadow test
helpers with the same short names."""
