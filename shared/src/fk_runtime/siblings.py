"""Split rows: the programs that share one long row ("siblings") meet without a second launch.

A row too long for one program's registers is cut into chunks, one program each. Every sibling
reduces its chunk to a few fp32 partials (e.g. a max and a sum of exponentials, or a sum and a
centred sum of squares), publishes them, counts itself in on the row's arrival counter and waits
until the whole row has arrived; then it combines the partials in a fixed order (the same bits
every run) and writes its chunk from the registers it never left (or, when programs meet once
for a batch of rows, from a second read of the batch that L2 still holds). One read and one
write of HBM, as for rows that fit one program.

Waiting needs the siblings resident together. The GPU starts programs in launch order, so a row
of at most `max_siblings()` chunks never waits on a sibling that cannot start; as a safety net
(a shared GPU, a slow start) a program polls at most `spin_limit()` times, then marks its chunk
ABANDONED and leaves it to the row's last program, which re-reads and writes it. Both of them
move ABANDONED to TAKEN with a compare-and-swap, so exactly one writes the chunk.

Triton helpers here are `@triton.jit`: import this module only after the backend is chosen (as
op packages' kernels are).
"""

from __future__ import annotations

import enum

import torch
import triton
import triton.language as tl

from . import backend

# Siblings per multiprocessor a plan counts on being resident at once (4-warp programs: several
# fit): 2 x 132 chunks a row on an H100.
SIBLINGS_PER_SM = 2
# Warps of a split program: a quarter of a multiprocessor's threads, so that SIBLINGS_PER_SM of
# them fit whatever their registers, and while some wait for their siblings, others load.
PROGRAM_WARPS = 4
# Polls of the arrival counter before a program stops waiting. Normally the last sibling arrives
# within tens of polls (a few microseconds); 4096 polls take milliseconds. The interpreter runs
# programs one after another, so waiting there is pointless: it gives up at once, which is also
# how CPU tests reach the hand-off.
SPIN_LIMIT = 1 << 12
INTERPRETER_SPIN_LIMIT = 1
# The interpreter has no residency to respect: rows of up to this many chunks split there, so
# CPU tests reach the split paths.
INTERPRETER_MAX_SIBLINGS = 16

class RowPath(str, enum.Enum):
    """How a row-reducing op covers a row: the same three names in every such op."""

    FUSED = "fused"  # whole rows in one program's registers
    SPLIT = "split"  # a row cut into chunks across sibling programs that meet (this module)
    LONG = "long"  # rows of more chunks than max_siblings(): the op's own multi-pass or looped kernels


# States of a chunk: its owner writes it, unless the owner stopped waiting (ABANDONED); then
# whichever of the owner and the row's last program first moves it to TAKEN writes it.
PENDING = tl.constexpr(0)
ABANDONED = tl.constexpr(1)
TAKEN = tl.constexpr(2)


def max_siblings() -> int:
    """Most chunks a split row may have: siblings the GPU surely holds at once."""
    if backend.is_interpreter():
        return INTERPRETER_MAX_SIBLINGS
    return backend.multiprocessor_count() * SIBLINGS_PER_SM


def spin_limit() -> int:
    return INTERPRETER_SPIN_LIMIT if backend.is_interpreter() else SPIN_LIMIT


def scratch(n_rows: int, chunks: int, partials: int, device: torch.device):
    """Shared state for `n_rows` rows of `chunks` chunks, zeroed in one allocation: an arrival
    count per row, a state per chunk, then `partials` fp32 partials per chunk (as int32 bits;
    each written before it is read). Returns (arrived, states, partials)."""
    slots = n_rows * chunks
    buf = torch.zeros(n_rows + slots * (1 + partials), dtype=torch.int32, device=device)
    return buf[:n_rows], buf[n_rows:n_rows + slots], buf[n_rows + slots:]


@triton.jit
def chunk_columns(chunk, n_cols, CHUNK: tl.constexpr):
    """Column indices of a row's chunk and the mask of those inside the row."""
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    return cols, cols < n_cols


@triton.jit
def widen_held(chunk):
    """A chunk held through the wait in its own dtype, as fp32. bf16 widens by a 16-bit shift
    rather than a conversion: the compiler would merge a second conversion with the one taken
    before the wait and keep the fp32 copy live across it (twice the registers)."""
    if chunk.dtype == tl.bfloat16:
        return (chunk.to(tl.int16, bitcast=True).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    return chunk.to(tl.float32)


@triton.jit
def publish(slot_ptr, value):
    """Write one fp32 partial into the int32 scratch: a scalar atomic, so that the thread issuing
    it is the one that then releases the arrival count (and the interpreter takes it too)."""
    tl.atomic_xchg(slot_ptr, value.to(tl.int32, bitcast=True), sem="relaxed")


@triton.jit
def partials(ptr, count, stride, other, N: tl.constexpr):
    """`count` fp32 partials stored as int32 bits `stride` apart (read past L1: other programs
    wrote them), `other` beyond `count`."""
    idx = tl.arange(0, N)
    valid = idx < count
    bits = tl.load(ptr + stride * idx, mask=valid, other=0, cache_modifier=".cg")
    return tl.where(valid, bits.to(tl.float32, bitcast=True), other)


@triton.jit
def await_row(arrived_ptr, state_ptr, chunks, spin_limit):
    """Count this program in as arrived (its partials are published) and wait for its siblings.

    Returns (ready, last): ready when this program must write its chunk now (every partial of the
    row is published); last when it was the row's last to arrive, which then writes the chunks of
    siblings that stopped waiting (`claim_abandoned`). A program that waited spin_limit polls
    marks its chunk ABANDONED, then looks once more. (All of these are read-modify-write atomics
    on the counter or the state, so one of the two always sees the other's step.)"""
    arrived = tl.atomic_add(arrived_ptr, 1, sem="acq_rel") + 1
    seen = arrived
    spins = 0
    while (seen < chunks) & (spins < spin_limit):
        seen = tl.atomic_add(arrived_ptr, 0, sem="acquire")
        spins += 1
    ready = seen >= chunks
    if seen < chunks:
        tl.atomic_xchg(state_ptr, ABANDONED, sem="acq_rel")
        if tl.atomic_add(arrived_ptr, 0, sem="acq_rel") >= chunks:
            ready = tl.atomic_cas(state_ptr, ABANDONED, TAKEN, sem="acq_rel") == ABANDONED
    return ready, arrived == chunks


@triton.jit
def claim_abandoned(state_ptr, own, chunks, CHUNKS_P2: tl.constexpr):
    """The last program's sweep: take every chunk of the row whose owner stopped waiting (a mask
    over the row's chunks). Lanes past the row point at this program's own chunk, which is never
    abandoned."""
    idx = tl.arange(0, CHUNKS_P2)
    idx = tl.where(idx < chunks, idx, own)
    old = tl.atomic_cas(state_ptr + idx, tl.full([CHUNKS_P2], ABANDONED, tl.int32),
                        tl.full([CHUNKS_P2], TAKEN, tl.int32), sem="acq_rel")
    return old == ABANDONED


@triton.jit
def lane(flags, i, CHUNKS_P2: tl.constexpr):
    """flags[i] of a mask over a row's chunks, as a scalar."""
    return tl.max(tl.where(tl.arange(0, CHUNKS_P2) == i, flags, False).to(tl.int32), axis=0) > 0
