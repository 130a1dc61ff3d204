"""Reading sessions back out of a container: decode sections into captures."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from seqkv_cli.container.layout import capture_meta_of, kv_part, section_name
from seqkv_cli.errors import SeqkvError
from seqkv_cli.kvcapture.blocks import to_tensor
from seqkv_cli.sequential.registry import capabilities
from seqkv_cli.sequential.surprisal_part import plausible_surprisal_part

KINDS = ("key", "value")
SESSION_BATCH = 16  # model-backed sessions decoded in lockstep (memory: one K/V state each)


class Archive:
    """An open container plus its decoding pipeline; sessions decode one at a time."""

    def __init__(self, path: Path | str, model=None) -> None:
        from seqkv_cli.container import open_container
        from seqkv_cli.sequential.registry import resolve_codec

        self.path = Path(path)
        # Told (tokens decoded so far, tokens to decode) while model codecs restore: progress.
        self.on_tokens: Callable[[int, int], None] | None = None
        self.decode_stats = None  # trie.decode.DecodeStats of the latest trie restore
        if not self.path.is_file():
            raise SeqkvError(f"no such file: {self.path}")
        self.reader = open_container(self.path)
        header = self.reader.header
        self.trie = None
        self.sessions: list[dict] = header["sessions"]
        if "trie" in header:
            from seqkv_cli.trie import store

            # The model (and its context) is known only once loaded: canonical() checks again.
            self.trie = store.load(self.reader, self.path, max_context=store.MAX_POSITIONS)
            sizes = {s.name: s.length for s in self.reader.sections}
            self.sessions = store.entries(self.trie, sizes, self.reader.read_section)
        for entry in self.sessions:
            _check_entry(self.path, entry)
        self.model: dict = header["model"] or {}
        pipeline = header["pipeline"]
        if len(pipeline) != 1:
            raise SeqkvError(f"{self.path}: pipelines of {len(pipeline)} stages are not supported")
        self.codec = resolve_codec(pipeline[0])
        if self.needs_model:  # from the file's own config: refuse a bad one in one line
            from seqkv_cli.trie.node_source import check_precision

            try:
                check_precision(getattr(self.codec, "precision_bits", 24))
            except SeqkvError as exc:
                raise SeqkvError(f"{self.path}: {exc}") from None
        self._model_spec, self._canon = model, None
        if self.trie is not None:
            from seqkv_cli.trie.store import PartReader

            self.read_part = PartReader(self.reader)

    @property
    def needs_model(self) -> bool:
        return capabilities(self.codec).needs_canonical

    def canonical(self):
        """The model this container was compressed with, checked by fingerprint."""
        if self._canon is None:
            from seqkv_cli.skv.identity import fingerprint_matches, load_canonical

            canon, ident = load_canonical(self._model_spec, self.codec.numerics)
            want = self.model.get("fingerprint", "?")
            if not fingerprint_matches(want, ident["fingerprint"]):
                raise SeqkvError(
                    f"{self.path} was compressed with model {self.model.get('name', '?')} "
                    f"(fingerprint {want[:16]}); the loaded model {ident['name']} has "
                    f"fingerprint {ident['fingerprint'][:16]}; pass --model with the right one"
                )
            if want != ident["fingerprint"]:  # a compact file's prefix: restored captures
                self.model = dict(ident)  # name the model whole, as their capture did
            if self.trie is not None:
                from seqkv_cli.trie.store import check_context

                check_context(self.trie, canon.max_context, self.path)
            self._canon = canon
        return self._canon

    def __enter__(self) -> Archive:
        return self

    def __exit__(self, *exc) -> None:
        self.reader.close()

    def session(self, session_id: str) -> dict:
        for entry in self.sessions:
            if entry["id"] == session_id:
                return entry
        known = ", ".join(e["id"] for e in self.sessions[:10])
        raise SeqkvError(f"{self.path} has no session '{session_id}' (it has: {known})")

    def decode_kv(self, entry: dict, layer: int, kind: str) -> torch.Tensor:
        from seqkv_codecs.errors import CodecError

        name = section_name(entry["index"], kv_part(layer, kind))
        data = self.reader.read_section(name)  # checks the section's CRC32C
        expected = (
            entry["shapes"]["num_kv_heads"],
            entry["positions"],
            entry["shapes"]["head_dim"],
        )
        try:  # the stream's own header is checked against the entry before anything is decoded
            block = self.codec.decode_checked(data, expected, entry["dtype"], kind)
        except CodecError as exc:
            raise SeqkvError(f"{self.path}: section {name} does not decode: {exc}") from None
        return to_tensor(block)

    def restore(self, entry: dict):
        """The session as a Capture (K/V decoded by the pipeline)."""
        [(_, result)] = self.restore_many([entry])
        if isinstance(result, Exception):
            raise result
        return result

    def restore_many(self, entries: list[dict], batch: int = SESSION_BATCH):
        """Yield (entry, Capture or the SeqkvError that stopped it), in order.

        Model-backed sessions are decoded `batch` at a time in lockstep (one model pass per
        position for all of them); a damaged session does not stop the others.
        """
        if self.trie is not None:
            yield from self._restore_trie(entries)
            return
        if not self.needs_model:
            for entry in entries:
                try:
                    result = self._restore_pervector(entry)
                except SeqkvError as exc:  # one damaged session does not stop the others
                    result = exc
                yield entry, self._with_meta(entry, result)
            return
        canon = self.canonical()
        done, total = 0, sum(e["positions"] for e in entries)
        for start in range(0, len(entries), batch):
            chunk = entries[start : start + batch]
            group, reads, failed = [], [], {}
            for k, entry in enumerate(chunk):
                try:  # a session whose stream is unusable fails alone, before the batch runs
                    read = self._reader_for(entry)
                    self.codec.screen_tokens(entry, read("tokens.seq"), canon)
                    group.append(entry)
                    reads.append(read)
                except SeqkvError as exc:
                    failed[k] = exc
            results = iter(self.codec.decode_many(group, reads, canon) if group else [])
            done += sum(e["positions"] for e in chunk)
            if self.on_tokens is not None:
                self.on_tokens(done, total)
            for k, entry in enumerate(chunk):
                result = failed[k] if k in failed else next(results)
                if isinstance(result, Exception):  # name the file and session
                    result = SeqkvError(f"{self.path}: session {entry['id']}: {result}")
                yield entry, self._with_meta(entry, result)

    def _restore_trie(self, entries: list[dict]):
        """Sessions of a trie archive, as they finish (only their nodes are decoded).

        A near-duplicate session needs its centroid's tokens: the centroid is restored too
        (and yielded only if it was asked for).
        """
        wanted = {e["index"]: e for e in entries}
        members = {i: e for i, e in wanted.items() if e["trie"].get("centroid") is not None}
        base = {i: e for i, e in wanted.items() if i not in members}
        for e in members.values():
            c = e["trie"]["centroid"]
            base.setdefault(c, self.sessions[c])
            if self.sessions[c]["trie"].get("centroid") is not None:
                raise SeqkvError(f"{self.path}: session {e['id']}'s centroid is itself an edit")
        based, broken = self._residual_bases(base)
        for i, exc in broken.items():  # a damaged session fails alone
            base.pop(i)
            if i in wanted:
                yield wanted[i], exc
        for b in set(based.values()):
            base.setdefault(b, self.sessions[b])
        centroid_tokens = {}
        finished, held = {}, {}
        for entry, result in self._restore_paths(base):
            i = entry["index"]
            if not isinstance(result, Exception):
                centroid_tokens[i] = result.tokens.numpy()
                if result.deferred and i not in based:
                    result = SeqkvError(
                        f"{self.path}: session {entry['id']}: a residual rests on a session "
                        "its parts do not name: the file is damaged"
                    )
            if i in based.values():
                finished[i] = result
            held[i] = (entry, result)
            for j in [j for j in held if j not in based or based[j] in finished]:
                e, r = held.pop(j)
                if j in based:
                    r = self._rest_on(e, r, finished[based[j]])
                if j in wanted:
                    yield e, self._with_meta(e, r)
        for entry in members.values():
            c = entry["trie"]["centroid"]
            if c not in centroid_tokens:
                result = SeqkvError(f"{self.path}: session {entry['id']}: its centroid failed")
            else:
                result = self._restore_member(entry, centroid_tokens[c])
            yield entry, self._with_meta(entry, result)

    def _residual_bases(self, entries: dict[int, dict]):
        """{session index: the session its residual rests on} for these path sessions, and
        {session index: error} for those whose parts are damaged."""
        from seqkv_cli.skv.based import residual_base

        out, broken = {}, {}
        for i, e in entries.items():
            try:
                b = residual_base(e, self._session_reader(e))
                if b is not None and (
                    not 0 <= b < len(self.sessions)
                    or self.sessions[b]["trie"].get("centroid") is not None
                    or residual_base(self.sessions[b], self._session_reader(self.sessions[b]))
                    is not None
                ):
                    raise SeqkvError("the session its residual rests on is not a plain one")
            except SeqkvError as exc:
                broken[i] = SeqkvError(f"{self.path}: session {e['id']}: {exc}")
                continue
            if b is not None:
                out[i] = b
        return out, broken

    def _rest_on(self, entry: dict, result, base):
        from seqkv_cli.skv.based import rest_on

        if isinstance(result, Exception):
            return result
        if isinstance(base, Exception):
            return SeqkvError(
                f"{self.path}: session {entry['id']}: the session its residual rests on "
                f"failed ({base})"
            )
        try:
            return rest_on(result, base)
        except SeqkvError as exc:
            return SeqkvError(f"{self.path}: session {entry['id']}: {exc}")

    def _restore_member(self, entry: dict, centroid_tokens):
        from seqkv_cli.sequential.session_codec import finish_capture
        from seqkv_cli.trie.neardup_store import restore_member

        try:
            read = self._session_reader(entry)
            return restore_member(entry, read, centroid_tokens, self.canonical(), finish_capture)
        except SeqkvError as exc:
            return SeqkvError(f"{self.path}: session {entry['id']}: {exc}")

    def _restore_paths(self, by_index: dict[int, dict]):
        from seqkv_cli.trie.decode import DecodeStats, restore
        from seqkv_cli.trie.node_source import NodeSource

        reads = {i: self._session_reader(e) for i, e in by_index.items()}
        if self.needs_model:
            canon = self.canonical()
            precision = getattr(self.codec, "precision_bits", 24)
            source = NodeSource(self.trie, self.read_part, canon.vocab_size, precision)
            stats = self.decode_stats = DecodeStats(on_tokens=self.on_tokens)
            results = restore(
                self.trie, list(by_index), source, self.codec, canon, by_index, reads, stats
            )
        else:
            from seqkv_cli.trie.pervector import restore_pervector

            results = restore_pervector(self, list(by_index), reads)
        from seqkv_cli.trie.sources import ppl_milli

        for s, result in results:
            entry = by_index[s]
            stored = self.trie.sessions[s].log2_ppl_milli
            if not isinstance(result, Exception) and ppl_milli(result.surprisal) != stored:
                # the session table's log2 PP is the one redundant record of a session's
                # length and path: a changed end or end node shows up here
                result = SeqkvError(
                    f"its restored log2 PP ({ppl_milli(result.surprisal) / 1000:.3f}) is not "
                    f"the one its table records ({stored / 1000:.3f}): the archive is damaged"
                )
            if isinstance(result, Exception):
                result = SeqkvError(f"{self.path}: session {entry['id']}: {result}")
            yield entry, result

    def _session_reader(self, entry: dict):
        from seqkv_cli.trie.store import session_part

        where = entry["trie"]
        owned = set(entry["sections"])

        def read(part: str) -> bytes | None:
            name = session_part(where["segment"], where["local"], part)
            return _checked_part(
                entry, part, self.reader.read_section(name) if name in owned else None
            )

        return read

    def _with_meta(self, entry: dict, restored):
        if not isinstance(restored, Exception):
            restored.meta = capture_meta_of(entry, self.model)
        return restored

    def _reader_for(self, entry: dict):
        i, owned = entry["index"], set(entry["sections"])
        if section_name(i, "tokens.seq") not in owned:
            raise SeqkvError(f"{self.path}: session {entry['id']} has no token stream")

        def read(part: str) -> bytes | None:
            name = section_name(i, part)
            return _checked_part(
                entry, part, self.reader.read_section(name) if name in owned else None
            )

        return read

    def _restore_pervector(self, entry: dict):
        from seqkv_cli.kvcapture.capture_file import Capture

        i, n = entry["index"], entry["positions"]
        raw_tokens = self.reader.read_section(section_name(i, "tokens"))
        raw_surprisal = self.reader.read_section(section_name(i, "surprisal"))
        if len(raw_tokens) != 4 * n or len(raw_surprisal) != 8 * max(n - 1, 0):
            raise SeqkvError(f"{self.path}: session {entry['id']} has inconsistent lengths")
        tokens = np.frombuffer(raw_tokens, "<u4")
        surprisal = np.frombuffer(raw_surprisal, "<f8")
        # every K/V block the session owns is restored: a header claiming fewer layers than
        # the file holds would otherwise drop some silently
        layers = entry["shapes"]["num_layers"]
        want = {section_name(i, kv_part(k, kind)) for k in range(layers) for kind in KINDS}
        held = {name for name in entry["sections"] if "/layers." in name}
        if held != want:
            raise SeqkvError(
                f"{self.path}: session {entry['id']} holds K/V blocks for other layers than "
                f"the {layers} its header says"
            )
        if tokens.shape[0] != n or surprisal.shape[0] != max(n - 1, 0):
            raise SeqkvError(f"{self.path}: session {entry['id']} has inconsistent lengths")
        layers = range(entry["shapes"]["num_layers"])
        keys = [self.decode_kv(entry, layer, "key") for layer in layers]
        values = [self.decode_kv(entry, layer, "value") for layer in layers]
        meta = {"session_id": entry["id"], "dtype": entry["dtype"]}  # completed by _with_meta
        return Capture(
            torch.from_numpy(tokens.astype(np.int64)),
            keys,
            values,
            torch.from_numpy(surprisal.copy()),
            meta,
        )


def _check_entry(path: Path, entry) -> None:
    """Headers pass their CRC, but a file written by another tool may still lack fields."""
    from seqkv_cli.trie.store import MAX_POSITIONS

    shapes = entry.get("shapes") if isinstance(entry, dict) else None
    ok = (
        isinstance(shapes, dict)
        and isinstance(entry.get("id"), str)
        and all(_int_in(entry.get(k), 0, 1 << 62) for k in ("index", "positions"))
        and entry.get("dtype") in ("bf16", "fp16", "fp32")
        and all(
            _int_in(shapes.get(k), 1, 0xFFFF) for k in ("num_layers", "num_kv_heads", "head_dim")
        )
        and isinstance(entry.get("sections", []), list)
        and all(isinstance(name, str) for name in entry.get("sections", []))
        and isinstance(entry.get("capture_meta", {}), dict)
    )
    if not ok:
        raise SeqkvError(f"{path}: malformed session entry in the header: {str(entry)[:80]!r}")
    if entry["positions"] > MAX_POSITIONS:  # bounds every allocation sized by positions
        raise SeqkvError(
            f"{path}: session {entry['id']!r} claims {entry['positions']} positions, "
            f"over the limit of {MAX_POSITIONS}"
        )


def _checked_part(entry: dict, part: str, data: bytes | None) -> bytes | None:
    """A session's own part, refused when its size cannot be what the entry says."""
    if part == "surprisal" and data is not None:
        want = max(entry["positions"] - 1, 0)
        if not plausible_surprisal_part(data, want):  # raw float64, or SKS1 and shorter
            raise SeqkvError(f"its stored surprisal holds {len(data)} bytes, not {8 * want}")
    return data


def _int_in(value, low: int, high: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high
