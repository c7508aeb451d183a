"""The BFC allocator replay against TensorFlow's own BFC allocator, and its invariants.

TensorFlow's figures come from a fresh process (the allocator is chosen when
TensorFlow starts) that makes a fixed sequence of eager allocations and frees
and reads the allocator's in-use and peak bytes after each one.
"""

import json
import os
import subprocess
import sys

from hypothesis import given, settings, strategies as st
import pytest

from tfmem.memory.allocator import (MIN_ALLOCATION, AllocationLog, BFCModel, Regions,
                                    replay, rounded)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MIB = 1 << 20
# (name, bytes) to allocate, or (name, None) to free: regions grow (2.5 MiB needs a
# 4 MiB region, handed out whole), chunks split (3 MiB from an 8 MiB region), freed
# chunks coalesce and are reused best-fit.
SEQUENCE = [("a", int(2.5 * MIB)), ("b", 3 * MIB), ("c", 700 << 10), ("d", int(1.2 * MIB)),
            ("a", None), ("e", 1 * MIB), ("c", None), ("f", 600 << 10), ("e", None),
            ("g", int(3.5 * MIB)), ("b", None), ("h", 5 * MIB), ("d", None), ("i", 100 << 10),
            ("f", None), ("j", 9 * MIB)]

SCRIPT = r"""
import json, os, sys
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
import tfmem
from tfmem.memory import emulated
tfmem.emulate_accelerator(int(sys.argv[2]))
import tensorflow as tf
sequence = json.loads(sys.argv[1])
if sys.argv[3] == "reserve":
    tfmem.reserve_emulated_memory()
print(json.dumps(emulated.allocator_regions().reserved))
tensors, figures = {}, []
for name, nbytes in sequence:
    if nbytes is None:
        del tensors[name]
    else:
        tensors[name] = tf.fill([nbytes // 4], 1.0)
    info = tf.config.experimental.get_memory_info("CPU:0")
    figures.append([info["current"], info["peak"]])
print(json.dumps(figures))
"""


def _tensorflow_figures(sequence=SEQUENCE, cap_mib=8192, reserve=False):
    """(regions reserved, [[in use, peak] after each step]) from a fresh process."""
    env = dict(os.environ, TF_ENABLE_ONEDNN_OPTS="0")
    out = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(sequence), str(cap_mib),
                          "reserve" if reserve else "grow"], env=env,
                         cwd=ROOT, capture_output=True, text=True, timeout=300, check=True)
    lines = out.stdout.strip().splitlines()
    return tuple(json.loads(lines[-2])), json.loads(lines[-1])


def _replayed(model, sequence=SEQUENCE):
    handles, replayed = {}, []
    for name, nbytes in sequence:
        if nbytes is None:
            model.free(handles.pop(name))
        else:
            # An eager fill holds a small scalar while it allocates its output.
            scalar = model.allocate(4)
            handles[name] = model.allocate(nbytes)
            model.free(scalar)
        replayed.append([model.in_use, model.peak])
    return replayed


def test_replay_gives_tensorflows_in_use_and_peak_bytes_after_every_step():
    _, measured = _tensorflow_figures()
    model = BFCModel()
    replayed = _replayed(model)
    handles = {name for name, n in SEQUENCE if n} - {name for name, n in SEQUENCE if n is None}
    assert replayed == measured
    # The sequence is worth checking: some chunks were handed out larger than asked.
    requested = sum(n for name, n in SEQUENCE if n and name in handles)
    assert model.in_use > requested


# Under a 24 MiB cap regions of 2, 4 and 8 MiB leave a last one of 10: the 7 MiB request
# lands there and holds all 10 (10 < 2 x 7).  With the cap reserved as one region first,
# every request is split off it.
CAPPED = [("a", int(1.5 * MIB)), ("b", 3 * MIB), ("c", 5 * MIB), ("d", 7 * MIB),
          ("b", None), ("e", 2 * MIB), ("a", None), ("f", 1 * MIB)]


