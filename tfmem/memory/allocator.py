"""Allocator: a replay of TensorFlow's BFC allocator policy over an allocation sequence.

The simulator counts bytes *requested*; TensorFlow's BFC allocator (the GPU
allocator, and the emulated accelerator's `TF_CPU_ALLOCATOR_USE_BFC`) counts
the *chunks* it hands out, and a chunk can be much larger than its request:

    request 2.5 MiB, free regions hold 2 MiB  ->  grow a 4 MiB region
    4 MiB < 2 x 2.5 MiB: not split            ->  the whole 4 MiB chunk is in use

The policy replayed here is bfc_allocator.cc's (TensorFlow 2.21, CPU path:
allow_growth, no region coalescing, no garbage collection):

- every request is rounded up to a multiple of 256 bytes;
- the free chunk chosen is the smallest that fits, the lowest address among
  equals (bins by size, each ordered by size then address);
- it is split when it is at least twice the rounded request, or when the
  remainder is 128 MiB or more; otherwise the whole chunk is handed out;
- a freed chunk merges with its free neighbours in the same region;
- when nothing fits, a new region is taken: its size starts at 2 MiB and
  doubles until the request fits, and doubles again after every region that
  did not have to grow for its request;
- under a limit (the emulated accelerator's cap), a new region is at most
  what the limit leaves, and a request larger than that does not fit.

The last rule is what makes a capped device waste memory: with regions of 2,
4, 8, 16 and 32 MiB taken, a 111 MiB cap leaves a last region of 49 MiB, and
a 27 MiB kernel scratch buffer that lands in it gets all 49 (49 < 2 x 27).
A GPU's allocator takes its whole memory as one region at the start
(TensorFlow's default), and so does the emulated accelerator after
`tfmem.reserve_emulated_memory()`; `Regions` says which layout to replay.

`BFCModel` is pure Python and fed by the simulator's allocate/free sequence.
Which chunk a request gets depends on every allocation the process made
before (TensorFlow's executor orders concurrent ops by measured cost, so the
sequence varies from process to process): the replay gives the figure of one
plausible order, not a bound.
"""

import bisect
import dataclasses

MIN_ALLOCATION = 256
INITIAL_REGION = 2 << 20
MAX_INTERNAL_FRAGMENTATION = 128 << 20
_REGION_SPACING = 1 << 48  # regions never touch: BasicCPUAllocator does not coalesce them


