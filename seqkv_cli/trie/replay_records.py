"""Replay records in binary, inside a version-2 segment table (format 1.9; docs/FORMAT.md,
"Binary replay records").

A replay record (archive/replay.py) says how a user's cache was computed: the forward calls'
token counts, the cache dtype, the model's dtype, device and attention implementation, the
library versions, and a digest of every K/V tensor. As JSON it cost ~300 bytes a session, and
an agent's turn repeats all of it but the digest and a few calls. Here each record stores what
is new: the environment only where it differs from the record before it in the archive, the
schedule as the calls after those of a session it continues (a *parent*, found by counting
back), and the digest as 16 raw bytes (a replay that does not reproduce the cache passes with
odds 2^-128; nobody chooses the bytes a replay produces, so a collision is never searched).

A record lives in the table as its session's `extra["replay"]` dict, as the JSON one does, so
everything above the table reads either form the same way. `ReplayContext` is what a record
is written against and read with (the archive's records before it); writer and reader fold it
over the same decoded dicts (`then`), so they agree on every reference.
"""

from __future__ import annotations

from dataclasses import dataclass

from seqkv_cli.errors import SeqkvError

RECORD_VERSION = 1  # the record's own version (the JSON key "version")
ENVIRONMENT = ("model_dtype", "device", "attention", "torch", "transformers")
CACHE_DTYPES = ("bf16", "fp16", "fp32")
DIGEST_BYTES = 16
MAX_RUNS = 4096  # run-length pairs in one record's schedule (an agent turn adds two or three)
MAX_BACK = 64  # a parent is at most this many sessions before its child
MAX_TEXT = 64  # bytes of one environment string
# Runs that one archive's records may expand to in all: every session's schedule is built in
# memory when the archive is read, and a record of a few bytes may inherit 4,096 runs.
MAX_ARCHIVE_RUNS = 1 << 20

# A record's first byte (0: no record). CONTINUES: its parent is the session just before and
# all of that one's calls are its first (an agent's turn: no parent fields). STEPS: its own
# calls are one prefill and then single steps (`generate`'s schedule), written as two numbers.
HAS_RECORD, ENV_STORED, HAS_PARENT, CONTINUES, STEPS = 1, 2, 4, 8, 16
KNOWN_BITS = HAS_RECORD | ENV_STORED | HAS_PARENT | CONTINUES | STEPS

Runs = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class ReplayContext:
    """The records before a table: the last MAX_BACK sessions' schedules (None for a session
    without a binary-form record), the newest record's environment, and the runs read so far."""

    recent: tuple[Runs | None, ...] = ()
    environment: tuple[str, ...] | None = None  # (cache dtype, *ENVIRONMENT)
    runs_read: int = 0

    def then(self, record: object) -> ReplayContext:
        """The context after one more session whose replay record is `record` (or None)."""
        form = binary_form(record)
        runs = None if form is None else form[0]
        env = self.environment if form is None else form[1]
        read = self.runs_read + (0 if runs is None else len(runs))
        return ReplayContext((*self.recent, runs)[-MAX_BACK:], env, read)


NO_RECORDS = ReplayContext()


def binary_form(record: object) -> tuple[Runs, tuple[str, ...], bytes] | None:
    """(runs, environment, digest) of a record that a 1.9 table can hold, else None (kept as
    JSON): version 1, a schedule of positive runs, a known cache dtype, environment strings
    of at most MAX_TEXT bytes, a hex digest of at least DIGEST_BYTES bytes, nothing else."""
    if not isinstance(record, dict) or record.get("version") != RECORD_VERSION:
        return None
    if set(record) != {"version", "calls", "cache_dtype", "sha256", *ENVIRONMENT}:
        return None
    calls, digest = record["calls"], record["sha256"]
    if not isinstance(calls, list) or not 0 < len(calls) <= MAX_RUNS:
        return None
    if not all(
        isinstance(r, list | tuple) and len(r) == 2 and all(_count(x) for x in r) for r in calls
    ):
        return None
    env = (record["cache_dtype"], *(record[k] for k in ENVIRONMENT))
    if env[0] not in CACHE_DTYPES or not all(
        isinstance(s, str) and len(s.encode()) <= MAX_TEXT for s in env
    ):
        return None
    try:
        raw = bytes.fromhex(digest) if isinstance(digest, str) else b""
    except ValueError:
        return None
    if len(raw) < DIGEST_BYTES or raw.hex() != digest:
        return None
    return merged((), [tuple(r) for r in calls]), env, raw[:DIGEST_BYTES]


