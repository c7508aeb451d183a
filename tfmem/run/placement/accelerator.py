"""The accelerator a session runs on, and how much memory it has.

The device is a GPU or TPU when the session has one; on a CPU-only machine an
emulated accelerator (`tfmem.memory.emulated`: TensorFlow's CPU allocator
capped) stands in for it, and `device_memory` reports TensorFlow's own
current and peak figures either way.
"""

from tfmem.memory.emulated import emulate_accelerator, emulated_memory_mib  # noqa: F401  (read here)


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
        raise ValueError(f"Options.accelerator_device={name!r} is not a device of the session; "
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


def device_capacity(session):
    """Bytes of device memory: the emulated cap, the accelerator's memory, or None."""
    cap = emulated_memory_mib()
    if cap is not None:
        return cap << 20
    return accelerator_memory(session)


def memory_budget(session, given=None):
    """The device-memory budget in bytes of budget mode: `given` (bytes or a string such
    as '2GiB'), else the emulated cap or the accelerator's memory; a ValueError when
    there is neither."""
    if given is not None:
        from tfmem.memory.budget import parse_bytes  # pylint: disable=import-outside-toplevel
        return parse_bytes(given)  # (budget imports TensorFlow; this module does not)
    limit = device_capacity(session)
    if limit:
        return limit
    raise ValueError("partition_size='auto' needs a device_memory_budget (such as '2GiB') "
                     "on a session without an accelerator or an emulated cap")


def memory_device(session):
    """The device whose allocator holds the step's tensors: the accelerator, else the CPU."""
    return accelerator_of(session) or "CPU:0"


def has_own_memory(session):
    """True when the session's tensors live in memory apart from the host's: an
    accelerator, or the CPU under an emulated cap.  Only then does a host copy free
    anything."""
    return memory_device(session) != "CPU:0" or emulated_memory_mib() is not None


def keeps_figures(device):
    """True where TensorFlow's allocator keeps current and peak figures for `device`:
    a GPU, the emulated cap, and also a CPU allocator with statistics but no cap
    (oneDNN on, or `TF_CPU_ALLOCATOR_USE_BFC=true` alone).  Both front ends measure
    steps (and budget mode learns) exactly there.  Asking starts TensorFlow's eager
    context, as the first measured step would."""
    return device_memory(device) is not None


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
