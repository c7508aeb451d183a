"""Compile ahead: the first step of a plan runs partition k once its callable exists.

Making a plan's Session callables is most of its first step (see README,
"First step and graph size").  DirectSession builds them one at a time (one
lock), but it runs a callable while another is being made, and TensorFlow's
Python binding releases the GIL in both.  So the first step hands the
making to one background thread, in partition order, and runs each
partition as soon as its callable is there; later steps use the finished
list like any other.

What stays as before:

- A callable that cannot be made raises in the step that needs it, as
  TensorFlow's error type, its message naming the partition.  The partitions
  before it have run, exactly as when a later partition fails at run time,
  and no partition runs twice.  With `atomic_updates` every update is in the
  last partition, so a step still applies all of them or none.
- A step that fails or is interrupted stops the thread (it finishes the
  callable it is making) and leaves no half-made list behind: the next step
  makes the callables again, in its own thread.  Closing the session stops
  it too.
"""

import logging
import threading
import time

import tensorflow as tf

log = logging.getLogger(__name__)


def _named(error, index, count):
    """`error`, raised while making the callable of partition `index`, with the partition
    named in its message (TensorFlow's error type kept, so `except` clauses still match)."""
    note = f"(tfmem: making the Session callable of partition {index} of {count})"
    if isinstance(error, tf.errors.OpError):
        try:
            named = type(error)(error.node_def, error.op, f"{error.message} {note}")
        except TypeError:  # an error class with another signature
            named = None
        if named is not None:
            return named
    error.add_note(note)
    return error


def make_in_order(make, programs):
    """The callables of `programs`, made here one after the other (later steps, and
    sessions without compile ahead); an error names its partition as above."""
    made = []
    for index, program in enumerate(programs):
        try:
            made.append(make(program))
        except Exception as err:  # pylint: disable=broad-except
            named = _named(err, index, len(programs))
            if named is err:
                raise
            raise named from err
    return made


class CallablesStopped(RuntimeError):
    """The callables of a step were no longer being made (the session closed)."""


class CallablesAhead:
    """A plan's callables, made in order by a thread; item k waits until it exists.

    `make(program)` makes one callable.  Steps that use the object
    `enter()` it and `leave()` it; the last to leave either gets the finished
    list or stops the thread.
    """

    def __init__(self, make, programs):
        self._make = make
        self._programs = tuple(programs)
        self._made = []
        self._failure = None  # (partition index, exception) of the callable that failed
        self._stopped = False
        self._users = 0
        self._changed = threading.Condition()
        self.make_time = 0.0  # seconds the thread spent making callables
        self.wait_time = 0.0  # seconds steps waited for a callable
        self._thread = threading.Thread(target=self._work, name="tfmem-compile-ahead",
                                        daemon=True)
        self._thread.start()

    def _work(self):
        for index, program in enumerate(self._programs):
            with self._changed:
                if self._stopped:
                    return
            started = time.perf_counter()
            try:
                made = self._make(program)
            except BaseException as err:  # pylint: disable=broad-except
                with self._changed:  # raised by the step that needs it
                    self._failure = (index, err)
                    self._changed.notify_all()
                return
            with self._changed:
                self.make_time += time.perf_counter() - started
                self._made.append(made)
                self._changed.notify_all()

    def __len__(self):
        return len(self._programs)

    def __iter__(self):
        return (self[index] for index in range(len(self._programs)))

    def __getitem__(self, index):
        needed = index + 1
        started = time.perf_counter()
        with self._changed:
            while len(self._made) < needed and self._failure is None and not self._stopped:
                self._changed.wait()
            self.wait_time += time.perf_counter() - started
            if len(self._made) >= needed:
                return self._made[index]
            if self._failure is not None and self._failure[0] <= index:
                failed, error = self._failure
                named = _named(error, failed, len(self._programs))
                if named is error:
                    raise error
                raise named from error
            raise CallablesStopped(f"the callable of partition {index} was not made: the "
                                   "session was closed while its first step ran")

    def enter(self):
        """A step starts using the callables."""
        with self._changed:
            self._users += 1

    def leave(self):
        """A step is done with them: the finished list when the last step leaves and every
        callable was made, else None (the last to leave stops the thread)."""
        with self._changed:
            self._users -= 1
            if self._users > 0:
                return None
            complete = len(self._made) == len(self._programs)
        if not complete:
            self.stop()
            return None
        return list(self._made)

    @property
    def in_use(self):
        with self._changed:
            return self._users > 0

    def stop(self):
        """Stop making callables: the one being made is finished, then the thread ends."""
        with self._changed:
            self._stopped = True
            self._changed.notify_all()
        if self._thread is not threading.current_thread():
            self._thread.join()

    @property
    def running(self):
        return self._thread.is_alive()


def enter(callables):
    """`callables` (a list, or a CallablesAhead now used by one more step)."""
    if isinstance(callables, CallablesAhead):
        callables.enter()
    return callables


def settle(cache, callables):
    """After a step: the cache entry holding `callables` (a CallablesAhead) becomes its
    finished list, or is removed when the step failed before every callable was made.
    Call it under the lock that `enter` is called under, so no step enters meanwhile.
    Returns (seconds making, seconds steps waited) once the list is finished, else None."""
    if not isinstance(callables, CallablesAhead):
        return None
    finished = callables.leave()
    if callables.in_use:
        return None
    for key, value in list(cache.items()):
        if value is callables:
            if finished is None:
                del cache[key]
            else:
                cache[key] = finished
                log.debug("compiled ahead: %d callables, %.2f s making, %.2f s waited for",
                          len(finished), callables.make_time, callables.wait_time)
    return None if finished is None else (callables.make_time, callables.wait_time)


def stop_all(cache):
    """Stop every thread still making callables of this cache (the session closes)."""
    for value in list(cache.values()):
        if isinstance(value, CallablesAhead):
            value.stop()
