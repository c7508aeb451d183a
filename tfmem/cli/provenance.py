"""Where a measured result comes from: commit, TensorFlow version, kernel path, cores, date.

Experiments, the soak and the benchmark write their figures to files that the
README.md and docs/results.md show; each file records what produced it, so that a figure can be
traced to the code and the machine it was measured on.  Nothing here imports
TensorFlow (its version is read from the installed package's metadata).
"""

import datetime
import importlib.metadata
import os
import platform
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _git(*argv):
    try:
        proc = subprocess.run(["git", "-C", str(ROOT), *argv], capture_output=True, text=True,
                              timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout.strip() if proc.returncode == 0 else None


# Result files are what runs write, not what they run: one run's new file must not mark
# the next run of a series as made from uncommitted code.
RESULTS = "experiments/results"


def source():
    """The code a run starts from: {commit, commit_dirty (tracked files other than result
    files differ from it)}.  Read it when a long run starts, so that commits made while it
    runs are not credited."""
    changed = _git("status", "--porcelain", "--untracked-files=no", "--", ":/",
                   f":(top,exclude){RESULTS}")
    return dict(commit=_git("rev-parse", "HEAD"), commit_dirty=bool(changed))


def provenance(kernel_path, started_from=None):
    """A dict: commit and commit_dirty (`started_from`, a `source()` read when the run
    started, or now), tensorflow version, kernel_path (as given: a string or a dict per
    system), cpu_count and usable_cpus, load_average, date (UTC, ISO 8601), python,
    machine."""
    try:
        tf_version = importlib.metadata.version("tensorflow")
    except importlib.metadata.PackageNotFoundError:
        tf_version = None
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    return dict(**(started_from or source()), tensorflow=tf_version, kernel_path=kernel_path,
                cpu_count=os.cpu_count(), usable_cpus=usable,
                load_average=list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                python=platform.python_version(), machine=platform.machine())


def describe(info):
    """One line: commit, TensorFlow, kernel path, cores, load, date."""
    commit = (info.get("commit") or "unknown")[:12]
    if info.get("commit_dirty"):
        commit += " (with uncommitted changes)"
    paths = info.get("kernel_path")
    if isinstance(paths, dict):
        groups = {}
        for system, path in paths.items():
            groups.setdefault(path, []).append(system)
        paths = ", ".join(f"{' and '.join(systems)} {path}" for path, systems in groups.items())
    load = info.get("load_average")
    load = "/".join(f"{v:.1f}" for v in load) if load else "n/a"
    return (f"produced by commit {commit}, TensorFlow {info.get('tensorflow')}, kernel path: "
            f"{paths}; {info.get('usable_cpus')} of {info.get('cpu_count')} CPU cores, load "
            f"average {load} at the end; {info.get('date')}")
