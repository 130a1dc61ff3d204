"""`seqkv.open_archive`: keep a model's sessions in one `.skv` trie archive from Python.

    with seqkv.open_archive("memory.skv", model=model) as arc:
        arc.add("chat-42", input_ids, cache=out.past_key_values)
        cache = arc.load("chat-42")          # a DynamicCache, bit for bit the one added

An archive holds sessions of one model. `add` appends a segment (nothing committed is
rewritten; a crash leaves the file as it was) and shares every prefix already stored, so a
growing session costs only its new tokens. The first `add` creates the file.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch

from seqkv_cli.errors import SeqkvError

RESIDUAL_CHOICES = ("auto", "replay", "lossless", "none")
MAX_ID_CHARS = 1024


@dataclass(frozen=True)
class SessionInfo:
    """One archived session, as `sessions()` lists it."""

    id: str
    tokens: int
    bytes: int  # what this session adds on its own (its tokens past the shared prefix, residual)
    shared_prefix: int  # positions it shares with other sessions
    restore: str  # "replay", "canonical + residual" or "canonical" (how `load` rebuilds K/V)


@dataclass(frozen=True)
class AddReport:
    """What one `add` stored."""

    id: str
    tokens: int
    new_tokens: (
        int | None
    )  # tokens past the longest prefix already stored (None: add_many of several)
    added_bytes: int
    file_bytes: int
    kv: str  # "recomputed" (tokens only), "replay", "exact" (residual), "within EPS"
    max_abs_difference: float | None  # user's cache vs the canonical recompute (None: no cache)
    note: str | None = None  # why replay was not used, when it was tried
    # ‖cache - canonical‖ / ‖canonical‖, worst layer (None: no cache, or residual="none")
    relative_difference: float | None = None


class MemoryArchive:
    """An archive opened for adding and loading sessions (see `open_archive`)."""

    def __init__(self, path, model=None, *, tokenizer=None, codec="seq", numerics=None) -> None:
        from seqkv_cli.runtime.loading import resolve_model
        from seqkv_cli.runtime.numerics import DEFAULT
        from seqkv_cli.sequential.registry import codec_capabilities, resolve_codec

        self.path = Path(path)
        if self.path.exists() and not self.path.is_file():
            raise SeqkvError(f"{self.path} is not a file")
        config = dict(codec) if isinstance(codec, dict) else {"id": codec}
        caps = codec_capabilities(str(config.get("id")))
        if caps is None or not (caps.needs_canonical and caps.trie_capable and caps.takes_residual):
            raise SeqkvError(
                f"open_archive keeps sessions with a model-backed trie codec (seq, seq-fast); "
                f"{config.get('id')!r} is not one"
            )
        # A dict config without a numeric path means a new file: the portable default (read
        # from a file, a missing path means the legacy forward that predates the field).
        config.setdefault("numerics", numerics or DEFAULT)
        self._coder = resolve_codec(config)
        self._lm = resolve_model(model, tokenizer=tokenizer)
        # Replay runs the user's own object (their dtype, device, attention), not seqkv's copy.
        self._runner = model if hasattr(model, "state_dict") else self._lm.model
        self._closed = False
        if self.path.is_file():
            self._check_existing()

    @property
    def lm(self):
        """The seqkv model the archive's sessions are coded under (shapes, vocabulary)."""
        return self._lm

    # -- context manager ------------------------------------------------------------------
    def __enter__(self) -> MemoryArchive:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._closed = True

    # -- reading --------------------------------------------------------------------------
    def sessions(self) -> list[SessionInfo]:
        """Every session: id, tokens, bytes of its own, positions shared with others, and how
        `load` rebuilds its K/V."""
        self._open()
        if not self.path.is_file():
            return []
        from seqkv_cli.api.replay import read_record
        from seqkv_cli.archive.summary import session_rows
        from seqkv_cli.skv.restore import Archive

        rows, _ = session_rows(self.path)
        with Archive(self.path) as arc:
            entries = {e["id"]: e for e in arc.sessions}
        out = []
        for r in rows:
            entry = entries[r["id"]]
            meta = {**entry.get("capture_meta", {}), "session_id": r["id"]}
            try:
                replayed = read_record(meta, int(entry["positions"])) is not None
            except SeqkvError:  # one bad record must not hide the other sessions
                replayed, how = False, "malformed replay record"
            else:
                how = "canonical + residual" if entry.get("residual_bytes") else "canonical"
            if replayed:
                how = "replay"
            out.append(
                SessionInfo(
                    r["id"], int(r["positions"]), int(r["own_bytes"]), int(r["shared_prefix"]), how
                )
            )
        return out

    def __contains__(self, session_id: str) -> bool:
        return any(s.id == session_id for s in self.sessions())

    def __len__(self) -> int:
        return len(self.sessions())

    def load_capture(self, session_id: str):
        """The session as a `Capture`: tokens, K/V per layer, surprisal, metadata."""
        from seqkv_cli.skv.restore import Archive

        self._open()
        if not self.path.is_file():
            raise SeqkvError(f"{self.path} has no sessions yet")
        with Archive(self.path, model=self._lm) as arc:
            return arc.restore(arc.session(str(session_id)))

    def tokens(self, session_id: str) -> list[int]:
        return self.load_capture(session_id).tokens.tolist()

    def schedule(self, session_id: str) -> list[int] | None:
        """The forward calls (token counts) that filled a replayed session's cache; None for
        a session without a replay record. A cache continued from `load(session_id)` was
        filled by this schedule plus the continuation's calls."""
        from seqkv_cli.api.replay import Schedule, read_record
        from seqkv_cli.skv.restore import Archive

        self._open()
        if not self.path.is_file():
            raise SeqkvError(f"{self.path} has no sessions yet")
        with Archive(self.path) as arc:  # the index only: no token is decoded
            entry = arc.session(str(session_id))
        meta = {**entry.get("capture_meta", {}), "session_id": entry["id"]}
        rec = read_record(meta, int(entry["positions"]))
        return None if rec is None else list(Schedule.from_runs(rec["calls"]).calls)

    def meta(self, session_id: str) -> dict:
        """The metadata `add(meta=...)` stored with the session ({} if none); read from the
        index, no token is decoded."""
        from seqkv_cli.skv.restore import Archive

        self._open()
        if not self.path.is_file():
            raise SeqkvError(f"{self.path} has no sessions yet")
        with Archive(self.path) as arc:
            entry = arc.session(str(session_id))
        meta = entry.get("capture_meta", {}).get(USER_META_KEY, {})
        return dict(meta) if isinstance(meta, dict) else {}

    def load(self, session_id: str, *, dtype: torch.dtype | None = None, device=None, replay=True):
        """The session's cache as a `DynamicCache(config=model.config)`, ready for
        `model(..., past_key_values=cache)` or `model.generate(..., past_key_values=cache)`.

        K/V come back in the dtype they were added in (the user's cache, bit for bit, for a
        session added with its cache) unless `dtype` says otherwise, on the model's device
        unless `device` says otherwise. A
        session stored for replay re-runs the model it was added with and is checked against
        its digest; `replay=False` gives the canonical K/V instead."""
        from seqkv_cli.api import replay as rp
        from seqkv_cli.api.caches import to_cache

        cap = self.load_capture(session_id)
        rec = rp.read_record(cap.meta, cap.positions)
        keys, values = cap.keys, cap.values
        if rec is not None and replay:
            got = rp.reproduced(self._runner, cap.tokens.tolist(), rec)
            if got is None:
                raise SeqkvError(rp.not_reproduced_message(session_id, rec, self._runner, None))
            keys, values = got
        if device is None:
            device = next(self._runner.parameters()).device
        return to_cache(keys, values, self._lm.config, dtype=dtype, device=device)

    # -- writing --------------------------------------------------------------------------
    def add(
        self,
        session_id: str,
        input_ids,
        cache=None,
        *,
        residual: str = "auto",
        tolerance: float | None = None,
        prompt_length: int | None = None,
        schedule: list[int] | None = None,
        verify: bool = False,
        meta: dict | None = None,
        max_relative_difference: float | None = None,
    ) -> AddReport:
        """Store a session: its token ids and, with `cache`, what makes `load` return it.

        * no `cache`: tokens only; `load` recomputes K/V canonically (bf16).
        * `cache` (the user's own, any numerics, bf16/fp16/fp32), `residual=`:
          - "auto" (default): replay if the model reproduces the cache here (re-run now and
            checked by digest), else "lossless";
          - "replay": a replay record only (refused if the cache is not reproduced);
            `prompt_length` says how `generate` filled it (one prefill of the prompt, then a
            token at a time), `schedule` gives every forward call's token count (a cache
            continued from `load`: `arc.schedule(old) + [new prompt tokens, 1, 1, ...]`);
            default: one prefill of every token;
          - "lossless": the residual against the canonical recompute: bit for bit anywhere;
          - `tolerance=EPS`: the residual elements above EPS only;
          - "none": the canonical recompute (the report says how far that is).

        `meta`: JSON-plain metadata (str/int/float/bool values, nested dicts) kept with the
        session and given back by `meta(session_id)`. `max_relative_difference`:
        refuse a cache whose distance from the canonical recompute (‖cache - canonical‖ /
        ‖canonical‖, worst layer) is above it — a cache of another model.
        `verify` restores the whole archive's new session before returning (slow: the
        decoder steps the model once per token).
        """
        args = dict(
            residual=residual,
            tolerance=tolerance,
            prompt_length=prompt_length,
            schedule=schedule,
            meta=meta,
            max_relative_difference=max_relative_difference,
        )
        return self.add_many(
            [{"session_id": session_id, "input_ids": input_ids, "cache": cache, **args}],
            verify=verify,
        )[0]

    def add_many(self, sessions, *, verify: bool = False) -> list[AddReport]:
        """Store several sessions in one append (one segment: cheaper than one `add` each,
        and one commit: all of them or none). Each item is a mapping of `add`'s arguments by
        name (`session_id`, `input_ids`, and optionally `cache`, `residual`, `tolerance`,
        `prompt_length`, `schedule`, `meta`, `max_relative_difference`). Every report's
        `added_bytes` is what the whole batch added."""
        from seqkv_cli.archive.append import add_sources

        self._open()
        items = [dict(item) for item in sessions]
        if not items:
            raise SeqkvError("add_many: no sessions given")
        known = {s.id for s in self.sessions()} if self.path.is_file() else set()
        prepared = []
        for item in items:
            unknown = set(item) - _ADD_FIELDS
            if unknown or not {"session_id", "input_ids"} <= set(item):
                raise SeqkvError(
                    "add_many: each session is a mapping with session_id, input_ids and "
                    f"add()'s keyword arguments (got {sorted(item)})"
                )
            sid = check_session_id(item["session_id"])
            if sid in known:
                raise SeqkvError(
                    f"{self.path} already has a session {sid!r}; ids must be unique"
                    if sid not in {p[0] for p in prepared}
                    else f"session {sid!r} is given twice"
                )
            known.add(sid)
            prepared.append(self._prepare(sid, item))
        sources = [p[1] for p in prepared]
        if self.path.is_file():
            result = add_sources(self.path, sources, self._lm)
            added, file_bytes, new = result.added_bytes, result.file_bytes, result.new_tokens
        else:
            created = self._create(sources)
            if created is None:  # another writer created the file meanwhile: append to it
                self._check_existing()
                result = add_sources(self.path, sources, self._lm)
                added, file_bytes, new = result.added_bytes, result.file_bytes, result.new_tokens
            else:
                added = file_bytes = created
                new = None
        reports = []
        for sid, source, ids, how, diff, note, rel in prepared:
            if verify:
                self._verify(sid, source.capture, source.coder_for(self._coder))
            fresh = len(ids) if new is None else (new if len(prepared) == 1 else None)
            reports.append(AddReport(sid, len(ids), fresh, added, file_bytes, how, diff, note, rel))
        return reports

    def _prepare(self, sid: str, item: dict):
        """One session's source to store and what its report says (checked before any
        model work where the arguments alone can be wrong)."""
        from seqkv_cli.trie.sources import Source

        ids = token_list(item["input_ids"], self._lm.vocab_size)
        cache = item.get("cache")
        residual = item.get("residual", "auto")
        tolerance = item.get("tolerance")
        prompt_length, schedule = item.get("prompt_length"), item.get("schedule")
        limit = item.get("max_relative_difference")
        meta = check_meta(item.get("meta"))
        if residual not in RESIDUAL_CHOICES:
            raise SeqkvError(f"residual must be one of {RESIDUAL_CHOICES}, not {residual!r}")
        if tolerance is not None and residual in ("none", "replay"):
            raise SeqkvError(
                f"tolerance applies to a stored residual; residual={residual!r} keeps none"
            )
        if tolerance is not None:
            self._coder_with(tolerance)  # a bad value is refused before any model work
            residual = "lossless"
        if (prompt_length is not None or schedule is not None) and residual in ("lossless", "none"):
            raise SeqkvError(
                f"prompt_length and schedule describe how to replay a cache; "
                f"residual={residual!r} does not replay"
            )
        if tolerance is not None and cache is None:
            raise SeqkvError("tolerance needs a cache: without one K/V are recomputed exactly")
        if limit is not None and (
            not isinstance(limit, int | float) or isinstance(limit, bool) or limit <= 0
        ):
            raise SeqkvError(f"max_relative_difference must be a number > 0, got {limit!r}")
        if len(ids) > self._lm.max_context:
            raise SeqkvError(
                f"session {sid!r} has {len(ids)} tokens, more than the model context "
                f"({self._lm.max_context})"
            )
        cap, how, diff, note, rel = self._capture(
            sid, ids, cache, residual, tolerance, (prompt_length, schedule), limit
        )
        if meta:
            cap.meta[USER_META_KEY] = meta
        coder = self._coder_with(tolerance)
        source = Source.from_capture(cap, coder if tolerance is not None else None)
        return sid, source, ids, how, diff, note, rel

    # -- internals ------------------------------------------------------------------------
    def _create(self, sources) -> int | None:
        """A new archive holding `sources`, published only if `path` still does not exist
        (a hard link never replaces a file): its size, or None when another writer won."""
        from seqkv_cli.fsutil import discard_quietly, publish, staging_name
        from seqkv_cli.skv.compress_trie import compress_sources

        tmp = staging_name(self.path, ".new.skv")
        try:
            result = compress_sources(sources, tmp, self._coder, False, self._lm, None)
            return result.file_bytes if publish(tmp, self.path, exclusive=True) else None
        finally:
            discard_quietly(tmp)

    def _open(self) -> None:
        if self._closed:
            raise SeqkvError(f"the archive {self.path} is closed")

    def _check_existing(self) -> None:
        """The file must be a trie archive of this model (checked before any work)."""
        from seqkv_cli.skv.identity import fingerprint_matches
        from seqkv_cli.skv.restore import Archive

        with Archive(self.path, model=self._lm) as arc:
            if arc.trie is None:
                raise SeqkvError(
                    f"{self.path} keeps sessions separately (flat layout); convert it with "
                    "`seqkv archive compact` first"
                )
            want = arc.model.get("fingerprint", "?")
            if not fingerprint_matches(want, self._lm.fingerprint):
                raise SeqkvError(
                    f"{self.path} holds sessions of model {arc.model.get('name', '?')} "
                    f"(fingerprint {want[:16]}); the model given has {self._lm.fingerprint[:16]} "
                    "(same weights, dtype and tokenizer are needed)"
                )
            self._coder = arc.codec  # the file's own codec decides how sessions are coded

    def _coder_with(self, tolerance):
        if tolerance is None:
            return self._coder
        if not isinstance(tolerance, int | float) or isinstance(tolerance, bool) or tolerance <= 0:
            raise SeqkvError(f"tolerance must be a number > 0, got {tolerance!r}")
        return type(self._coder).from_config({**self._coder.get_config(), "tolerance": tolerance})

    def _capture(self, sid, ids, cache, residual, tolerance, how_filled, limit=None):
        """The capture to store (the canonical run's tokens and surprisal, the K/V to keep),
        how `load` will rebuild it, its distance from the user's cache, and a note."""
        from seqkv_cli.api import replay as rp
        from seqkv_cli.api.caches import cache_dtype_name, cache_kv
        from seqkv_cli.kvcapture.engine import run_capture
        from seqkv_cli.skv.verify import max_abs_error

        lm = self._lm

        def canonical(dtype: str):
            cap = run_capture(lm, ids, dtype=dtype, numerics=self._coder.numerics)
            cap.meta["session_id"] = sid
            return cap

        if cache is None:
            if how_filled != (None, None):
                raise SeqkvError("prompt_length and schedule describe a cache; none was given")
            return canonical("bf16"), "recomputed", None, None, None
        if residual == "none":  # only the dtype is kept; the cache may be partial
            cap = canonical(cache_dtype_name(cache))
            return cap, "recomputed", _partial_difference(cache, cap), None, None
        shapes = {
            "num_layers": lm.num_layers,
            "num_kv_heads": lm.num_kv_heads,
            "head_dim": lm.head_dim,
        }
        keys, values, dtype = cache_kv(cache, len(ids), shapes)
        cap = canonical(dtype)
        diff = max_abs_error(cap, SimpleNamespace(keys=keys, values=values))
        rel, layer = relative_difference(keys, values, cap.keys, cap.values)
        if limit is not None and rel > limit:
            raise SeqkvError(
                f"session {sid!r}: its cache is {rel:.3g} away from this model's "
                f"recompute (relative, layer {layer}; at most {limit:g} allowed): a cache "
                f"of another model? (this one is {lm.name}, fingerprint "
                f"{lm.fingerprint[:16]})"
            )
        note = None
        if residual in ("auto", "replay"):
            schedule = rp.Schedule.for_tokens(len(ids), *how_filled)
            rec = rp.make_record(self._runner, schedule, dtype, rp.cache_digest(keys, values))
            if rp.reproduced(self._runner, ids, rec) is not None:
                cap.meta["replay"] = rec  # K/V stay canonical: the record rebuilds the cache
                return cap, "replay", diff, None, rel
            note = (
                f"replay did not reproduce the cache (schedule of {len(schedule.calls)} "
                "forward calls; pass prompt_length= for a generate() cache, schedule= for one "
                "continued from a loaded cache)"
            )
            if residual == "replay":
                raise SeqkvError(f"session {sid!r}: {note}")
        cap.keys, cap.values = keys, values
        cap.meta["numeric_path"] = "user-cache"
        return cap, ("within EPS" if tolerance is not None else "exact"), diff, note, rel

    def _verify(self, sid, cap, coder) -> None:
        from seqkv_cli.skv.verify import check_restored

        check_restored(cap, self.load_capture(sid), coder, f"stored in {self.path} anyway")