def rounded(nbytes):
    """The request size BFC works with: `nbytes` rounded up to 256 bytes."""
    return -(-nbytes // MIN_ALLOCATION) * MIN_ALLOCATION


@dataclasses.dataclass(frozen=True)
class Regions:
    """How the replayed allocator holds memory: `reserved` region sizes taken before
    anything else (the whole cap, after `reserve_emulated_memory`), then regions grown
    as needed; `limit` the bytes all regions may take (None: no limit that matters);
    `occupied` bytes the device holds for others (other requests, other sessions): the
    replay has that much less, off the limit and off the largest reserved region (where
    it would lie; not as one buffer, which a grown layout would hand a chunk too large)."""
    reserved: tuple = ()
    limit: int = None
    occupied: int = 0


class BFCModel:
    """Chunks of a BFC allocator: `allocate` returns a handle, `free` takes it back.

    `in_use` and `peak` are in chunk bytes, TensorFlow's `bytes_in_use` and
    `peak_bytes_in_use`; `requested` is the sum of live requests.  A request the
    limit leaves no room for (TensorFlow: out of memory) still gets a region, so that
    the replay goes on; `beyond_limit` counts the chunk bytes in use in such regions.
    """

    def __init__(self, regions=Regions()):
        self.region_bytes = INITIAL_REGION
        self.limit = None if regions.limit is None else regions.limit - regions.occupied
        self.regions = 0
        self.pool = 0  # bytes of all regions
        self.beyond_limit = 0
        self._over = set()  # regions taken beyond the limit
        self.in_use = 0
        self.peak = 0
        self.requested = 0
        self._size = {}  # chunk address -> size
        self._used = {}  # chunk address -> requested bytes, for chunks in use
        self._end = {}  # chunk end address -> chunk address (to find the left neighbour)
        self._free = []  # sorted (size, address) of free chunks
        reserved = list(regions.reserved)
        if reserved and regions.occupied:
            largest = reserved.index(max(reserved))
            reserved[largest] = max(reserved[largest] - regions.occupied, 0)
        for size in reserved:
            if size:
                self._add_region(rounded(size))

    def allocate(self, nbytes):
        """Hand out a chunk for `nbytes`; its address is the handle (None for 0 bytes)."""
        if nbytes <= 0:
            return None
        need = -(-nbytes // MIN_ALLOCATION) * MIN_ALLOCATION  # rounded(nbytes): a hot path
        free = self._free
        index = bisect.bisect_left(free, (need, -1))
        if index == len(free):
            self._extend(need)
            index = bisect.bisect_left(free, (need, -1))
        size, address = free.pop(index)
        if size >= 2 * need or size - need >= MAX_INTERNAL_FRAGMENTATION:
            chunks, ends = self._size, self._end
            del ends[address + size]  # one chunk split in two: _drop_chunk, _set_chunk inlined
            chunks[address] = need
            ends[address + need] = address
            chunks[address + need] = size - need
            ends[address + size] = address + need
            bisect.insort(free, (size - need, address + need))
            size = need
        self._used[address] = nbytes
        self.in_use += size
        if self._over and address // _REGION_SPACING in self._over:
            self.beyond_limit += size
        self.requested += nbytes
        if self.in_use > self.peak:
            self.peak = self.in_use
        return address

    def free(self, address):
        """Return a chunk; it merges with the free chunks next to it in its region."""
        if address is None:
            return
        self.requested -= self._used.pop(address)
        size = self._drop_chunk(address)
        self.in_use -= size
        if self._over and address // _REGION_SPACING in self._over:
            self.beyond_limit -= size
        right = address + size
        if right in self._size and right not in self._used:
            self._remove_free(right)
            size += self._drop_chunk(right)
        left = self._end.get(address)
        if left is not None and left not in self._used:
            self._remove_free(left)
            size += self._drop_chunk(left)
            address = left
        self._set_chunk(address, size)
        bisect.insort(self._free, (size, address))

    @property
    def needed(self):
        """The bytes in use, or, while chunks beyond the limit are in use, more than the
        limit by those bytes (what the device would have to hold)."""
        if self.beyond_limit:
            return max(self.in_use, self.limit + self.beyond_limit)
        return self.in_use

    def chunk_of(self, address):
        """The chunk bytes behind a handle."""
        return self._size[address]

    def layout(self):
        """What the allocator's next requests depend on: its regions, every chunk, and the
        ones in use with their requests (a copy)."""
        return self.regions, self.region_bytes, dict(self._size), dict(self._used)

    # -- internals

    def _drop_chunk(self, address):
        size = self._size.pop(address)
        del self._end[address + size]
        return size

    def _set_chunk(self, address, size):
        self._size[address] = size
        self._end[address + size] = address

    def _remove_free(self, address):
        index = bisect.bisect_left(self._free, (self._size[address], address))
        del self._free[index]

    def _extend(self, need):
        grew = False
        while need > self.region_bytes:
            self.region_bytes *= 2
            grew = True
        size = self.region_bytes
        if self.limit is not None:
            available = (self.limit - self.pool) // MIN_ALLOCATION * MIN_ALLOCATION
            size = min(size, available) if need <= available else need
        self._add_region(size)
        if self.limit is not None and self.pool > self.limit:
            self._over.add(self.regions)
        if not grew:
            self.region_bytes *= 2

    def _add_region(self, size):
        start = (self.regions + 1) * _REGION_SPACING
        self.regions += 1
        self.pool += size
        self._set_chunk(start, size)
        bisect.insort(self._free, (size, start))


class AllocationLog:
    """The allocate/free sequence of one simulated step, by buffer.

    The simulator names buffers by tensor (or by its own keys for transfers);
    a forwarded or kept tensor hands its buffer on under a new name.
    `state` holds the allocations made before the step (variables, constants);
    `step` the step's, with `("partition", index)` marks where each partition starts.
    `uploads` are the buffers the prefetch thread allocates (`upload`), logged where
    their upload starts; `replay` also moves them to where it may end.
    """

    def __init__(self):
        self.state = []
        self.step = []
        self.uploads = set()
        self._buffer = {}
        self._next = 0
        self._partition = -1

    def allocate(self, key, nbytes, into=None):
        """A new buffer of `nbytes` for `key` (nothing for 0 bytes)."""
        if nbytes <= 0:
            return
        self._next += 1
        self._buffer[key] = self._next
        (self.step if into is None else into).append(("alloc", self._next, nbytes))

    def upload(self, key, nbytes, reader):
        """A buffer uploaded for partition `reader`, started as the current partition
        starts: on the prefetch thread while it runs when `reader` comes later (with no
        prefetch, the reader's own upload, done before its kernels run)."""
        self.allocate(key, nbytes)
        if nbytes > 0 and reader > self._partition:
            self.uploads.add(self._next)

    def allocate_state(self, key, nbytes):
        self.allocate(key, nbytes, into=self.state)

    def produce(self, tensor, nbytes, reuse=None):
        """An op's output: a new buffer, or the dying input `reuse` forwarded."""
        if reuse is not None and reuse in self._buffer:
            self._buffer[tensor] = self._buffer.pop(reuse)
        else:
            self.allocate(tensor, nbytes)

    def scratch(self, *sizes):
        """A kernel's scratch (and that of kernels running beside it), each its own
        buffer, held while the kernel runs."""
        keys = [("scratch", index) for index in range(len(sizes))]
        for key, nbytes in zip(keys, sizes):
            self.allocate(key, nbytes)
        for key in keys:
            self.release(key)

    def release(self, key):
        buffer = self._buffer.pop(key, None)
        if buffer is not None:
            self.step.append(("free", buffer))

    def holds(self, key):
        return key in self._buffer

    def rename(self, key, new_key):
        if key in self._buffer:
            self._buffer[new_key] = self._buffer.pop(key)

    def partition(self, index):
        self._partition = index
        self.step.append(("partition", index))


def replay(log, steps=2, regions=Regions(), stop=None):
    """({partition index: peak chunk bytes}, {partition index: served}) in the last of
    `steps` replays of the step after its state, on an allocator that starts with
    `regions` only.

    The first steps leave the regions and free chunks a steady-state step meets.  A
    partition is served when the allocator found every request a chunk within its
    limit; one that was not reads the bytes its regions would need (more than the
    limit).

    The prefetch thread's uploads (`AllocationLog.upload`) start with the partition
    before their reader and may finish at any point of it, up to its end (the reader
    waits for them): early, they count in that partition's peak; late, they take the
    chunks its working set freed, and the reader's buffers take others.  Each peak is
    the worst over `upload_placements`, in which every partition meets each of the
    four combinations of early and late for its own uploads and for those made for it.

    `stop(peaks, served)`: asked after each placement with the figures so far; when it
    holds, the replay ends there and returns (None, None) (a search that rejects the
    plan on those figures needs no other placement: they can only raise its peaks).
    """
    peaks, served = {}, {}
    for late in upload_placements(log.step) if log.uploads else (frozenset(),):
        events = _uploads_placed(log.step, log.uploads, late) if late else log.step
        placed_peaks, placed_served = _replay_events(log.state, events, steps, regions)
        for index, peak in placed_peaks.items():
            peaks[index] = max(peaks.get(index, 0), peak)
            served[index] = served.get(index, True) and placed_served[index]
        if stop is not None and stop(peaks, served):
            return None, None
    return peaks, served


def upload_placements(events):
    """Sets of partitions whose uploads land late (at the partition's end): none, all,
    the even and the odd ones, each once (a one-partition step has two)."""
    indices = [event[1] for event in events if event[0] == "partition"]
    return tuple(dict.fromkeys((frozenset(), frozenset(indices), frozenset(indices[0::2]),
                                frozenset(indices[1::2]))))


def _uploads_placed(events, uploads, late):
    """`events` with the `uploads` allocated in the partitions of `late` moved to the end
    of their partition."""
    placed, held, moving = [], [], False
    for event in events:
        if event[0] == "partition":
            placed += held
            held = []
            moving = event[1] in late
        elif moving and event[0] == "alloc" and event[1] in uploads:
            held.append(event)
            continue
        placed.append(event)
    return placed + held


def _replay_events(state, events, steps, regions):
    """`replay` of one arrangement of the step's `events`.

    A step that leaves the allocator as it found it (no region taken, every chunk it
    took given back, so that BFC's free chunks are those it started with, merged as far
    as they go) would be replayed again from the same layout, to the same figures: on a
    reserved region that is the rule, and the steps before the last are not replayed."""
    model = BFCModel(regions)
    allocate, free = model.allocate, model.free  # bound once: called per event
    handles = {}
    for _, buffer, nbytes in state:
        handles[buffer] = allocate(nbytes)
    release = handles.pop
    if regions.reserved:  # a step is likely to leave the layout it found: measure the first
        before = (model.layout(), dict(handles))
        peaks, served = _measured_step(model, events, handles)
        if steps == 1 or (model.layout(), handles) == before:
            return peaks, served
        steps -= 1
    for _ in range(steps - 1):  # the steps before only shape the regions
        for event in events:
            kind = event[0]
            if kind == "alloc":
                handles[event[1]] = allocate(event[2])
            elif kind == "free":
                free(release(event[1], None))
    return _measured_step(model, events, handles)


def _measured_step(model, events, handles):
    """({partition: peak}, {partition: served}) of one replay of `events` on `model`."""
    allocate, free, release = model.allocate, model.free, handles.pop
    peaks, served = {}, {}
    current, peak, ok = None, 0, True  # the partition replayed, its peak so far, served
    for event in events:
        kind = event[0]
        if kind == "partition":
            if current is not None:
                peaks[current], served[current] = peak, ok
            current = event[1]
            peak, ok = model.needed, not model.beyond_limit
            continue
        if kind == "alloc":
            handles[event[1]] = allocate(event[2])
        else:
            free(release(event[1], None))
        if current is not None:
            if model.beyond_limit:
                peak, ok = max(peak, model.needed), False
            elif model.in_use > peak:
                peak = model.in_use
    if current is not None:
        peaks[current], served[current] = peak, ok
    return peaks, served
