"""The emulated accelerator: TensorFlow's CPU allocator capped, for CPU-only machines.

On a machine without a GPU, TensorFlow's CPU allocator can be given a hard
cap (a BFC allocator limited to N MiB), so that a step needing more raises
`ResourceExhaustedError` exactly as on a small GPU.  TensorFlow reads the
setting when it creates its CPU allocator (at the first session or eager
op), so `emulate_accelerator` must run before TensorFlow is imported:

    import tfmem
    tfmem.emulate_accelerator(512)      # before `import tensorflow`
    import tensorflow as tf

Everything TensorFlow allocates then counts as device memory.  Importing
this module imports no TensorFlow, so the memory wing can ask for the cap
without starting the runtime; only `reserve_emulated_memory` runs it.

The capped allocator grows as TensorFlow's CPU allocator does: regions of 2,
4, 8, ... MiB, the last one what the cap leaves, and a large request that
lands in a region less than twice its size gets all of it.  A GPU's allocator
instead takes its memory as one region at the start (TensorFlow's default),
so a request is always split off a large free chunk.  `reserve_emulated_memory`
gives the emulated accelerator that layout; `allocator_regions` tells the
allocator replay (memory/allocator.py) which one this process has.
"""

import os
import sys

from tfmem.memory.sizes import MIB

USE_BFC = "TF_CPU_ALLOCATOR_USE_BFC"
LIMIT_MB = "TF_CPU_BFC_MEM_LIMIT_IN_MB"
_RESERVE_MAX = 16 << 30  # an uncapped allocator's region: address space, never written
_RESERVE_MIN = 1 << 30
_RESERVED = ()  # the regions reserve_emulated_memory took in this process


def emulate_accelerator(memory_mib):
    """Cap TensorFlow's CPU allocator at `memory_mib` MiB for this process.

    Raises RuntimeError when TensorFlow is already imported (it may already
    have created its allocator, and the cap would be silently ignored), and
    ValueError for a size that is not a positive integer.
    """
    if isinstance(memory_mib, bool) or not isinstance(memory_mib, int) or memory_mib < 1:
        raise ValueError(f"memory_mib must be a positive integer (MiB), got {memory_mib!r}")
    if emulated_memory_mib() == memory_mib:
        return
    if "tensorflow" in sys.modules:
        raise RuntimeError(
            "emulate_accelerator must run before TensorFlow is imported: TensorFlow reads "
            "the allocator cap when it creates its CPU allocator, and a cap set later is "
            f"ignored. Call tfmem.emulate_accelerator({memory_mib}) first thing, or start "
            f"the process with {USE_BFC}=true {LIMIT_MB}={memory_mib}.")
    os.environ[USE_BFC] = "true"
    os.environ[LIMIT_MB] = str(memory_mib)


def emulated_memory_mib():
    """The emulated cap in MiB configured for this process, or None."""
    if os.environ.get(USE_BFC, "").lower() not in ("1", "true"):
        return None
    value = os.environ.get(LIMIT_MB)
    return int(value) if value and value.isdigit() else None


def reserve_emulated_memory():
    """Have the emulated accelerator hold its whole cap as one region, as a GPU does.

    Call once, after importing TensorFlow and before anything allocates on the device
    (else RuntimeError: regions already taken stay).  It runs one uninitialised tensor
    of nearly the cap (address space, never written), frees it, and resets the
    allocator's peak, which has counted nothing else.  Without a cap (the allocator
    far above any step) the region is at most 16 GiB or half the machine's memory.
    Returns the bytes of the large region.
    """
    global _RESERVED  # pylint: disable=global-statement
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    mib = emulated_memory_mib()
    if mib is None:
        raise RuntimeError("reserve_emulated_memory needs the emulated accelerator: call "
                           "tfmem.emulate_accelerator(mib) before importing TensorFlow")
    if _RESERVED:
        return _RESERVED[-1]
    if tf.config.experimental.get_memory_info("CPU:0")["peak"]:
        raise RuntimeError("reserve_emulated_memory must run before anything is allocated "
                           "on the emulated accelerator (its allocator's peak is not zero): "
                           "call it right after importing TensorFlow")
    limit = mib * MIB
    if _take_region(tf, limit):
        big = tf.config.experimental.get_memory_info("CPU:0")["peak"] // MIB * MIB
        _RESERVED = tuple(r for r in (min(limit - big, 2 * MIB), big) if r > 0)
    tf.config.experimental.reset_memory_stats("CPU:0")
    return _RESERVED[-1] if _RESERVED else 0


def _take_region(tf, limit):
    """Run and free one uninitialised tensor big enough that the allocator takes a region
    of all the cap leaves (4 MiB spare for the small regions the run's own constants
    take); halve it where the machine gives no such region.  Whether one was taken."""
    import psutil  # pylint: disable=import-outside-toplevel
    size = min(limit - 4 * MIB, _RESERVE_MAX, psutil.virtual_memory().total // 2)
    while size >= min(_RESERVE_MIN, limit // 2):
        graph = tf.Graph()
        with graph.as_default(), tf.device("/cpu:0"):
            region = tf.raw_ops.Empty(shape=[size // MIB, MIB], dtype=tf.uint8, init=False)
        try:
            with tf.compat.v1.Session(graph=graph) as session:
                session.run(region.op)
            return True
        except tf.errors.ResourceExhaustedError:
            size //= 2
    return False


def allocator_regions():
    """The layout the allocator replay starts from in this process (allocator.Regions):
    the emulated cap as its limit, and the regions `reserve_emulated_memory` took."""
    from tfmem.memory.allocator import Regions  # pylint: disable=import-outside-toplevel
    mib = emulated_memory_mib()
    return Regions(reserved=_RESERVED, limit=mib * MIB) if mib else Regions()
