"""Host buffers: a pool of aligned, reusable (and, with CUDA, page-locked) arrays.

Swapped tensors wait in these buffers.  The pool keeps every buffer it has
allocated and hands it out again, so once a step's shapes repeat it
allocates nothing.  Buffers start on a 64-byte boundary: TensorFlow feeds an
aligned numpy array without copying it.  When TensorFlow has loaded a CUDA
runtime, buffers are registered with `cudaHostRegister` so device copies
run by DMA at full bus speed; otherwise (CPU-only machines) they are plain
memory, since there is no device to transfer to.
"""

import ctypes
import logging
import threading

import numpy as np

log = logging.getLogger(__name__)

ALIGNMENT = 64


def loaded_cudart():
    """The CUDA runtime TensorFlow loaded into this process, or None."""
    try:
        with open("/proc/self/maps", encoding="utf-8") as maps:
            paths = {line.split()[-1] for line in maps if "libcudart.so" in line}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            return ctypes.CDLL(path)
        except OSError:
            continue
    return None


class _Pinner:
    """Page-locks buffers through the CUDA runtime, when there is one."""

    def __init__(self):
        self._cudart = loaded_cudart()

    @property
    def active(self):
        return self._cudart is not None

    def pin(self, array):
        if self._cudart is None:
            return False
        status = self._cudart.cudaHostRegister(ctypes.c_void_p(array.ctypes.data),
                                               ctypes.c_size_t(array.nbytes), ctypes.c_uint(0))
        if status != 0:
            log.warning("cudaHostRegister failed (error %d); using pageable memory", status)
        return status == 0

    def unpin(self, array):
        self._cudart.cudaHostUnregister(ctypes.c_void_p(array.ctypes.data))


def aligned_bytes(nbytes):
    """A zeroed-free uint8 array of nbytes whose data starts on an ALIGNMENT boundary."""
    raw = np.empty(nbytes + ALIGNMENT, dtype=np.uint8)
    offset = (-raw.ctypes.data) % ALIGNMENT
    return raw[offset:offset + nbytes]


class HostBufferPool:
    """Reusable host buffers, keyed by size rounded up to the alignment."""

    def __init__(self, pin=True):
        self._pinner = _Pinner() if pin else None
        self._free = {}  # capacity -> list of uint8 blocks
        self._blocks = {}  # id(view base block) -> (block, pinned)
        self._lock = threading.Lock()
        self.allocations = 0  # blocks ever allocated
        self.capacity_bytes = 0  # bytes held by the pool, free or in use
        self.in_use_bytes = 0
        self.peak_in_use_bytes = 0

    @property
    def pinned(self):
        return bool(self._pinner and self._pinner.active)

    def acquire(self, shape, dtype):
        """An aligned array of `shape` and `dtype`, reused when one of that size is free."""
        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        capacity = max(ALIGNMENT, -(-nbytes // ALIGNMENT) * ALIGNMENT)
        with self._lock:
            free = self._free.get(capacity)
            if free:
                block = free.pop()
            else:
                block = aligned_bytes(capacity)
                pinned = self.pinned and self._pinner.pin(block)
                self._blocks[block.ctypes.data] = (block, pinned)
                self.allocations += 1
                self.capacity_bytes += capacity
            self.in_use_bytes += capacity
            self.peak_in_use_bytes = max(self.peak_in_use_bytes, self.in_use_bytes)
        return block[:nbytes].view(dtype).reshape(shape)

    def release(self, array):
        """Return an array from `acquire` to the pool."""
        address = array.ctypes.data
        with self._lock:
            block, _ = self._blocks[address]
            self._free.setdefault(block.nbytes, []).append(block)
            self.in_use_bytes -= block.nbytes

    def clear(self):
        """Free every buffer; arrays still handed out must not be used afterwards."""
        with self._lock:
            for block, pinned in self._blocks.values():
                if pinned:
                    self._pinner.unpin(block)
            self._blocks.clear()
            self._free.clear()
            self.capacity_bytes = self.in_use_bytes = 0