def _count(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 1


def merged(head: Runs, tail) -> Runs:
    """`head` followed by `tail`, adjacent runs of one call length joined."""
    out = [list(r) for r in head]
    for length, count in tail:
        if out and out[-1][0] == length:
            out[-1][1] += count
        else:
            out.append([length, count])
    return tuple((a, b) for a, b in out)


def total_calls(runs: Runs) -> int:
    return sum(count for _, count in runs)


def first_calls(runs: Runs, n: int) -> Runs:
    """The run-length form of the first `n` calls of `runs`."""
    out = []
    for length, count in runs:
        if n <= 0:
            break
        out.append((length, min(count, n)))
        n -= count
    return tuple(out)


def after_calls(runs: Runs, n: int) -> Runs:
    """The calls of `runs` after its first `n`."""
    out = []
    for length, count in runs:
        skip = min(n, count)
        n -= skip
        if count > skip:
            out.append((length, count - skip))
    return tuple(out)


def common_calls(a: Runs, b: Runs) -> int:
    """How many calls `a` and `b` begin with in common."""
    shared = 0
    for (la, ca), (lb, cb) in zip(a, b, strict=False):
        if la != lb:
            break
        shared += min(ca, cb)
        if ca != cb:
            break
    return shared


def encode_block(records: list[object], context: ReplayContext, out: bytearray, varint) -> None:
    """Every session's record (None: none, or one kept as JSON), written against `context`."""
    for record in records:
        form = binary_form(record)
        if form is None:
            out.append(0)
        else:
            _encode_one(form, context, out, varint)
        context = context.then(record)
        if context.runs_read > MAX_ARCHIVE_RUNS:  # its readers would refuse the file
            raise SeqkvError(
                f"this archive's replay schedules would expand to more than {MAX_ARCHIVE_RUNS} "
                "runs; keep further sessions in a new archive"
            )


def _encode_one(form, context: ReplayContext, out: bytearray, varint) -> None:
    runs, env, digest = form
    flags = HAS_RECORD | (ENV_STORED if env != context.environment else 0)
    parent, own = None, runs
    best = 0
    for back, before in enumerate(reversed(context.recent), start=1):
        shared = 0 if before is None else common_calls(before, runs)
        if shared > best:  # the nearest of the parents sharing the most calls
            best, parent = shared, (back, total_calls(before) - shared)
    if parent is not None:
        flags |= CONTINUES if parent == (1, 0) else HAS_PARENT
        own = after_calls(runs, best)
    steps = steps_form(own)
    flags |= STEPS if steps is not None else 0
    out.append(flags)
    if flags & ENV_STORED:
        out.append(CACHE_DTYPES.index(env[0]))
        for text in env[1:]:
            raw = text.encode()
            varint(len(raw), out)
            out += raw
    if flags & HAS_PARENT:
        varint(parent[0], out)
        varint(parent[1], out)
    if steps is not None:
        varint(steps[0], out)
        varint(steps[1], out)
    else:
        varint(len(own), out)
        for length, count in own:
            varint(length, out)
            varint(count, out)
    out += digest


def steps_form(own: Runs) -> tuple[int, int] | None:
    """(prefill tokens, single steps after it) where `own` is one call and then single
    steps, else None."""
    if not own:
        return None
    rest = after_calls(own, 1)
    if any(length != 1 for length, _ in rest):
        return None
    return own[0][0], total_calls(rest)


def decode_block(r, n_sessions: int, context: ReplayContext) -> list[dict | None]:
    """Every session's record as the dict the JSON form holds (`r`: a tables._Reader)."""
    records: list[dict | None] = []
    for _ in range(n_sessions):
        record = _decode_one(r, context)
        records.append(record)
        context = context.then(record)
        if context.runs_read > MAX_ARCHIVE_RUNS:
            raise r.fail(f"its replay schedules expand to more than {MAX_ARCHIVE_RUNS} runs")
    return records


def _own_calls(r, flags: int) -> list[tuple[int, int]]:
    """The calls a record adds after its parent's, as runs."""
    if flags & STEPS:
        prefill, steps = r.varint(), r.varint()
        if prefill < 1:
            raise r.fail("a replay record has a forward call of no tokens")
        return [(prefill, 1)] + ([(1, steps)] if steps else [])
    n_runs = r.varint()
    if n_runs > MAX_RUNS:
        raise r.fail(f"a replay record holds more than {MAX_RUNS} runs")
    own = []
    for _ in range(n_runs):
        length, count = r.varint(), r.varint()
        if length < 1 or count < 1:
            raise r.fail("a replay record has a forward call of no tokens")
        own.append((length, count))
    return own


def _decode_one(r, context: ReplayContext) -> dict | None:
    flags = r.take(1)[0]
    if flags == 0:
        return None
    if flags & ~KNOWN_BITS:
        raise SeqkvError(
            f"{r.where}: a replay record uses features of a newer seqkv; upgrade seqkv"
        )
    if not flags & HAS_RECORD:
        raise r.fail("a replay record without its record bit")
    env = context.environment
    if flags & ENV_STORED:
        code = r.take(1)[0]
        if code >= len(CACHE_DTYPES):
            raise r.fail("a replay record names an unknown cache dtype")
        texts = []
        for _ in ENVIRONMENT:
            size = r.varint()
            if size > MAX_TEXT:
                raise r.fail("a replay record's environment string is too long")
            try:
                texts.append(r.take(size).decode("utf-8"))
            except UnicodeDecodeError:
                raise r.fail("a replay record's environment is not UTF-8") from None
        env = (CACHE_DTYPES[code], *texts)
    elif env is None:
        raise r.fail("a replay record inherits an environment no record before it stored")
    head: Runs = ()
    if flags & HAS_PARENT and flags & CONTINUES:
        raise r.fail("a replay record names its parent twice")
    if flags & (HAS_PARENT | CONTINUES):
        back, dropped = (r.varint(), r.varint()) if flags & HAS_PARENT else (1, 0)
        if not 1 <= back <= len(context.recent):
            raise r.fail(f"a replay record's parent is {back} sessions back, which is no session")
        parent = context.recent[-back]
        if parent is None:
            raise r.fail("a replay record's parent has no replay record")
        if dropped >= total_calls(parent):
            raise r.fail("a replay record drops more calls than its parent has")
        head = first_calls(parent, total_calls(parent) - dropped)
    runs = merged(head, _own_calls(r, flags))
    if not runs or len(runs) > MAX_RUNS:
        raise r.fail(f"a replay record's schedule is empty or over {MAX_RUNS} runs")
    digest = r.take(DIGEST_BYTES)
    return {
        "version": RECORD_VERSION,
        "calls": [list(run) for run in runs],
        "cache_dtype": env[0],
        "sha256": digest.hex(),
        **dict(zip(ENVIRONMENT, env[1:], strict=True)),
    }
