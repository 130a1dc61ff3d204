"""Model runtime: find, convert, load and fingerprint models; the canonical forward."""
