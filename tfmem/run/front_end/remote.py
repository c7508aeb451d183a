"""Remote: what tfmem can see of a session on TensorFlow's distributed runtime.

A `tf.compat.v1.Session(server.target)` talks to a master that places and
runs each step on the cluster's tasks.  Three things differ from a local
session, and are settled here once, before the first step:

* kept tensors cannot be session handles (no session state there): see
  residence.WorkerStaging;
* allocator figures: `tf.config.experimental.get_memory_info` reads this
  process's allocators.  They are the worker's only when the server behind
  the target runs in this process (the usual between-graph setup: each worker
  process runs its server and its training loop); otherwise the device peak
  is not measured (reported as None) and an emulated cap set for this
  process says nothing about the worker, so partition_size="auto" needs an
  explicit device_memory_budget;
* a master that dies: GrpcSession gives its calls (callables included) the
  session's ConfigProto.operation_timeout_in_ms as their only deadline, and
  with 0 (the default) a client waits for a dead master forever.  tfmem warns
  when a distributed session has none;
* a failing task: a step that fails because a task is gone is re-raised as a
  `RemoteTaskError` naming the task (as TensorFlow names it, or the target
  the session talks to) and the partition, and saying whether the step's
  updates were applied.
"""

import dataclasses
import re
import socket
from urllib.parse import urlparse

import logging

import psutil

from tfmem import tf_private
from tfmem.errors import TFMemError

# TensorFlow's error classes that can mean "a task is gone or unreachable".  A
# client whose master died waits for it to come back until the call's deadline
# (RunOptions.timeout_in_ms): give distributed steps one.
log = logging.getLogger(__name__)

_LOST_TASK_ERRORS = ("UnavailableError", "AbortedError", "DeadlineExceededError")
_TASK = re.compile(r"/job:[\w-]+/replica:\d+/task:\d+")


class RemoteTaskError(TFMemError):
    """A step on a distributed session failed because a task was lost.

    `task`: the task TensorFlow blamed, or the target the session talks to;
    `partition`: the index of the partition that failed; `updates_applied`:
    whether the partition holding the step's updates had run.
    """

    def __init__(self, message, task=None, partition=None, updates_applied=False):
        super().__init__(message)
        self.task = task
        self.partition = partition
        self.updates_applied = updates_applied


@dataclasses.dataclass(frozen=True)
class RemoteInfo:
    """A distributed session's target, the task serving it, and whether its
    allocator is this process's."""
    target: str
    master_task: str  # e.g. "/job:worker/replica:0/task:0"
    allocator_local: bool


def describe(session):
    """RemoteInfo of a distributed session (one ListDevices call), None for a local one."""
    if not is_distributed(session):
        return None
    config = tf_private.config_of(session)
    if config is None or not config.operation_timeout_in_ms:
        log.warning("the distributed session %s has no operation_timeout_in_ms: if its "
                    "master dies, every call (and tfmem's step) waits for it forever. Create "
                    "it with tf.compat.v1.ConfigProto(operation_timeout_in_ms=...) longer than "
                    "a step.", target_of(session))
    devices = session.list_devices()  # the master's own devices come first
    task = _TASK.match(devices[0].name).group(0) if devices else "the session's master"
    return RemoteInfo(target_of(session), task, served_here(session))


def target_of(session):
    target = getattr(session, "sess_str", "") or ""
    return target.decode() if isinstance(target, bytes) else target


def is_distributed(session):
    """True for a session on TensorFlow's gRPC runtime (a server's target)."""
    return target_of(session).startswith("grpc://")


def served_here(session):
    """True when this process listens on the port of the session's target."""
    port = urlparse(target_of(session)).port
    if port is None:
        return False
    try:
        connections = psutil.Process().net_connections(kind="tcp")
    except psutil.Error:
        return False
    return any(c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port
               for c in connections)


def reachable(target, timeout=2.0):
    """Whether the target's port accepts a TCP connection."""
    address = urlparse(target)
    try:
        with socket.create_connection((address.hostname, address.port), timeout=timeout):
            return True
    except OSError:
        return False


def check_budget_source(session, budget_given):
    """Refuse an emulated cap of this process as the budget of a remote worker."""
    if is_distributed(session) and not budget_given and not served_here(session):
        raise TFMemError(
            f"partition_size='auto' on a distributed session ({target_of(session)}) whose "
            "server runs in another process: tfmem cannot read that worker's memory cap. "
            "Pass device_memory_budget (such as '2GiB'), sized to the worker's device.")


def lost_task_error(info, error, partition, partitions, update_partitions):
    """A RemoteTaskError for a TensorFlow error that means a lost task, else None.

    `info`: the session's RemoteInfo (None for a local session);
    `update_partitions`: the partitions of the plan that apply updates, in order.
    """
    if info is None or type(error).__name__ not in _LOST_TASK_ERRORS:
        return None
    named = _TASK.findall(error.message or "")
    if named and type(error).__name__ != "DeadlineExceededError":
        task = named[-1]
    elif not reachable(info.target):
        task = f"{info.master_task} ({info.target}, the session's master)"
    else:
        return None  # a deadline with every task we can see alive: TensorFlow's error stands
    done = [p for p in update_partitions if p < partition]
    applied = bool(update_partitions) and len(done) == len(update_partitions)
    if not update_partitions:
        state = "the step applies no updates"
    elif applied:
        state = "the step's updates were applied before it failed"
    elif partition in update_partitions and not done:
        state = ("it failed in the partition that applies the step's updates, in one "
                 "Session call: TensorFlow may have applied them in part")
    elif done:
        state = (f"the step's updates were applied in part (partitions {done} of "
                 f"{list(update_partitions)}): Options(atomic_updates=False) spreads them")
    else:
        state = ("the step's updates were not applied: they all run in partition "
                 f"{update_partitions[-1]}, which did not start")
    first_line = (error.message or "").strip().splitlines()[0] if error.message else ""
    return RemoteTaskError(
        f"partition {partition} of {partitions} failed: task {task} was lost or is "
        f"unreachable ({type(error).__name__}: {first_line}); {state}. Restart the task, "
        "then the step.", task=task, partition=partition, updates_applied=applied)
