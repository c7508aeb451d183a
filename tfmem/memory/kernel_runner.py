"""Kernel runner: calibrations run in a process of their own, whose allocator has no past.

Kernel scratch is read from TensorFlow's step statistics, and those count the
chunks the BFC allocator hands out, not the bytes a kernel asked for.  A chunk
can be almost twice its request, and which one a request gets depends on
everything the process allocated before: the same ResNet convolution gradient
(a 27 MiB im2col buffer) measured 32 MiB in a fresh process (a new 32 MiB
region, too small to split), 48 MiB in an experiment's trial (a free chunk its
earlier steps had left) and 27 MiB after one large tensor had come and gone.
Budget mode then planned around a kernel almost twice its size.

So kernels are calibrated in a child Python process, started on first use and
kept for this process's life, talking over its standard input and output:

    this process                          kernel runner (BFC, no cap)
    graph of copied kernels  --json-->    takes one large region and frees it,
                                          so every chunk after is split off it:
    {op: scratch, extra bytes} <--json--  its request rounded to 256 bytes

The child inherits the environment (TensorFlow's version and kernel path) and
runs each kernel with the caller's intra-op threads.  The region is reserved,
not touched: only the pages kernels write are ever used.  Where the child
cannot be started or fails, kernels run in this process with a warning, and
their figures are chunks again.
"""

import atexit
import base64
import json
import logging
import os
import subprocess
import sys
import tempfile
import threading

log = logging.getLogger(__name__)

_COMMAND = [sys.executable, "-m", "tfmem.memory.kernel_runner"]
# The suffix of an op that runs with a calibrated op, after it, to hold its inputs.
HELD = "_inputs_held"


def run_alone(graph, names, threads):
    """({op: scratch bytes}, {op: bytes of outputs past the op's own}, {op: scratch bytes
    allocated before its outputs}) for the ops `names` of `graph`, each run alone once; an
    op whose kernel refuses its (zero) inputs measures 0 in all.  Runs in the kernel
    runner when it can, else in this process."""
    if not names:
        return {}, {}, {}
    runner = _runner()
    if runner is not None:
        figures = runner.run(graph.as_graph_def(), names, threads)
        if figures is not None:
            return figures
    return measure_here(graph, names, threads)


def measure_here(graph, names, threads):
    """`run_alone` in this process: figures in this allocator's chunks."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    from tensorflow.core.protobuf import config_pb2  # pylint: disable=import-outside-toplevel
    from tensorflow.python.client import session as tf_session  # pylint: disable=import-outside-toplevel
    from tfmem.memory import scratch  # pylint: disable=import-outside-toplevel

    options = config_pb2.RunOptions(trace_level=config_pb2.RunOptions.SOFTWARE_TRACE)
    scratch_bytes, extra, early = {}, {}, {}
    # BaseSession: a plain session even where tfmem.autowrap replaced tf.compat.v1.Session
    # (a wrapped one would calibrate its own kernels again, without end).
    session = tf_session.BaseSession(graph=graph, config=scratch.session_config(threads))
    try:
        for name in names:
            op = graph.get_operation_by_name(name)
            metadata = config_pb2.RunMetadata()
            try:
                session.run([op] + _held(graph, name), options=options, run_metadata=metadata)
            except tf.errors.OpError as err:  # zeros are not valid input for every kernel
                log.debug("kernel scratch of %s not measured: %s", op.type,
                          str(err).splitlines()[0])
                scratch_bytes[name] = extra[name] = early[name] = 0
                continue
            scratch_bytes[name] = scratch.op_scratch(metadata, name)
            extra[name] = scratch.extra_output_bytes(metadata, op)
            early[name] = scratch.scratch_before_outputs(metadata, name)
    finally:
        session.close()
    return scratch_bytes, extra, early


def _held(graph, name):
    """The op that holds op `name`'s inputs until it has run, if its graph has one."""
    try:
        return [graph.get_operation_by_name(name + HELD)]
    except KeyError:
        return []


