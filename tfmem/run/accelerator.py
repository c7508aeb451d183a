"""The accelerator a session runs on, and an emulated one for CPU-only machines.

On a machine without a GPU, TensorFlow's CPU allocator can be given a hard
cap (a BFC allocator limited to N MiB), so that a step needing more raises
`ResourceExhaustedError` exactly as on a small GPU.  TensorFlow reads the
setting when it creates its CPU allocator (at the first session or eager
op), so `emulate_accelerator` must run before TensorFlow is imported:

    import tfmem
    tfmem.emulate_accelerator(512)      # before `import tensorflow`
    import tensorflow as tf

Everything TensorFlow allocates then counts as device memory, and
`device_memory` reports TensorFlow's own current and peak figures.
"""

import os
import sys

_USE_BFC = "TF_CPU_ALLOCATOR_USE_BFC"
_LIMIT_MB = "TF_CPU_BFC_MEM_LIMIT_IN_MB"


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
            f"the process with {_USE_BFC}=true {_LIMIT_MB}={memory_mib}.")
    os.environ[_USE_BFC] = "true"
    os.environ[_LIMIT_MB] = str(memory_mib)


def emulated_memory_mib():
    """The emulated cap in MiB configured for this process, or None."""
    if os.environ.get(_USE_BFC, "").lower() not in ("1", "true"):
        return None
    value = os.environ.get(_LIMIT_MB)
    return int(value) if value and value.isdigit() else None


def accelerator_of(session, device=None):
    """The session's accelerator device name ('GPU:0'), or None when it has only CPUs.

    `device` names it instead of the first GPU or TPU: tests on a CPU-only
    machine configure two CPU devices (`ConfigProto(device_count={'CPU': 2})`)
    and let 'CPU:1' stand in for the accelerator.  It must be one of the
    session's devices.
    """
    if device is not None:
        return _session_device(session, device)
    for device in session.list_devices():
        kind = device.device_type
        if kind in ("GPU", "TPU"):
            return f"{kind}:{device.name.rsplit(':', 1)[-1]}"
    return None


def _session_device(session, name):
    """`name` ('CPU:1', '/device:GPU:0') as 'TYPE:index', checked against the session's devices."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    try:
        spec = tf.DeviceSpec.from_string(name)
    except (ValueError, TypeError):
        spec = None
    available = [f"{d.device_type}:{d.name.rsplit(':', 1)[-1]}" for d in session.list_devices()]
    wanted = f"{(spec.device_type or '').upper()}:{spec.device_index}" if spec else None
    if wanted not in available:
        raise ValueError(f"accelerator_device={name!r} is not a device of the session; "
                         f"name one of {available} (such as 'GPU:0')")
    return wanted


def accelerator_memory(session):
    """Bytes of memory TensorFlow may use on the session's accelerator, or None."""
    name = accelerator_of(session)
    if name is None:
        return None
    kind, index = name.split(":")
    for device in session.list_devices():
        if device.device_type == kind and device.name.endswith(":" + index):
            return device.memory_limit_bytes
    return None


def memory_device(session):
    """The device whose allocator holds the step's tensors: the accelerator, else the CPU."""
    return accelerator_of(session) or "CPU:0"


def has_own_memory(session):
    """True when the session's tensors live in memory apart from the host's: an
    accelerator, or the CPU under an emulated cap.  Only then does a host copy free
    anything."""
    return memory_device(session) != "CPU:0" or emulated_memory_mib() is not None


def device_memory(device):
    """TensorFlow's {'current', 'peak'} bytes for `device`, or None where it keeps none."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    try:
        return tf.config.experimental.get_memory_info(device)
    except (ValueError, tf.errors.OpError):
        return None


def reset_peak(device):
    """Start a new peak measurement on `device` where TensorFlow supports it."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    try:
        tf.config.experimental.reset_memory_stats(device)
        return True
    except (ValueError, tf.errors.OpError):
        return False
