"""The CUDA kernels of the GPU entropy coder, as Python functions numba compiles on first use.

`rans_cuda` compiles and launches them (docs/format/ENTROPY_STREAM.md, "On a GPU"); the per-lane
work is `lanes`, compiled here as device functions. Importing this module imports
``numba.cuda`` (which must happen after NUMBA_ENABLE_CUDASIM is set, for the simulator) but
compiles nothing: the kernels stay plain functions so that a test can compile them to PTX on a
machine with a CUDA toolkit and no GPU. ``cuda`` is a module global here, as numba's simulator
needs in order to run the same functions on the CPU.
"""

from __future__ import annotations

from numba import cuda, int32, int64

from seqkv_codecs.entropy import lanes as lane_code
from seqkv_codecs.entropy.geometry import HIST_SHARED, MAX_PER_THREAD, MAX_THREADS, TILE_ITEMS

# the decode kernel's types, compiled up front (its grid size needs the compiled kernel);
# S is the symbol type, uint8 or uint16
DECODE_SIGNATURE = (
    "int64[::1], uint16[::1], int64, S[::1], int64[::1], int64, int64, int64, int64, int64, "
    "S[::1], int64[:, ::1], int64[::1]"
)

encode_lane = cuda.jit(device=True)(lane_code.encode_lane)
load_lanes = cuda.jit(device=True)(lane_code.load_lanes)
decode_lanes = cuda.jit(device=True)(lane_code.decode_lanes)
refill_lanes = cuda.jit(device=True)(lane_code.refill_lanes)
lanes_finished = cuda.jit(device=True)(lane_code.lanes_finished)


@cuda.jit(device=True)
def smaller(a, b):
    # the builtin min() of two integers does not compile in numba 0.68's CUDA target
    return a if a < b else b


@cuda.jit(device=True)
def block_scan(value, buf, tid, nthreads):
    """Exclusive prefix of ``value`` over the block's threads, and the block's total.
    Every thread of the block calls it (it synchronises the block)."""
    buf[tid] = value
    cuda.syncthreads()
    d = 1
    while d < nthreads:
        add = 0
        if tid >= d:
            add = buf[tid - d]
        cuda.syncthreads()
        buf[tid] += add
        cuda.syncthreads()
        d *= 2
    inclusive = buf[tid]
    total = buf[nthreads - 1]
    cuda.syncthreads()  # the buffer is free again for the next scan
    return inclusive - value, total


def histogram(sym, n, alphabet, counts, status):
    """Add the symbol counts of a grid-stride share of ``sym`` to ``counts``; flag
    ``status[0]`` for a symbol outside the alphabet (the host then names the range)."""
    local = cuda.shared.array(HIST_SHARED, int32)
    tid = cuda.threadIdx.x
    small = alphabet <= HIST_SHARED
    if small:
        for s in range(tid, alphabet, cuda.blockDim.x):
            local[s] = 0
    cuda.syncthreads()
    for i in range(cuda.grid(1), n, cuda.gridsize(1)):
        s = sym[i]
        if s < 0 or s >= alphabet:
            status[0] = 1
        elif small:
            cuda.atomic.add(local, s, 1)
        else:
            cuda.atomic.add(counts, s, 1)
    cuda.syncthreads()
    if small:
        for s in range(tid, alphabet, cuda.blockDim.x):
            if local[s]:
                cuda.atomic.add(counts, s, local[s])


def encode(sym, n, lanes, table, shift, total, flags, low, states):
    """One thread per lane: its final state, and every symbol's flag and word."""
    lane = cuda.grid(1)
    if lane < lanes:
        states[lane] = encode_lane(sym, n, lanes, lane, table, shift, total, flags, low)


def count(flags, n, chunk, chunk_counts):
    """One block per chunk of ``chunk`` symbols: how many of them emitted a word."""
    buf = cuda.shared.array(MAX_THREADS, int64)
    tid = cuda.threadIdx.x
    start = cuda.blockIdx.x * chunk
    stop = smaller(start + chunk, n)
    c = 0
    for i in range(start + tid, stop, cuda.blockDim.x):
        c += flags[i]
    _, chunk_total = block_scan(c, buf, tid, cuda.blockDim.x)
    if tid == 0:
        chunk_counts[cuda.blockIdx.x] = chunk_total


