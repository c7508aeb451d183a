"""A TensorFlow cluster on this machine: one process per task, for tests and experiments.

Not cluster machinery of tfmem's: every task is TensorFlow's own gRPC server
(`tf.distribute.Server`), each in a process of its own, because a server
started in-process cannot be stopped (GrpcServer::Stop is unimplemented).
Here only the processes are managed:

    enter_private_network()                         # before TensorFlow starts
    with LocalCluster({"ps": 1, "worker": 1}, lifetime=120) as cluster:
        cluster.start_servers()                      # plain servers for every task
        sess = tf.compat.v1.Session(cluster.target("worker", 0))

* TensorFlow's server listens on every interface of its port (GrpcServer
  hard-codes 0.0.0.0, whatever host the cluster spec names).  So the cluster
  runs in a private network namespace whose only interface is loopback:
  `enter_private_network` moves this process there (new user and network
  namespaces, loopback brought up; no root needed where the kernel allows
  unprivileged user namespaces), and every process it starts afterwards, the
  servers and the client alike, inherits it.  `LocalCluster` refuses to start
  a task outside such a namespace unless told `allow_all_interfaces=True`;
* ports are free ports of 127.0.0.1, and the cluster spec names 127.0.0.1;
* every process gets a lifetime (it exits by itself when it runs out, or when
  the process that started it dies), and `stop` (also on leaving the `with`)
  kills what is left, so a failing test or a crashed script leaves nothing running;
* `run_task` starts any command as a task (an experiment's worker that trains
  beside its own server), with its own environment (an allocator cap).

Running this file with `serve` is the server process itself; with
`private -- COMMAND...` it runs COMMAND in a private network namespace
(a portable `unshare -rn` plus `ip link set lo up`); with `probe` it says
whether such a namespace can be made here.
"""

import argparse
import ctypes
import fcntl
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time

READY = "TFMEM-SERVER-READY"


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# --------------------------------------------------------------------------
# a private network: loopback only


class NoPrivateNetwork(RuntimeError):
    """No private network namespace here: servers started now would listen on every
    interface of the machine."""


_CLONE_NEWUSER, _CLONE_NEWNET = 0x10000000, 0x40000000
_SIOCGIFFLAGS, _SIOCSIFFLAGS, _IFF_UP = 0x8913, 0x8914, 0x1
_NAMESPACE_HELP = (
    "It needs unprivileged user namespaces (sysctl user.max_user_namespaces > 0; "
    "kernel.unprivileged_userns_clone=1 on Debian and older Ubuntu kernels; "
    "kernel.apparmor_restrict_unprivileged_userns=0 on Ubuntu 23.10 and later; inside a "
    "container, a seccomp profile that allows unshare), or root with CAP_SYS_ADMIN.")


def in_private_network():
    """True when this process's network namespace has no interface but loopback."""
    return [name for _, name in socket.if_nameindex()] == ["lo"]


def _unshare(flags):
    """None when unshare(2) succeeded, else why not."""
    unshare = getattr(ctypes.CDLL(None, use_errno=True), "unshare", None)
    if unshare is None:
        return "this system has no unshare(2) (Linux only)"
    if unshare(flags) != 0:
        return os.strerror(ctypes.get_errno())
    return None


def _thread_count():
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()


def _bring_loopback_up():
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        request = struct.pack("16sh14x", b"lo", 0)
        flags = struct.unpack("16sh14x", fcntl.ioctl(sock, _SIOCGIFFLAGS, request))[1]
        fcntl.ioctl(sock, _SIOCSIFFLAGS, struct.pack("16sh14x", b"lo", flags | _IFF_UP))


def enter_private_network():
    """Move this process into new user and network namespaces with only loopback, up.

    What `unshare -rn` followed by `ip link set lo up` does, without either tool,
    and with this process's own uid and gid mapped to themselves (files it writes
    keep their owner).  The kernel allows it only in a single-threaded process:
    call it before TensorFlow (or anything that starts threads) is imported.
    Every process started afterwards inherits the namespace.  Does nothing when
    this process is already in one.
    """
    if in_private_network():
        return
    threads = _thread_count()
    if threads > 1:
        raise NoPrivateNetwork(
            f"cannot enter a private network namespace from a process with {threads} threads: "
            "call enter_private_network() before TensorFlow is imported, or start the "
            f"program under `{sys.executable} {os.path.abspath(__file__)} private -- ...`")
    uid, gid = os.geteuid(), os.getegid()
    error = _unshare(_CLONE_NEWUSER | _CLONE_NEWNET)
    if error is None:
        try:
            for path, text in (("/proc/self/setgroups", "deny"),
                               ("/proc/self/uid_map", f"{uid} {uid} 1"),
                               ("/proc/self/gid_map", f"{gid} {gid} 1")):
                with open(path, "w", encoding="ascii") as file:
                    file.write(text)
        except OSError as err:
            raise NoPrivateNetwork(f"made a user namespace but could not map uid {uid} and "
                                   f"gid {gid} into it: {err}") from err
    else:
        # no user namespaces here (a container's seccomp profile, say): root can still
        # make a network namespace alone
        fallback = _unshare(_CLONE_NEWNET) if uid == 0 else "not root"
        if fallback is not None:
            raise NoPrivateNetwork(
                f"cannot make a private network namespace: unshare(CLONE_NEWUSER | "
                f"CLONE_NEWNET) failed ({error}), unshare(CLONE_NEWNET) too ({fallback}). "
                + _NAMESPACE_HELP)
    try:
        _bring_loopback_up()
    except OSError as err:
        raise NoPrivateNetwork(f"could not bring up loopback in the new network namespace: "
                               f"{err}") from err
    if not in_private_network():
        raise NoPrivateNetwork("entered a new network namespace, but it has interfaces "
                               f"other than loopback: {socket.if_nameindex()}")


