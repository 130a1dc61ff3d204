"""`seqkv.open_archive`: keep a model's sessions in one `.skv` trie archive from Python.

    with seqkv.open_archive("memory.skv", model=model) as arc:
        arc.add("chat-42", input_ids, cache=out.past_key_values)
        cache = arc.load("chat-42")          # a DynamicCache, bit for bit the one added

An archive holds sessions of one model. `add` appends a segment (nothing committed is
rewritten; a crash leaves the file as it was) and shares every prefix already stored, so a
growing session costs only its new tokens. The first `add` creates the file.

This module is the archive object, a face: it has `add`'s arguments made into sources
(arguments.py) and hands back reports (reports.py); checking the file and the model, creating
the file only where none exists, adding, listing, loading by replay and verifying are the
archive package's (`seqkv_cli.archive`), which the CLI uses too.
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from seqkv_cli.api.arguments import (
    Loaded,
    PreparedSession,
    add_arguments,
    check_session_id,
    generated_arguments,
    prepare_session,
    stored_meta,
)
from seqkv_cli.api.reports import AddReport, SessionInfo, Written, session_infos
from seqkv_cli.archive import (
    Archive,
    add_sources,
    appendable_codec,
    check_added,
    compress_sources,
    memory_codec,
    replay_schedule,
    session_kv,
    session_rows,
)
from seqkv_cli.errors import SeqkvError
from seqkv_cli.kvcapture.caches import to_cache
from seqkv_cli.sequential.load_modes import check_mode, mode_codec
from seqkv_cli.trie import WarmStates

if TYPE_CHECKING:
    from seqkv_cli.runtime.loading import LoadedModel

# The caches `load` handed out and how each was filled. A cache continued by generate() and
# given back to `add` with its prompt length then needs no hand-built schedule. Weak: a cache
# the caller drops is forgotten.
_LOADED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class MemoryArchive:
    """An archive opened for adding and loading sessions (see `open_archive`)."""

    def __init__(
        self,
        path: str | Path,
        model: str | Path | LoadedModel | torch.nn.Module | None = None,
        *,
        tokenizer: object = None,
        codec: str | dict = "seq",
        numerics: str | None = None,
        load: str | None = None,
    ) -> None:
        from seqkv_cli.runtime.loading import resolve_model

        self.path = Path(path)
        if self.path.exists() and not self.path.is_file():
            raise SeqkvError(f"{self.path} is not a file")
        self._coder = memory_codec(codec, numerics)
        self._load = None if load is None else check_mode(load)
        # the canonical state of the session this handle added last: a turn that extends it
        # runs only its new tokens (held until the next add or close)
        self._warm = WarmStates()
        self._lm = resolve_model(model, tokenizer=tokenizer)
        # Replay runs the user's own object (their dtype, device, attention), not seqkv's copy.
        self._own_model = model if hasattr(model, "state_dict") else None
        self._closed = False
        if self.path.is_file():
            self._coder = appendable_codec(self.path, self._lm)  # the file's codec decides

    @property
    def _runner(self):
        """What a replay record is run with: the user's own model object, or seqkv's loaded
        model with its fp32 weights (made only when a replay needs them)."""
        return self._own_model if self._own_model is not None else self._lm.fp32_model()

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
        self._warm.clear()

    # -- reading --------------------------------------------------------------------------
    def sessions(self) -> list[SessionInfo]:
        """Every session: id, tokens, bytes of its own, positions shared with others, and how
        `load` rebuilds its K/V."""
        self._open()
        return session_infos(session_rows(self.path)[0]) if self.path.is_file() else []

    def __contains__(self, session_id: str) -> bool:
        return any(s.id == session_id for s in self.sessions())

    def __len__(self) -> int:
        return len(self.sessions())

    def load_capture(self, session_id: str):
        """The session as a `Capture`: tokens, K/V per layer, surprisal, metadata."""
        with Archive(self._file(), model=self._lm) as arc:
            return arc.restore(arc.session(str(session_id)))

    def tokens(self, session_id: str) -> list[int]:
        return self.load_capture(session_id).tokens.tolist()

    def schedule(self, session_id: str) -> list[int] | None:
        """The forward calls (token counts) that filled a replayed session's cache; None for
        a session without a replay record. A cache continued from `load(session_id)` was
        filled by this schedule plus the continuation's calls."""
        return replay_schedule(index_entry(self._file(), session_id))

    def meta(self, session_id: str) -> dict:
        """The metadata `add(meta=...)` stored with the session ({} if none); read from the
        index, no token is decoded."""
        return stored_meta(index_entry(self._file(), session_id))

    def load(
        self,
        session_id: str,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        replay: bool = True,
    ):
        """The session's cache as a `DynamicCache(config=model.config)`, ready for
        `model(..., past_key_values=cache)` or `model.generate(..., past_key_values=cache)`.

        K/V come back in the dtype they were added in (the user's cache, bit for bit, for a
        session added with its cache) unless `dtype` says otherwise, on the model's device
        unless `device` says otherwise. A
        session stored for replay re-runs the model it was added with and is checked against
        its digest; `replay=False` gives the canonical K/V instead. A replayed session stored
        with `load="fast"` is read without running seqkv's model: the replay is the load."""
        keys, values, positions, calls = session_kv(
            self._file(), self._lm, lambda: self._runner, session_id, replay
        )
        if device is None:  # the model's device, without making seqkv's model fp32 for it
            from seqkv_cli.runtime.devices import model_device

            own = self._own_model
            device = model_device(own if own is not None else self._lm.module)
        cache = to_cache(keys, values, self._lm.config, dtype=dtype, device=device)
        _LOADED[cache] = Loaded.of(positions, calls)
        return cache

    # -- writing --------------------------------------------------------------------------
    def add(
        self,
        session_id: str,
        input_ids: object,
        cache: object = None,
        *,
        residual: str = "auto",
        tolerance: float | None = None,
        prompt_length: int | None = None,
        schedule: list[int] | None = None,
        verify: bool = False,
        meta: dict | None = None,
        max_relative_difference: float | None = None,
        load: str | None = None,
    ) -> AddReport:
        """Store a session: its token ids and, with `cache`, what makes `load` return it.

        `input_ids` may be what `model.generate(..., return_dict_in_generate=True)` returned:
        its sequences (the tokens its cache covers) and its cache are taken from it. A cache
        that `load` gave and generate() continued needs only `prompt_length` (the ids given
        to generate): the schedule is the loaded session's plus the continuation's.

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
        `load`: "small" (tokens coded under the model: fewest bytes, a load steps the model
        once a token) or "fast" (a static table of the turn's tokens: more bytes, a load reads
        them and needs one prefill, or only the replay); default: `open_archive`'s `load`,
        else the archive's own codec.
        """
        # One session of add_many: this call's arguments by name (all but self, verify, load).
        item = {name: value for name, value in locals().items() if name in _ADD_DEFAULTS}
        return self.add_many([item], verify=verify, load=load)[0]

    def add_many(
        self,
        sessions: Iterable[Mapping[str, object]],
        *,
        verify: bool = False,
        load: str | None = None,
    ) -> list[AddReport]:
        """Store several sessions in one append (one segment: cheaper than one `add` each,
        and one commit: all of them or none). Each item is a mapping of `add`'s arguments by
        name (`session_id`, `input_ids`, and optionally `cache`, `residual`, `tolerance`,
        `prompt_length`, `schedule`, `meta`, `max_relative_difference`); `load` is the whole
        append's. Every report's `added_bytes` is what the whole batch added."""
        self._open()
        load = self._load if load is None else check_mode(load)
        items = [dict(item) for item in sessions]
        if not items:
            raise SeqkvError("add_many: no sessions given")
        known = {s.id for s in self.sessions()} if self.path.is_file() else set()
        prepared: list[PreparedSession] = []
        for item in items:
            args = generated_arguments(add_arguments(item, _ADD_DEFAULTS), _loaded)
            sid = check_session_id(args["session_id"])
            if sid in known:
                raise SeqkvError(
                    f"{self.path} already has a session {sid!r}; ids must be unique"
                    if sid not in {p.session_id for p in prepared}
                    else f"session {sid!r} is given twice"
                )
            known.add(sid)
            prepared.append(prepare_session(self._lm, self._runner, self._coder, sid, args))
        written = self._store([p.source for p in prepared], load)
        for p in prepared if verify else ():
            check_added(self._file(), self._lm, p.source, p.source.coder_for(self._coder))
        return [AddReport.of(p, written, len(prepared)) for p in prepared]

    def compact(self, load: str | None = None, layout: str = "auto") -> int:
        """Rewrite the archive as one trie, as `seqkv archive compact` does, and return its
        new size. A tokens-only memory becomes a compact archive (format 1.8) whose chains of
        turns are single nodes: a few bytes a turn beyond its coded tokens, without capture
        provenance (`layout="trie"` keeps the full layout). `load` ("small", "fast") codes
        every session that way. Every session is restored bit for bit from the new file before
        it replaces the old one; the next `add` rewrites it in the full layout once."""
        from seqkv_cli.archive import compact

        result = compact(self._file(), model=self._lm, load=load, layout=layout)
        return result.file_bytes

    # -- internals ------------------------------------------------------------------------
    def _store(self, sources, load: str | None = None) -> Written:
        """Append `sources` to the archive (in load mode `load`), or create it with them."""
        if not self.path.is_file():
            created = self._create(sources, load)
            if created is not None:
                return Written(created, created, None)
            # another writer created the file meanwhile: append to it
            self._coder = appendable_codec(self.path, self._lm)
        result = add_sources(self.path, sources, self._lm, load=load, warm=self._warm)
        return Written(result.added_bytes, result.file_bytes, result.new_tokens)

    def _create(self, sources, load: str | None = None) -> int | None:
        """A new archive holding `sources`, published only if `path` still does not exist
        (a hard link never replaces a file): its size, or None when another writer won. Its
        codec is the one `load` asks for (the archive's default for later adds)."""
        coder = self._coder if load is None else mode_codec(self._coder, load)
        result = compress_sources(sources, self.path, coder, False, self._lm, None, exclusive=True)
        return None if result is None else result.file_bytes

    def _open(self) -> None:
        if self._closed:
            raise SeqkvError(f"the archive {self.path} is closed")

    def _file(self) -> Path:
        """The archive's file, for a question about one session (none before the first add)."""
        self._open()
        if not self.path.is_file():
            raise SeqkvError(f"{self.path} has no sessions yet")
        return self.path


