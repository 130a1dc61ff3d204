"""Archive operations on a `.skv` file in place: add sessions, compact, list, resume.

Above skv/ (they open archives with `Archive` and write them with `compress_captures`) and
below the commands; the trie core they reshape lives in trie/.
"""
