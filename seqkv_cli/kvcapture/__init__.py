"""Capturing KV caches: reading inputs, running the model, writing capture files."""
