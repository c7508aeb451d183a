"""Host memory: refuse, before anything runs, a plan whose host buffers do not fit.

A plan that swaps holds its swapped tensors in pooled host buffers; if the
machine cannot hold them, the step would fail (or swap the host) halfway
through, after stateful ops ran.  Both front ends check the predicted host
peak against what the machine has available when they compile a plan.
"""

import psutil

from tfmem.errors import HostMemoryError

HOST_MARGIN = 0.1  # share of available host memory tfmem leaves free


def check_host_memory(trace, pool):
    """Raise HostMemoryError when `trace`'s host peak, beyond what `pool` (a
    HostBufferPool) holds already, exceeds the available memory less the margin."""
    available = psutil.virtual_memory().available
    needed = trace.peak_host - pool.capacity_bytes
    if needed > available * (1 - HOST_MARGIN):
        raise HostMemoryError(
            f"the plan needs {needed / (1 << 20):.0f} MiB of host memory for swapped tensors, "
            f"but only {available / (1 << 20):.0f} MiB is available (tfmem keeps "
            f"{HOST_MARGIN:.0%} free). Use a larger partition_size or swap_distance, "
            "swap='none', or free host memory.")
