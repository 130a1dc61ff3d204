"""The Python library API: archives of a model's sessions (memory.py), caches (caches.py)."""