def open_archive(
    path: str | Path,
    model: str | Path | LoadedModel | torch.nn.Module | None = None,
    *,
    tokenizer: object = None,
    codec: str | dict = "seq",
    numerics: str | None = None,
    load: str | None = None,
):
    """Open (or, on the first `add`, create) a trie archive of `model`'s sessions.

    `model`: a transformers PreTrainedModel, a folder or `.gguf` path, or None for the
    embedded default. A model object is fingerprinted (weights, config and `tokenizer`, or the
    tokenizer saved beside it); the archive refuses a different one. `codec` applies to a new
    file (an existing file keeps its own). `load` ("small" or "fast") is how this handle's
    `add`s store their sessions (docs/AGENT_MEMORY.md, "Load time or bytes"); None keeps the
    archive's own codec."""
    return MemoryArchive(
        path, model, tokenizer=tokenizer, codec=codec, numerics=numerics, load=load
    )


def _loaded(cache: object) -> Loaded | None:
    """How a cache `load` gave was filled; None for any other object (or one that cannot be
    weakly referenced, which `load` never gives)."""
    try:
        return _LOADED.get(cache)
    except TypeError:
        return None


# `add_many` takes `add`'s arguments by name, with `add`'s defaults: one list, add()'s own.
_ADD_DEFAULTS = {
    name: parameter.default
    for name, parameter in inspect.signature(MemoryArchive.add).parameters.items()
    if name not in ("self", "verify", "load")
}


def index_entry(path: Path, session_id: str) -> dict:
    """One session's index entry (a one-line error for an id the archive does not hold)."""
    with Archive(path) as arc:
        return arc.session(str(session_id))