class _Runner:
    """The child process and the lock that keeps one request on its pipe at a time."""

    def __init__(self):
        self._lock = threading.Lock()
        self._errors = tempfile.TemporaryFile()
        package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = _child_environment(package_root)
        # A session of its own: Ctrl-C in the terminal interrupts this process, whose
        # exit closes the pipe, which ends the child.
        self._child = subprocess.Popen(
            _COMMAND, env=env,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._errors,
            start_new_session=True, text=True)

    def run(self, graph_def, names, threads):
        request = {"graph": base64.b64encode(graph_def.SerializeToString()).decode("ascii"),
                   "ops": list(names), "threads": int(threads)}
        with self._lock:
            try:
                self._child.stdin.write(json.dumps(request) + "\n")
                self._child.stdin.flush()
                reply = self._child.stdout.readline()
            except OSError as err:
                reply, failure = "", type(err).__name__
            else:
                failure = "the kernel runner exited"
        try:
            answer = json.loads(reply) if reply else {"error": failure}
        except ValueError:
            answer = {"error": f"unreadable reply {reply[:80]!r}"}
        if "error" in answer:
            self._fail(answer["error"])
            return None
        return answer["scratch"], answer["extra"], answer["early"]

    def _fail(self, error):
        global _RUNNER  # pylint: disable=global-statement
        self._errors.seek(0)
        tail = self._errors.read().decode("utf-8", "replace").strip().splitlines()[-5:]
        log.warning("the kernel runner failed (%s); calibrating kernels in this process, "
                    "whose figures are allocator chunks and depend on what ran before%s",
                    error, (":\n  " + "\n  ".join(tail)) if tail else "")
        self.close()
        _RUNNER = False

    def close(self):
        if self._child.poll() is None:
            try:
                self._child.stdin.close()
                self._child.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                self._child.kill()
                self._child.wait()
        self._errors.close()


def _child_environment(package_root):
    from tfmem.memory.emulated import LIMIT_MB, USE_BFC  # pylint: disable=import-outside-toplevel
    env = dict(os.environ)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env[USE_BFC] = "true"  # the allocator whose chunks the reserved region makes exact
    env[LIMIT_MB] = str(1 << 16)  # 64 GiB, no cap: a calibration measures, it is no step
    env["TF_FORCE_GPU_ALLOW_GROWTH"] = "true"  # share an accelerator with this process
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    return env


_RUNNER = None  # None: not started; False: failed, calibrate in this process
_START_LOCK = threading.Lock()


def _runner():
    global _RUNNER  # pylint: disable=global-statement
    with _START_LOCK:
        if _RUNNER is None:
            try:
                _RUNNER = _Runner()
                atexit.register(_RUNNER.close)
            except OSError as err:
                log.warning("could not start the kernel runner (%s); calibrating kernels in "
                            "this process", err)
                _RUNNER = False
        return _RUNNER or None


def start():
    """Start the kernel runner now (budget mode does, when it is set up): the child then
    imports TensorFlow while the program builds and initialises its model, not during
    the first step's calibration."""
    _runner()


def _serve():
    """The child: answer one request per line until standard input closes."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    from tfmem.memory.emulated import reserve_emulated_memory  # pylint: disable=import-outside-toplevel
    reserve_emulated_memory()
    for line in sys.stdin:
        try:
            request = json.loads(line)
            graph_def = tf.compat.v1.GraphDef.FromString(base64.b64decode(request["graph"]))
            graph = tf.Graph()
            with graph.as_default():
                tf.graph_util.import_graph_def(graph_def, name="")
            scratch_bytes, extra, early = measure_here(graph, request["ops"], request["threads"])
            reply = {"scratch": scratch_bytes, "extra": extra, "early": early}
        except Exception as err:  # pylint: disable=broad-except
            reply = {"error": f"{type(err).__name__}: {err}"}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    _serve()