def private_network_problem(timeout=60):
    """None when a private network namespace can be made here, else why not (a probe
    in a fresh process, since entering one is for single-threaded processes only)."""
    try:
        probe = subprocess.run([sys.executable, os.path.abspath(__file__), "probe"],
                               capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"the namespace probe did not run: {err}"
    if probe.returncode == 0:
        return None
    return (probe.stderr.strip().splitlines() or [f"exit code {probe.returncode}"])[-1]


def run_private(command, timeout, env=None):
    """Run `command` in a private network namespace; return (exit code, its output).

    The command runs in a process group of its own, killed whole when it outlives
    `timeout`, or when this process is interrupted (Ctrl-C) while waiting.
    """
    proc = subprocess.Popen(  # pylint: disable=consider-using-with
        [sys.executable, os.path.abspath(__file__), "private", "--"] + list(command),
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        return proc.returncode, out
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return None, f"{out}\n[killed after {timeout} s]"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def exit_when_orphaned_or_after(lifetime):
    """A daemon thread that ends this process after `lifetime` s or when its parent dies."""
    parent, deadline = os.getppid(), time.monotonic() + lifetime

    def watch():
        while time.monotonic() < deadline and os.getppid() == parent:
            time.sleep(0.5)
        os._exit(3)  # pylint: disable=protected-access

    threading.Thread(target=watch, daemon=True, name="lifetime").start()


class LocalCluster:
    """Tasks of a cluster on 127.0.0.1, each a subprocess killed on `stop`."""

    def __init__(self, jobs, lifetime=120, env=None, allow_all_interfaces=False):
        self.lifetime = lifetime
        self.allow_all_interfaces = allow_all_interfaces
        self.spec = {job: [f"127.0.0.1:{free_port()}" for _ in range(count)]
                     for job, count in jobs.items()}
        self._env = dict(os.environ if env is None else env)
        self._env.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
        self._env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        self._procs = {}  # (job, task) -> Popen

    def target(self, job, task):
        return f"grpc://{self.spec[job][task]}"

    def run_task(self, job, task, command, env=None, **popen):
        """Start `command` as task (job, task); it must create that task's server itself."""
        if not (self.allow_all_interfaces or in_private_network()):
            raise NoPrivateNetwork(
                f"refusing to start /job:{job}/task:{task}: TensorFlow's server would listen "
                "on every interface of this machine. Call enter_private_network() first "
                "(before TensorFlow is imported), or pass allow_all_interfaces=True to accept "
                "that.")
        full_env = dict(self._env, **(env or {}))
        proc = subprocess.Popen(command, env=full_env, **popen)  # pylint: disable=consider-using-with
        self._procs[(job, task)] = proc
        return proc

    def start_server(self, job, task, env=None, timeout=60):
        """A plain TensorFlow server for (job, task); returns once it serves."""
        command = [sys.executable, os.path.abspath(__file__), "serve",
                   "--cluster", json.dumps(self.spec), "--job", job, "--task", str(task),
                   "--lifetime", str(self.lifetime)]
        if self.allow_all_interfaces:
            command.append("--allow-all-interfaces")
        proc = self.run_task(job, task, command, env, stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, text=True)
        deadline = time.monotonic() + timeout
        ready = threading.Event()

        def wait_ready():
            for line in proc.stdout:
                if READY in line:
                    ready.set()
                    return

        threading.Thread(target=wait_ready, daemon=True).start()
        while not ready.wait(0.2):
            if proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the server of /job:{job}/task:{task} did not start "
                                   f"(exit code {proc.poll()})")
        return proc

    def start_servers(self, env=None):
        for job, addresses in self.spec.items():
            for task in range(len(addresses)):
                self.start_server(job, task, env)

    def kill(self, job, task):
        proc = self._procs.pop((job, task), None)
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)

    def stop(self):
        for key in list(self._procs):
            self.kill(*key)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def _serve(argv):
    parser = argparse.ArgumentParser()
    parser.add_argument("command", choices=["serve"])
    parser.add_argument("--cluster", required=True)
    parser.add_argument("--job", required=True)
    parser.add_argument("--task", type=int, required=True)
    parser.add_argument("--lifetime", type=float, required=True)
    parser.add_argument("--allow-all-interfaces", action="store_true")
    args = parser.parse_args(argv)
    exit_when_orphaned_or_after(args.lifetime)
    if not (args.allow_all_interfaces or in_private_network()):
        raise NoPrivateNetwork("refusing to serve outside a private network namespace "
                               "(the server would listen on every interface)")
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    server = tf.distribute.Server(tf.train.ClusterSpec(json.loads(args.cluster)),
                                  job_name=args.job, task_index=args.task, protocol="grpc")
    print(READY, server.target, flush=True)
    server.join()


def _main(argv):
    if argv[:1] == ["private"]:
        command = argv[2:] if argv[1:2] == ["--"] else argv[1:]
        if not command:
            sys.exit("usage: local_cluster.py private -- COMMAND [ARG...]")
        enter_private_network()
        os.execvp(command[0], command)
    elif argv[:1] == ["probe"]:
        enter_private_network()
        print("private network namespace: ok, interfaces", socket.if_nameindex())
    else:
        _serve(argv)


if __name__ == "__main__":
    try:
        _main(sys.argv[1:])
    except NoPrivateNetwork as err:
        sys.exit(f"{type(err).__name__}: {err}")