def open_archive(path, model=None, *, tokenizer=None, codec="seq", numerics=None):
    """Open (or, on the first `add`, create) a trie archive of `model`'s sessions.

    `model`: a transformers PreTrainedModel, a folder or `.gguf` path, or None for the
    embedded default. A model object is fingerprinted (weights, config and `tokenizer`, or the
    tokenizer saved beside it); the archive refuses a different one. `codec` applies to a new
    file (an existing file keeps its own)."""
    return MemoryArchive(path, model, tokenizer=tokenizer, codec=codec, numerics=numerics)


_ADD_FIELDS = {
    "session_id",
    "input_ids",
    "cache",
    "residual",
    "tolerance",
    "prompt_length",
    "schedule",
    "meta",
    "max_relative_difference",
}
USER_META_KEY = "meta"  # where a session's `add(meta=...)` is kept in its capture metadata


def check_meta(meta) -> dict:
    """`add(meta=...)`: a dict of JSON-plain values (what the archive index can hold)."""
    import json

    if meta is None:
        return {}
    if not isinstance(meta, dict) or not all(isinstance(k, str) for k in meta):
        raise SeqkvError("meta must be a dict with string keys")
    for key, value in meta.items():
        if not isinstance(value, str | int | float | dict) or value is None:
            raise SeqkvError(
                f"meta[{key!r}] is {type(value).__name__}; values must be str, int, float, "
                "bool or dict"
            )
    try:
        text = json.dumps(meta, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise SeqkvError(f"meta is not JSON-plain: {exc}") from None
    if len(text) > 65536:
        raise SeqkvError(f"meta is {len(text)} bytes of JSON; at most 65,536")
    return json.loads(text)


def relative_difference(keys, values, canon_keys, canon_values) -> tuple[float, int]:
    """The worst layer's ‖cache - canonical‖ / ‖canonical‖ over K and V, and that layer."""
    worst, at = 0.0, 0
    for i, (k, v, ck, cv) in enumerate(zip(keys, values, canon_keys, canon_values, strict=True)):
        num = sum(float((a.double() - b.double()).norm()) ** 2 for a, b in ((k, ck), (v, cv)))
        den = sum(float(b.double().norm()) ** 2 for b in (ck, cv))
        rel = (num / den) ** 0.5 if den > 0 else (0.0 if num == 0 else float("inf"))
        if rel > worst:
            worst, at = rel, i
    return worst, at


def check_session_id(session_id) -> str:
    if not isinstance(session_id, str) or not session_id:
        raise SeqkvError(f"a session id must be a non-empty string, not {session_id!r}")
    if len(session_id) > MAX_ID_CHARS or any(ord(c) < 32 or ord(c) == 127 for c in session_id):
        raise SeqkvError(
            f"session id {session_id[:40]!r}: at most {MAX_ID_CHARS} characters, "
            "no control characters"
        )
    return session_id


def token_list(input_ids, vocab_size: int) -> list[int]:
    """Token ids from a list, a 1-D tensor/array, or a (1, n) batch."""
    import numpy as np

    arr = input_ids.detach().cpu().numpy() if isinstance(input_ids, torch.Tensor) else input_ids
    try:
        arr = np.asarray(arr)
    except (TypeError, ValueError):
        raise SeqkvError("input_ids must be a list of ints, a tensor or an array") from None
    if arr.ndim == 2 and arr.shape[0] == 1:
        arr = arr[0]
    if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
        raise SeqkvError(
            f"input_ids must be one sequence of integer ids (n,) or (1, n), got shape "
            f"{tuple(arr.shape)} of {arr.dtype}"
        )
    if arr.size == 0:
        raise SeqkvError("input_ids is empty: nothing to store")
    low, high = int(arr.min()), int(arr.max())
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        raise SeqkvError(f"token id {bad} is outside the model's vocabulary (0..{vocab_size - 1})")
    return [int(t) for t in arr]


def _partial_difference(cache, cap) -> float | None:
    """residual='none': how far the user's cache is from what `load` will return, over the
    positions each layer of it holds (the last ones, for a sliding window)."""
    from seqkv_cli.api.caches import cache_layers

    worst = 0.0
    for (k, v), ck, cv in zip(cache_layers(cache), cap.keys, cap.values, strict=False):
        if k.dim() != 4 or v.dim() != 4 or k.shape[0] != 1:
            return None
        n = k.shape[-2]
        if n > ck.shape[1] or k.shape[1] != ck.shape[0]:
            return None
        for mine, canon in ((k[0], ck[:, ck.shape[1] - n :]), (v[0], cv[:, cv.shape[1] - n :])):
            if mine.shape != canon.shape:
                return None
            diff = (mine.detach().cpu().double() - canon.double()).abs().max()
            worst = max(worst, float(diff))
    return worst
