"""The emulated accelerator: TensorFlow's CPU allocator capped, for CPU-only machines.

On a machine without a GPU, TensorFlow's CPU allocator can be given a hard
cap (a BFC allocator limited to N MiB), so that a step needing more raises
`ResourceExhaustedError` exactly as on a small GPU.  TensorFlow reads the
setting when it creates its CPU allocator (at the first session or eager
op), so `emulate_accelerator` must run before TensorFlow is imported:

    import tfmem
    tfmem.emulate_accelerator(512)      # before `import tensorflow`
    import tensorflow as tf

Everything TensorFlow allocates then counts as device memory.  Only the
environment is read or written here (no TensorFlow import), so the memory
wing can ask for the cap without importing the runtime.
"""

import os
import sys

USE_BFC = "TF_CPU_ALLOCATOR_USE_BFC"
LIMIT_MB = "TF_CPU_BFC_MEM_LIMIT_IN_MB"


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