def scan(values, m, total_out):
    """Exclusive prefix sum of ``values[:m]`` in place, by one block."""
    buf = cuda.shared.array(MAX_THREADS, int64)
    tid = cuda.threadIdx.x
    nthreads = cuda.blockDim.x
    per = (m + nthreads - 1) // nthreads
    lo = smaller(tid * per, m)
    hi = smaller(lo + per, m)
    s = 0
    for i in range(lo, hi):
        s += values[i]
    run, grand = block_scan(s, buf, tid, nthreads)
    for i in range(lo, hi):
        v = values[i]
        values[i] = run
        run += v
    if tid == 0:
        total_out[0] = grand


def scatter(flags, low, n, chunk, offsets, words):
    """One block per chunk: its words, in symbol order, from the chunk's offset on (tile by
    tile: a scan of the threads' counts places each thread's words)."""
    buf = cuda.shared.array(MAX_THREADS, int64)
    tid = cuda.threadIdx.x
    nthreads = cuda.blockDim.x
    start = cuda.blockIdx.x * chunk
    stop = smaller(start + chunk, n)
    pos = offsets[cuda.blockIdx.x]
    for base in range(start, stop, nthreads * TILE_ITEMS):  # the same trips in every thread
        lo = smaller(base + tid * TILE_ITEMS, stop)
        hi = smaller(lo + TILE_ITEMS, stop)
        c = 0
        for i in range(lo, hi):
            c += flags[i]
        w, tile_total = block_scan(c, buf, tid, nthreads)
        w += pos
        for i in range(lo, hi):
            if flags[i]:
                words[w] = low[i]
                w += 1
        pos += tile_total


def fill(out, n, value):
    """A stream of one distinct symbol has no lanes: every output is that symbol."""
    i = cuda.grid(1)
    if i < n:
        out[i] = value


def decode(states, words, n_words, slot_sym, slot_packed, precision, lanes, steps, last,
           per_thread, out, block_counts, status):  # fmt: skip
    """Every step of every lane, cooperatively (launched with all blocks resident): decode,
    count the words wanted, find where they start (grid barrier), refill. ``status``: [0] the
    words ran out, [1] a lane did not end at 2**16, [2] words read (docs/format/ENTROPY_STREAM.md,
    "Decoder checks")."""
    tid = cuda.threadIdx.x
    b = cuda.blockIdx.x
    nthreads = cuda.blockDim.x
    nblocks = cuda.gridDim.x
    grid = cuda.cg.this_grid()
    buf = cuda.shared.array(MAX_THREADS, int64)
    x = cuda.local.array(MAX_PER_THREAD, int64)
    need = cuda.local.array(MAX_PER_THREAD, int64)
    first = (b * nthreads + tid) * per_thread
    owned = smaller(per_thread, lanes - first) if first < lanes else 0
    load_lanes(states, first, owned, x)
    mask = (1 << precision) - 1
    pos = 0
    for t in range(steps):
        active = last if t == steps - 1 else lanes
        wanting = decode_lanes(
            t, lanes, active, first, owned, x, need, slot_sym, slot_packed, mask,
            precision, out,
        )  # fmt: skip
        offset, block_total = block_scan(wanting, buf, tid, nthreads)
        row = t & 1  # two rows: a block writes row t & 1 again only after barrier t + 1
        if tid == 0:
            block_counts[row, b] = block_total
        grid.sync()
        # the words of the blocks before this one (low half) and of the whole step (high
        # half): per-step counts are below 2**31, one scan sums both
        part = 0
        for i in range(tid, nblocks, nthreads):
            c = block_counts[row, i]
            part += c << 32
            if i < b:
                part += c
        _, sums = block_scan(part, buf, tid, nthreads)
        if not refill_lanes(owned, x, need, words, pos + (sums & 0xFFFFFFFF) + offset,
                            n_words):  # fmt: skip
            status[0] = 1
        pos += sums >> 32
    if not lanes_finished(owned, x):
        status[1] = 1
    if b == 0 and tid == 0:
        status[2] = pos
