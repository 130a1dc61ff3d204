"""Threads that take a kernel's ranges of tasks within microseconds (`kernels._run`).

A step is some hundred native calls of a fraction of a millisecond each, so handing half of
one to another thread must cost far less than that. A thread that sleeps on a lock or a
queue costs a wake-up, which on a small VM made two threads slower than one (measured in
docs/BENCHMARKS_LOG.md, "The exact step"). These workers wait for a job by spinning in native
code that holds no GIL, on a sequence number in memory, for a while after a step's job; only
then do they park on a condition (the next job wakes them the slow way). No side should sleep
on the GIL the other holds: the caller posts from a native call and then enters its own range,
a worker that sees a job spins a moment longer before it takes the GIL (the caller is then in
native code), and reports done from inside the native call it waits in.

Imported on first use (it compiles its numba functions). A fork forgets the workers; a second
caller while the workers are busy runs its call alone; `close` ends them.
"""

from __future__ import annotations

import itertools
import sys
import threading

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

_POSTED, _DONE = 0, 8  # indices into a board: the two sequence numbers, 64 bytes apart
# Loads a worker spins for the next job before it parks after a job of a step (about a
# millisecond: a step's products follow each other closer than that); after other jobs (a
# prefill's tiles, between BLAS products that want the core) it parks at once.
_SPINS = 1 << 21
# Loads a worker spins after a job is posted before it takes the GIL for it: time for the
# caller to enter its own range's native call (a thread that waits for the GIL sleeps on it).
_GRACE = 1 << 14
_flags = {"cache": True, "nogil": True}
_YIELD_EVERY = 1 << 12  # loads between offers of the core to another runnable thread


# Offers the core to another runnable thread (a spin must not hold it where more threads than
# cores run: two processes at once): the C library's, or Windows' own.
_YIELD_SYMBOL = "SwitchToThread" if sys.platform == "win32" else "sched_yield"


@intrinsic
def _yield(typingctx):
    def codegen(context, builder, sig, args):
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.IntType(32), []), _YIELD_SYMBOL
        )
        builder.call(fn, [])
        return context.get_dummy_value()

    return types.none(), codegen


def _slot(context, builder, arrty, arr, index):
    return builder.gep(context.make_array(arrty)(context, builder, arr).data, [index])


@intrinsic
def _load(typingctx, arr, i):
    """arr[i] of an int64 array, as an acquire load: re-read every time (a spin can end)."""

    def codegen(context, builder, sig, args):
        return builder.load_atomic(_slot(context, builder, sig.args[0], *args), "acquire", 8)

    return types.int64(arr, types.intp), codegen


@intrinsic
def _store(typingctx, arr, i, v):
    """arr[i] = v as a release store: what was written before is seen before it."""

    def codegen(context, builder, sig, args):
        at = _slot(context, builder, sig.args[0], args[0], args[1])
        builder.store_atomic(builder.sext(args[2], ir.IntType(64)), at, "release", 8)
        return context.get_dummy_value()

    return types.none(arr, types.intp, types.int64), codegen


@njit(**_flags)
def _post(board, seq):
    _store(board, _POSTED, seq)


@njit(**_flags)
def _wait_done(board, seq):
    spins = 0
    while _load(board, _DONE) != seq:
        spins += 1
        if spins % _YIELD_EVERY == 0:
            _yield()


@njit(**_flags)
def _done_and_wait(board, done, last, spins):
    """Report job ``done``, then spin for a job after ``last`` (looking at least once): its
    number, or -1."""
    _store(board, _DONE, done)
    for i in range(max(spins, 1)):
        seq = _load(board, _POSTED)
        if seq != last:
            for _ in range(_GRACE):
                _load(board, _POSTED)
            return seq
        if i % _YIELD_EVERY == _YIELD_EVERY - 1:
            _yield()
    return -1


class _Worker:
    def __init__(self) -> None:
        self.board = np.zeros(16, dtype=np.int64)
        self.job: tuple = ()
        self.error: BaseException | None = None
        self.parked = self.stopped = False
        self.wake = threading.Condition()
        self.thread = threading.Thread(target=self._loop, name="seqkv-kernel", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        done = last = spins = 0
        while True:
            seq = _done_and_wait(self.board, done, last, spins)
            if seq < 0:  # idle: park until the next job (checked under the lock: none lost)
                with self.wake:
                    self.parked = True
                    while self.board[_POSTED] == last:
                        self.wake.wait()
                    self.parked = False
                continue
            if self.stopped:
                return
            kernel, args, first, stop, linger = self.job
            try:
                kernel(*args, first, stop)
            except BaseException as exc:  # the caller raises it
                self.error = exc
            self.job = ()  # hold no array of the job past it
            done = last = seq
            spins = _SPINS if linger else 0

    def post(self, seq: int, kernel, args: tuple, first: int, stop: int, linger: bool) -> None:
        self.job = (kernel, args, first, stop, linger)
        _post(self.board, seq)
        if self.parked:  # after an idle millisecond: woken the slow way
            with self.wake:
                self.wake.notify()

    def stop(self, seq: int) -> None:
        self.stopped = True
        self.post(seq, None, (), 0, 0, False)

    def join(self, seq: int) -> BaseException | None:
        """Wait for job ``seq``; the error it raised, if any."""
        _wait_done(self.board, seq)
        error, self.error = self.error, None
        return error


class Workers:
    """``n`` spinning worker threads besides the caller's."""

    def __init__(self, n: int) -> None:
        self.workers = [_Worker() for _ in range(n)]
        self.seq = 0
        self.busy = threading.Lock()

    def close(self) -> None:
        """End the threads, once a caller still running on them is done."""
        with self.busy:
            self.seq += 1
            for worker in self.workers:
                worker.stop(self.seq)

    def run(self, kernel, args: tuple, bounds: list[int], linger: bool = False) -> None:
        """``kernel(*args, bounds[i], bounds[i + 1])`` for every range: the first on the
        caller, the others on the workers, all done when it returns (or raises). With
        `linger` the workers spin for the next job a while before they park."""
        if not self.busy.acquire(blocking=False):  # another caller has the workers
            kernel(*args, bounds[0], bounds[-1])
            return
        try:
            self.seq += 1
            ranges = list(itertools.pairwise(bounds[1:]))
            posted = self.workers[: len(ranges)]
            for worker, (first, stop) in zip(posted, ranges, strict=True):
                worker.post(self.seq, kernel, args, first, stop, linger)
            try:
                kernel(*args, bounds[0], bounds[1])
            finally:  # every worker done before anything is raised
                errors = [worker.join(self.seq) for worker in posted]
            error = next((e for e in errors if e is not None), None)
            if error is not None:
                raise error
        finally:
            self.busy.release()
