"""Interrupts: Ctrl-C held until a partition's outputs are handed over.

A KeyboardInterrupt raised as a partition call returns would lose the device
tensors it made (nobody would release them).  The call itself cannot be
interrupted anyway, so holding the signal until the partition boundary costs
no responsiveness.  Both front ends' step loops run inside
`deferred_interrupts()` and call `deliver()` after each partition.
"""

import contextlib
import signal
import threading


@contextlib.contextmanager
def deferred_interrupts():
    """Yield `deliver()`, which raises a SIGINT received so far (or calls the previous
    handler); the rest is delivered on leaving.  Only the main thread receives
    signals: elsewhere this holds nothing and `deliver` does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield lambda: None
        return
    received = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: received.append(frame))

    def deliver():
        if received:
            frame = received.pop()
            received.clear()
            if callable(previous):
                previous(signal.SIGINT, frame)
            elif previous != signal.SIG_IGN:
                raise KeyboardInterrupt

    try:
        yield deliver
    finally:
        signal.signal(signal.SIGINT, previous)
        deliver()
