"""The seqkv version: one definition, read by the package, the CLI, provenance and packaging."""

__version__ = "0.9.0"