def _within_a_scalar(replayed, measured):
    """Every figure equal, or off by one smallest chunk: on some machines TensorFlow keeps
    an eager fill's scalar a step longer than the op (measured: 256 bytes more in use in
    one figure of the reserved sequence), which the replay frees with the op."""
    return len(replayed) == len(measured) and all(
        abs(a - b) <= MIN_ALLOCATION for r, m in zip(replayed, measured) for a, b in zip(r, m))


@pytest.mark.slow
def test_replay_under_a_cap_gives_tensorflows_figures_with_and_without_the_reservation():
    grown_regions, grown = _tensorflow_figures(CAPPED, cap_mib=24)
    reserved_regions, reserved = _tensorflow_figures(CAPPED, cap_mib=24, reserve=True)
    assert grown_regions == ()
    assert _within_a_scalar(_replayed(BFCModel(Regions(limit=24 * MIB)), CAPPED), grown)
    assert _within_a_scalar(
        _replayed(BFCModel(Regions(reserved_regions, limit=24 * MIB)), CAPPED), reserved)
    # The premise: the last region handed out whole, the reserved one split.
    assert grown[3][0] >= 1.5 * MIB + 3 * MIB + 5 * MIB + 10 * MIB
    assert reserved[-1][1] < grown[-1][1] - 2 * MIB


def test_a_request_the_cap_leaves_no_room_for_reads_more_than_the_cap():
    model = BFCModel(Regions(limit=24 * MIB))
    first = model.allocate(12 * MIB)  # regions 2, 4, 8: none fits; a 16 MiB region
    assert model.needed == model.in_use == 16 * MIB <= model.limit
    second = model.allocate(9 * MIB)  # 8 MiB left under the cap: TensorFlow runs out
    assert model.needed > 24 * MIB
    model.free(second)
    assert model.needed == model.in_use == 16 * MIB
    model.free(first)


def test_the_replay_says_which_partitions_it_could_not_serve_under_the_cap():
    log = AllocationLog()
    log.partition(0)
    log.allocate("a", 12 * MIB)  # a 16 MiB region, handed out whole (16 < 2 x 12)
    log.partition(1)
    log.allocate("b", 9 * MIB)  # 8 MiB left under the cap
    log.release("b")
    log.release("a")
    peaks, served = replay(log, steps=1, regions=Regions(limit=24 * MIB))
    assert served == {0: True, 1: False}
    assert peaks[0] == 16 * MIB < 24 * MIB < peaks[1]
    _, unlimited = replay(log, steps=1)
    assert unlimited == {0: True, 1: True}


def test_kernels_running_at_once_ask_for_their_scratch_separately():
    """Two 27 MiB scratch buffers fit two 30 MiB regions; one 54 MiB buffer would not."""
    regions = Regions((30 * MIB, 30 * MIB), limit=60 * MIB)
    for sizes, fits in (((27 * MIB, 27 * MIB), True), ((54 * MIB,), False)):
        log = AllocationLog()
        log.partition(0)
        log.scratch(*sizes)
        assert replay(log, steps=1, regions=regions)[1] == {0: fits}, sizes


