"""A TensorFlow cluster on this machine: one process per task, for tests and experiments.

Not cluster machinery of tfmem's: every task is TensorFlow's own gRPC server
(`tf.distribute.Server`), each in a process of its own, because a server
started in-process cannot be stopped (GrpcServer::Stop is unimplemented).
Here only the processes are managed:

    with LocalCluster({"ps": 1, "worker": 1}, lifetime=120) as cluster:
        cluster.start_servers()                      # plain servers for every task
        sess = tf.compat.v1.Session(cluster.target("worker", 0))

* ports are free ports of 127.0.0.1, and the cluster spec names 127.0.0.1
  (TensorFlow's server listens on every interface of its port: GrpcServer
  hard-codes 0.0.0.0; the tasks here only ever dial 127.0.0.1);
* every process gets a lifetime (it exits by itself when it runs out, or when
  the process that started it dies), and `stop` (also on leaving the `with`)
  kills what is left, so a failing test or a crashed script leaves nothing running;
* `run_task` starts any command as a task (an experiment's worker that trains
  beside its own server), with its own environment (an allocator cap).

Running this file with `serve` is the server process itself.
"""

import argparse
import json
import os
import socket
import subprocess
import sys
import threading
import time

READY = "TFMEM-SERVER-READY"


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


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

    def __init__(self, jobs, lifetime=120, env=None):
        self.lifetime = lifetime
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
        full_env = dict(self._env, **(env or {}))
        proc = subprocess.Popen(command, env=full_env, **popen)  # pylint: disable=consider-using-with
        self._procs[(job, task)] = proc
        return proc

    def start_server(self, job, task, env=None, timeout=60):
        """A plain TensorFlow server for (job, task); returns once it serves."""
        command = [sys.executable, os.path.abspath(__file__), "serve",
                   "--cluster", json.dumps(self.spec), "--job", job, "--task", str(task),
                   "--lifetime", str(self.lifetime)]
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
    args = parser.parse_args(argv)
    exit_when_orphaned_or_after(args.lifetime)
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    server = tf.distribute.Server(tf.train.ClusterSpec(json.loads(args.cluster)),
                                  job_name=args.job, task_index=args.task, protocol="grpc")
    print(READY, server.target, flush=True)
    server.join()


if __name__ == "__main__":
    _serve(sys.argv[1:])
