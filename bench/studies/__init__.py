"""Single measurements, one module each, run as `python -m bench.studies.<name>`: each
docstring says what it measures and how, and docs/BENCHMARKS.md quotes its command."""