def test_bytes_held_for_others_come_off_the_limit_and_the_reserved_region():
    alone = BFCModel(Regions(limit=24 * MIB))
    beside = BFCModel(Regions(limit=24 * MIB, occupied=8 * MIB))
    for model in (alone, beside):
        model.allocate(12 * MIB)  # a 16 MiB region, handed out whole
        model.allocate(3 * MIB)  # alone: an 8 MiB region fits under the cap; beside: none
    assert not alone.beyond_limit and alone.needed == 19 * MIB  # the 8 MiB region split
    assert beside.beyond_limit and beside.needed > 16 * MIB
    assert BFCModel(Regions((2 * MIB, 22 * MIB), limit=24 * MIB, occupied=8 * MIB)).pool \
        == 16 * MIB


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 6 * MIB)), min_size=1, max_size=60))
def test_chunks_cover_requests_and_coalesce_back_into_regions(operations):
    model, live = BFCModel(), []
    for allocate, nbytes in operations:
        if allocate or not live:
            handle = model.allocate(nbytes)
            live.append((handle, nbytes))
            chunk = model.chunk_of(handle)
            # A chunk is the rounded request, or one too small to split (< twice it).
            assert rounded(nbytes) <= chunk < 2 * rounded(nbytes) or chunk == rounded(nbytes)
        else:
            handle, _ = live.pop(nbytes % len(live))
            model.free(handle)
        assert model.requested == sum(n for _, n in live)
        assert model.requested <= model.in_use <= model.peak <= model.pool
    for handle, _ in live:
        model.free(handle)
    assert model.in_use == model.requested == 0
    # Every region is one free chunk again.
    assert len(model._free) == model.regions  # pylint: disable=protected-access
    assert sum(size for size, _ in model._free) == model.pool  # pylint: disable=protected-access


def test_the_reservation_refuses_once_the_device_has_allocated():
    script = ("import tfmem; tfmem.emulate_accelerator(64)\n"
              "import tensorflow as tf\n"
              "kept = tf.fill([1 << 18], 1.0)\n"
              "try:\n"
              "    tfmem.reserve_emulated_memory()\n"
              "except RuntimeError as err:\n"
              "    print('refused:', err)\n")
    env = dict(os.environ, TF_ENABLE_ONEDNN_OPTS="0", TF_CPP_MIN_LOG_LEVEL="3")
    out = subprocess.run([sys.executable, "-c", script], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=300, check=True)
    assert "refused: reserve_emulated_memory must run before anything is allocated" in out.stdout


def _replayed_by_hand(log, steps, regions):
    """`replay`'s per-partition peaks and served flags of one arrangement of `log` (no
    uploads), each step replayed in full on one BFCModel, the last one measured."""
    model = BFCModel(regions)
    handles = {buffer: model.allocate(nbytes) for _, buffer, nbytes in log.state}
    peaks, served, current = {}, {}, None
    for step in range(steps):
        last = step == steps - 1
        for event in log.step:
            if event[0] == "partition":
                current = event[1]
                if last:
                    peaks[current], served[current] = model.needed, not model.beyond_limit
                continue
            if event[0] == "alloc":
                handles[event[1]] = model.allocate(event[2])
            else:
                model.free(handles.pop(event[1], None))
            if last:
                peaks[current] = max(peaks[current], model.needed)
                served[current] = served[current] and not model.beyond_limit
    return peaks, served


@settings(max_examples=80, deadline=None)
@given(st.lists(st.lists(st.tuples(st.booleans(), st.integers(1, 3 * MIB)), min_size=1,
                         max_size=12), min_size=1, max_size=4),
       st.lists(st.integers(1, 4 * MIB), max_size=3), st.integers(4, 24),
       st.integers(0, 3), st.booleans())
def test_a_replayed_step_is_the_last_of_steps_replayed_in_full(partitions, state, reserved_mib,
                                                                 kept, reserved):
    """Whatever the layout, and whether a step gives back all it took or keeps some of it
    (`kept` buffers, held to the next step) or takes a region beyond the reservation,
    the measured step is the one after the steps before it replayed in full."""
    log = AllocationLog()
    for index, nbytes in enumerate(state):
        log.allocate_state(("state", index), nbytes)
    live = []
    for index, operations in enumerate(partitions):
        log.partition(index)
        for allocate, nbytes in operations:
            if allocate or not live:
                live.append(("buffer", len(log.step)))
                log.allocate(live[-1], nbytes)
            else:
                log.release(live.pop(nbytes % len(live)))
    for key in live[kept:]:
        log.release(key)
    regions = Regions(reserved=(reserved_mib * MIB,) if reserved else (),
                      limit=reserved_mib * MIB)
    for steps in (1, 2, 3):
        assert replay(log, steps=steps, regions=regions) == \
            _replayed_by_hand(log, steps, regions), steps
