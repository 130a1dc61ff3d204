"""llama.cpp saved states: the file format, and import into / export from trie archives."""
