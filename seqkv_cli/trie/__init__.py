"""Token trie: shared prefixes across sessions stored once (DESIGN.md §2, Layer 1)."""
