"""Captures in and out of `.skv` containers: compress, restore, verify, account."""
