"""Budget: the plan with the fewest partitions whose predicted step fits in device memory.

Users state how much device memory they have; tfmem finds the plan.  The
simulator predicts each candidate's peak, so the search runs no TensorFlow:

1. the whole step as one partition: if it fits, the step runs at plain
   TensorFlow's speed;
2. otherwise halve the partition size until a plan fits, then search between
   that size and the one above it for the fewest partitions that fit, exactly
   below 2 x `SIZE_PRECISION` ops and to within 1/`SIZE_PRECISION` of the size
   above (a few ops more or less in a partition of thousands change nothing a
   step costs, and every bisection step is a whole prediction); a size that
   slices as many partitions as the best found so far is not predicted: it
   would save no Session call.  At each size, try the user's swap distance
   first and shorter distances (more swapping) after.  A candidate is rejected
   at the first partition found over the budget (those that start with the most
   resident are predicted first), the others unsimulated, and a partition as
   soon as one of the orders its ops may run in goes over;
3. coarsen: one large partition usually does not fit where one op of the step
   (a convolution's gradient and its scratch) fills the device, while everywhere
   else it would.  So partitions of 2, 4, 8 ... times the size found, sliced at
   that size only where such a partition goes over the budget (each
   prediction makes the partitions over it fine, with 1, 2, 4 ... of the
   coarse partitions before them in successive rounds, and the plan is
   predicted again), for as long as that gives fewer partitions: fewer
   Session calls, fewer callables (not once budget mode has learned).  On the
   whole device, where the allocator replay can find no chunk far from what
   made a plan coarse and that growth finds nothing, parts of the plan are
   raised to the next size one at a time (the whole, halves, quarters ...),
   each kept where the plan fits;
4. if even one op per partition with every tensor swapped does not fit, say
   which op alone is too large.

Predictions include each kernel's scratch memory, measured once per kernel
configuration (`scratch.calibrate`), are made with device copies held to the
end of each partition that frees them, plus an allowance for chunks the
replayed order does not show (`chunk_slack`), and must fit `budget * (1 -
margin)` (10 % by default) in one of two ways:

- a budget below the device's memory (or a device whose limit the replay does
  not know) is a ceiling on what TensorFlow reports in use: each partition's
  peak is the larger of the bytes requested and the same allocations replayed
  in the BFC allocator's chunks (`allocator.replay`);
- a budget of the whole device: TensorFlow's in-use figure cannot pass the
  device, and a step fails only when a request finds no chunk.  A chunk the
  allocator hands out whole can make the in-use figure the whole device while
  every request is served (a 27 MiB scratch buffer in a 49 MiB free tail: 49 <
  2 x 27, not split), so here the bytes requested must fit with the margin and
  the replay under the device's limit, with the margin held back, must serve
  every request (`served`).

Budget mode learns: after each measured step, `TFMemSession` and `tfmem.function`
compare every partition's measured peak with its prediction (`Correction`, through
`learning.learn_from_step`).  When the step went over, every partition's working
set (its peak above what is resident when it starts) is scaled by the factor that
brings the step's prediction to its measured peak, and the next step runs a plan
fitted with the corrected model.  The step that went over is never run again: it
may have updated variables.  A step that ran out of device memory with the bytes it
asked for free, in no chunk that large, teaches a larger margin instead
(`Correction.held_back`, `learned_margin`).
"""

import collections
import dataclasses
import functools
import logging
import math
import re

from tfmem.plan.analyse import split_tensor_name
from tfmem.errors import BudgetError
from tfmem.plan.partition import (depth_first_order, slice_order, slice_order_mixed,
                                  slice_order_sized)
from tfmem.plan.place import place
from tfmem.plan.build import Slicing, build_plan, validate
from tfmem.memory.simulate import (ALIASING, CandidateShare, TensorSizes, simulate,
                                   state_bytes)
from tfmem.memory.sizes import MIB, mib
from tfmem.plan.swap import SwapPolicy
from tfmem.plan.units import units
from tfmem.plan.updates import updates_last

log = logging.getLogger(__name__)

# What the model does not see: the executor's order of concurrent ops, and the
# allocator's free chunks left by what the process ran before.  Before the chunk
# replay, the 12-layer MLP in one partition measured 35-36 MiB against a 32.0 MiB
# prediction (+12.5 %) and needed a 15 % margin; in chunks it is predicted at
# 34.0 MiB (33.0 replayed + 1.0 slack), so 36 MiB is within 10 %.
DEFAULT_MARGIN = 0.10
_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1 << 10, "m": 10**6, "mb": 10**6,
          "mib": 1 << 20, "g": 10**9, "gb": 10**9, "gib": 1 << 30, "t": 10**12,
          "tb": 10**12, "tib": 1 << 40}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value):
    """Bytes from an int or a string such as "2GiB", "512 MiB", "1.5GB", "1000"."""
    if isinstance(value, bool):
        raise ValueError(f"a memory size must be bytes or a string like '2GiB', got {value!r}")
    if isinstance(value, (int, float)):
        number, unit = value, ""
    else:
        match = _SIZE.match(str(value))
        if not match or match.group(2).lower() not in _UNITS:
            raise ValueError(f"cannot read {value!r} as a memory size: use bytes or a number "
                             "with a unit (B, KB, KiB, MB, MiB, GB, GiB, TB, TiB), e.g. '2GiB'")
        number, unit = float(match.group(1)), match.group(2).lower()
    if number < 0:
        raise ValueError(f"a memory size must be >= 0, got {value!r}")
    return int(number * _UNITS[unit])


def _largest_op(view, size_of, scratch):
    """(name, type, bytes read, written and scratch) of the op that needs the most memory
    alone; an op whose outputs view its inputs (Identity, IdentityN) writes nothing."""
    best = ("", "", 0)
    known = set(view.nodes) | set(view.sources)
    for name, node in view.nodes.items():
        total = scratch.get(name, 0)
        total += sum(size_of(t) for t in node.inputs if split_tensor_name(t)[0] in known)
        if node.type not in ALIASING:
            total += sum(size_of(t) for t in node.output_names)
        if total > best[2]:
            best = (name, node.type, total)
    return best


class Correction:
    """What budget mode learned from measured steps of one request.

    `scratch`: kernel scratch bytes per op seen in the request's own steps (from
    their step statistics) where it exceeded the calibration; `factor`: what the
    measured working sets still exceed the predicted ones by once those are in (the
    executor's order, the allocator's chunks), 1.0 until then (see `scaled`);
    `held_back`: bytes held back beyond the margin, learned from steps that ran out of
    device memory with enough of it free, in no chunk large enough (fragmentation: the
    executor's concurrent ops, the prefetcher's uploads and what else the process
    allocated leave layouts the replay of one order does not show; see
    `learn_fragmentation`).
    """

    def __init__(self):
        self.factor = 1.0
        self.scratch = {}
        self.held_back = 0
        self.measured_again = None  # the request's kernels measured again, once (learning)

    def went_over(self, trace, measured_peaks):
        """True when a step's measured peaks (None: a peak not known) exceed `trace`'s
        prediction, the one its plan was fitted to."""
        if not measured_peaks or len(measured_peaks) != len(trace.partitions):
            return False
        known = [m for m in measured_peaks if m is not None]
        return bool(known) and max(known) > scaled(trace, self.factor).peak_device

    def learn(self, trace, measured_peaks, scratch_seen, predict, whole_device=False):
        """Compare a step's measured peak with `trace`'s (the plan was fitted to that);
        when it went over, take in the kernel scratch the step measured, and set the
        factor from the prediction `predict(scratch)` makes with it.  True when
        something was learned.

        On the whole device (`whole_device`) only new kernel scratch is learned: there
        the in-use figure of a step that ran can be the whole device (a chunk handed out
        whole) while every request was served, which is what the plan was fitted to; a
        factor from it would shrink every later prediction's room for nothing, until
        nothing fits.  A step that runs out teaches that (`learn_out_of_memory`)."""
        if not self.went_over(trace, measured_peaks):
            return False
        known = [m for m in measured_peaks if m is not None]
        new = self._take_in(scratch_seen)
        if whole_device:
            return bool(new)
        self.factor = max(self.factor, _reaching(predict(self.scratch), max(known)))
        return True

    def learn_out_of_memory(self, index, available, scratch_seen, predict, unsized=None):
        """Partition `index` of a step ran out of device memory: it needed more than
        `available` bytes.  Take in the kernel scratch measured again, and `unsized` ((op,
        bytes) of the failed allocation, where the model had sized nothing that large for
        the op) as that op's scratch, then raise the factor until that partition's
        prediction (its bytes requested, the smaller figure) reaches `available`.  Returns
        the prediction `predict(scratch)` made with that scratch."""
        self._take_in(scratch_seen)
        if unsized is not None:
            self._take_in(dict([unsized]))
        corrected = predict(self.scratch)
        failed = corrected.partitions[index]
        working_set = failed.device_peak_requested - failed.device_before
        if working_set > 0:
            self.factor = max(self.factor, (available - failed.device_before) / working_set)
        return corrected

    def learn_fragmentation(self, request):
        """A step ran out of device memory on a `request` of that many bytes while the
        device had them free, though in no chunk that large: hold back that much more, so
        that the next plan peaks lower and leaves the allocator that much more room (the
        bytes were right: no working set is scaled)."""
        self.held_back += request

    def _take_in(self, scratch_seen):
        """Raise the learned scratch to `scratch_seen`'s figures; the ones that raised it."""
        new = {name: nbytes for name, nbytes in scratch_seen.items()
               if nbytes > self.scratch.get(name, 0)}
        self.scratch.update(new)
        return new


# The bisection stops when the bracket is within 1/SIZE_PRECISION of the largest size
# that fits (exact below twice that many ops).
SIZE_PRECISION = 32
# A coarsened plan (step 3 of the search) is predicted at most this many times per
# partition size: each prediction makes fine the partitions that went over and
# 1, 2, 4 ... of the coarse ones before each.
COARSENING_ROUNDS = 12


def learned_factor(correction):
    """The factor `correction` has learned (1.0 before any, or without a correction)."""
    return correction.factor if correction is not None else 1.0


def learned_margin(margin, correction, budget_bytes, regions):
    """`margin` raised by the bytes `correction` has learned to hold back, as a share of
    the budget (of the device, where the budget is the whole device)."""
    held = correction.held_back if correction is not None else 0
    if not held:
        return margin
    usable = regions.limit if on_whole_device(budget_bytes, regions) else budget_bytes
    return min(margin + held / usable, 1.0)


def scaled(trace, factor):
    """`trace` with every partition's working set, its peak above what is resident when it
    starts (state, kept tensors, uploads), scaled by `factor`: the learned correction.

    What is resident is counted exactly; what the model misses (the executor running
    ops in another order, chunks) lies in what a partition allocates while it runs.  A
    factor on the whole peak would also scale the kept tensors that a plan of smaller
    partitions swaps out, until no plan fits (in the DeepSpeech search a factor of 1.16
    on whole peaks, after a step out of memory in one partition, left not even one op per
    partition fitting)."""
    if factor == 1.0:
        return trace
    return dataclasses.replace(trace, partitions=tuple(
        dataclasses.replace(p, device_peak=_grown(p.device_peak, p.device_before, factor),
                            device_peak_requested=_grown(p.device_peak_requested,
                                                         p.device_before, factor),
                            device_peak_chunks=_grown(p.device_peak_chunks, p.device_before,
                                                      factor))
        for p in trace.partitions))


def _grown(peak, before, factor):
    """`peak` with its part above `before` (a working set) scaled by `factor`."""
    return before + math.ceil((peak - before) * factor) if peak > before else peak


def _reaching(trace, peak):
    """The smallest factor whose `scaled(trace, factor)` predicts at least `peak` bytes in
    some partition (1.0 when no partition has a working set to scale)."""
    return min(((peak - p.device_before) / (p.device_peak - p.device_before)
                for p in trace.partitions if p.device_peak > p.device_before), default=1.0)


def merged_scratch(calibrated, correction):
    """Calibrated kernel scratch, raised to what the request's own steps measured."""
    return _raised(calibrated, correction.scratch if correction is not None else None)


def _raised(scratch, extra):
    """{op: bytes} of `scratch`, each raised to `extra`'s figure where that is larger."""
    if not extra:
        return scratch
    merged = dict(scratch)
    for name, nbytes in extra.items():
        merged[name] = max(nbytes, merged.get(name, 0))
    return merged


def chunk_slack(view, size_of):
    """Budget mode's allowance for the device allocator's chunks: the largest tensor the
    request computes.  TensorFlow's BFC allocator hands a free chunk out whole when
    splitting it would leave less than the request (a 1 MiB tensor can hold a 1.75
    MiB chunk), which no tensor-level model predicts; measured, it cost the 12-layer
    MLP 2-4 MiB (one to three 1 MiB tensors' worth) at its peak.  Ops whose outputs
    view a buffer (a variable's read, an identity) allocate no chunk and are left out."""
    return max((size_of(f"{name}:{i}") for name, node in view.nodes.items()
                if node.type not in ALIASING for i in range(len(node.outputs))), default=0)


def predict(plan, sizing, extra_scratch=None):
    """The MemoryTrace budget mode plans with, from the request's Sizing: kernel scratch
    (calibrated, raised to `extra_scratch`), device copies held to the end of each
    partition that frees them, the allocator's chunks (the larger of the requested and
    the BFC-chunk figures) and its chunk slack."""
    return simulate(plan, sizing.shapes, early_frees=False,
                    scratch=_raised(sizing.scratch, extra_scratch),
                    slack=chunk_slack(plan.view, TensorSizes(plan.view, sizing.shapes)), chunks=True,
                    **sizing.simulate_options())


def on_whole_device(budget_bytes, regions):
    """Whether the budget is the whole device whose limit the allocator replay knows."""
    return regions.limit is not None and budget_bytes >= regions.limit


def _limit(budget_bytes, margin, others, regions):
    """Bytes a corrected prediction may reach: the budget (at most the device) less its
    margin and what the device holds beyond the request's own state."""
    if on_whole_device(budget_bytes, regions):
        budget_bytes = regions.limit
    return budget_bytes * (1 - margin) - others


def _held_back(budget_bytes, margin, regions):
    """Bytes of the device the replay holds back on the whole device: its margin."""
    return int(regions.limit * margin) if on_whole_device(budget_bytes, regions) else 0


def _fits(trace, budget_bytes, limit, others, margin):
    """Whether `trace` fits: on the whole device, its requested bytes within `limit` and
    every request served by the replay with the margin and at least `others` held back;
    otherwise its peak, the larger of requested and chunk bytes, within `limit`."""
    if on_whole_device(budget_bytes, trace.regions):
        held = _held_back(budget_bytes, margin, trace.regions)
        return (trace.peak_device_requested <= limit and trace.served
                and trace.regions.occupied >= others + held)
    return trace.peak_device <= limit


# What the device holds beyond a request's state after its steps that is the request's own:
# its callables' constants and every buffer in a chunk of 256 bytes (a 12-layer MLP's
# steps left 255 KiB).  `still_fits` does not read it as another's.
OWN_LEFTOVERS = MIB


def still_fits(trace, budget_bytes, resident_bytes, margin=DEFAULT_MARGIN, correction=None):
    """Whether a plan fitted earlier, predicted `trace`, still fits now that the device holds
    `resident_bytes`.  What it holds beyond the request's state can grow after planning:
    a variable that shares its buffer with another tensor (its initializer's value, which
    the initializing run's executor keeps) is copied by its first update, so a training
    step's first update leaves up to a copy of the updated variables behind; other
    requests and sessions allocate too (beyond OWN_LEFTOVERS)."""
    others = max(resident_bytes - trace.state_bytes - OWN_LEFTOVERS, 0)
    factor = learned_factor(correction)
    margin = learned_margin(margin, correction, budget_bytes, trace.regions)
    return _fits(scaled(trace, factor), budget_bytes,
                 _limit(budget_bytes, margin, others, trace.regions), others, margin)


def fits_by_measurement(step_bytes, budget_bytes, resident_bytes, regions,
                        margin=DEFAULT_MARGIN):
    """Whether a plan whose measured steps each took at most `step_bytes` (TensorFlow's
    peak less what the device held when the step started) fits beside `resident_bytes`:
    within the budget, at most the device, less the margin.  A measured step is what the
    model predicts; where the two disagree after the device grew, the measurement rules."""
    usable = budget_bytes if regions.limit is None else min(budget_bytes, regions.limit)
    return resident_bytes + step_bytes <= usable * (1 - margin)


def fit(view, sizing, budget_bytes, policy=SwapPolicy(), accelerator=None,
        margin=DEFAULT_MARGIN, resident_bytes=0, correction=None, prefer=(), coarsen=True,
        refine=None):
    """(plan, trace) of the fewest partitions (to within 1/SIZE_PRECISION of the largest
    size) whose predicted peak fits the budget.

    `view`: the request as `analyse` returned it; `sizing`: its `Sizing` at the fed
    shapes (tensor shapes and kernel scratch, read from the graph once by the caller).
    Pure: runs no TensorFlow.

    `resident_bytes`: what the device holds already (its allocator's current bytes).
    Beyond the request's own variables and constants, which every prediction counts,
    it is taken off the budget: other requests' variables, tensors of other sessions.
    `correction`: a `Correction` learned from measured steps (its kernel scratch, and
    its factor predictions are scaled by).
    `prefer`: plans of the same request already compiled (for other feed shapes); the
    one with the fewest partitions that fits these shapes is returned, so its copies
    serve them and the session graph does not grow.
    `coarsen`: False for a plan whose partitions all have the size found (step 3 of
    the search left out), as a `partition_size` the user may set would make.
    `refine(plan, predict, fits, over)`: where no plan of `prefer` fits, (plan, trace)
    made from one of them in this search's terms, or None (see memory/refine.py).

    Candidates slice the depth-first order with what changes state moved last, a
    partition starting there where the step has more than one (`updates.updates_last`):
    a step that runs out of device memory before it has changed nothing and is run
    again.  Where no plan of that order fits (the updates' inputs held to the end cost
    too much), the depth-first order is searched.
    """
    margin = learned_margin(margin, correction, budget_bytes, sizing.regions)
    groups = units(view)
    depth_first = depth_first_order(view, groups)
    order, cut = updates_last(view, groups, depth_first)
    search = functools.partial(_search, view, sizing, budget_bytes, policy, accelerator,
                               margin, resident_bytes, correction, prefer, coarsen, groups,
                               refine)
    if cut is None:
        return search(order, None)
    try:
        return search(order, cut)
    except BudgetError as late:
        plan, trace = search(depth_first, None)
        log.info("no plan with the step's updates last fits (%s); planned with each update "
                 "where it comes: a step that runs out of device memory after the first "
                 "update has run is not run again", str(late).split(":", 1)[0])
        return plan, trace


def _search(view, sizing, budget_bytes, policy, accelerator, margin, resident_bytes,
            correction, prefer, coarsen, groups, refine, order, cut):
    """`fit`'s search over slicings of `order` (unit indices), a partition starting at
    position `cut` (None: anywhere) in every plan of more than one partition."""
    whole = max(len(view.nodes), 1)

    def sliced(size):
        return slice_order(groups, order, size, cut if size < whole else None)
    shapes = sizing.shapes
    share = CandidateShare(TensorSizes(view, shapes))  # by every candidate plan
    scratch = merged_scratch(sizing.scratch, correction)
    factor = learned_factor(correction)
    slack = chunk_slack(view, share.sizes)
    placement = place(view, accelerator)
    others = max(resident_bytes - state_bytes(view, share.sizes), 0)
    options = sizing.simulate_options()
    # The replay takes what others hold off the device, rounded up to a MiB (a device
    # that later holds a few KiB more, as allocator figures move, still has its plan
    # served), and on the whole device the margin too: every request must find a chunk
    # with the margin held back, not only in a layout the replay fills to the last
    # byte (two 27 MiB scratch buffers in a 54 MiB region were served in the replay and
    # ran out in TensorFlow).
    held = _held_back(budget_bytes, margin, sizing.regions)
    options["regions"] = dataclasses.replace(sizing.regions,
                                             occupied=-(-others // MIB) * MIB + held)
    limit = _limit(budget_bytes, margin, others, sizing.regions)

    def within_budget(trace):
        return trace is not None and _fits(scaled(trace, factor), budget_bytes, limit, others,
                                           margin)

    def over_budget(partition, peak=None):  # its bytes requested alone fail `_fits`
        peak = partition.device_peak if peak is None else peak
        return _grown(peak, partition.device_before, factor) > limit

    for plan in sorted(prefer, key=lambda p: len(p.partitions)):
        if plan.view == view:  # its placement is the caller's to check
            trace = simulate(plan, shapes, early_frees=False, scratch=scratch, slack=slack,
                             chunks=True, share=share, **options)
            if within_budget(trace):
                return plan, trace
    for plan in sorted(prefer, key=lambda p: len(p.partitions)) if refine else ():
        refined = plan.view == view and refine(plan, lambda p: simulate(
            p, shapes, early_frees=False, scratch=scratch, slack=slack, chunks=True,
            share=share, **options), within_budget, over_budget)
        if refined:
            return refined
    distances = range(policy.swap_distance, -1, -1) if policy.mode == "auto" else [None]
    tried = {}

    def partition_count(size):  # of a plan at this size: not more at a larger one
        return len(sliced(size))

    slicings = {}  # size -> its Slicing, for every swap distance tried at that size
    # size -> (transfers, trace) of the last distance predicted there: a shorter distance
    # that swaps no more tensors makes the same plan (the policy aside), predicted the same
    last_predicted = {}

    def candidate(size, distance):
        """(plan, trace) at this size and swap distance (None: the policy's), predicted."""
        swaps = policy if distance is None else dataclasses.replace(policy, swap_distance=distance)
        if size not in slicings:
            slicings[size] = Slicing.of(view, sliced(size))
        plan = build_plan(view, None, size, swaps, placement, slicings[size])
        transfers, trace = last_predicted.get(size, (None, None))
        if transfers != plan.transfers:
            trace = simulate(plan, shapes, early_frees=False, scratch=scratch, slack=slack,
                             chunks=True, share=share, give_up=over_budget,
                             reject=lambda trace: not within_budget(trace), **options)
            last_predicted[size] = (plan.transfers, trace)
        return plan, trace

    def attempt(size):
        """The best-fitting plan at this partition size, or None: the longest swap
        distance that fits (its partitions are simulated once for all distances)."""
        if size not in tried:
            tried[size] = None
            for distance in distances:
                fitted = candidate(size, distance)
                if within_budget(fitted[1]):
                    tried[size] = fitted
                    break
        return tried[size]

    size, fits = whole, attempt(whole)
    while fits is None and size > 1:
        size = max(size // 2, 1)
        fits = attempt(size)
    if fits is None:
        trace = scaled(simulate(build_plan(view, sliced(1), 1,
                                           dataclasses.replace(policy, swap_distance=0),
                                           placement),
                                shapes, early_frees=False, scratch=scratch, slack=slack,
                                chunks=True, share=share, **options), factor)
        name, kind, nbytes = _largest_op(view, share.sizes, scratch)
        on_device = on_whole_device(budget_bytes, sizing.regions)
        needs = trace.peak_device_requested if on_device else trace.peak_device
        held_text = (f", after {mib(others)} the device holds beyond the request's own "
                     "variables and constants, such as other requests' tensors or the "
                     "variables a tf.function reads as inputs" if others >= MIB // 20 else "")
        state_text = (f" ({mib(trace.state_bytes)} of it the request's variables and constants)"
                      if trace.state_bytes >= MIB // 20 else "")  # 0.0 MiB is left out
        raise BudgetError(
            f"nothing fits in a device-memory budget of {mib(budget_bytes)} (predictions must "
            f"stay under {mib(limit)}{held_text}): even one op per partition needs "
            f"{mib(needs)}{state_text}"
            + (" and the device's allocator cannot serve its requests within its "
               f"{mib(sizing.regions.limit)} with the margin held back"
               if on_device and not trace.served else "")
            + f". The largest op, '{name}' ({kind}), alone reads, writes and needs as scratch "
            f"{mib(nbytes)}. Raise the budget, or "
            "shrink the batch or that op.")
    # `found` fits; search (found, high) for the largest size that fits, where sizes
    # slicing as many partitions as `found`'s are not tried: they would save no call.
    found = low = size
    high = min(size * 2, whole)
    while high - low > max(1, low // SIZE_PRECISION):
        middle = (low + high) // 2
        if partition_count(middle) >= partition_count(found):
            low = middle
        elif attempt(middle) is None:
            high = middle
        else:
            found = low = middle
    low = found
    plan, trace = tried[low]

    def coarsened(size, fine):
        """(plan, trace) with partitions of `size` ops, but of `low` ops at the positions
        of the order in `fine` (grown in place where partitions go over), or None."""
        for round_ in range(COARSENING_ROUNDS):
            partitions, positions = slice_order_mixed(groups, order, size, low, fine, cut)
            if len(partitions) >= len(plan.partitions):
                return None
            coarse = build_plan(view, partitions, size, plan.policy, placement)
            coarse_trace = simulate(coarse, shapes, early_frees=False, scratch=scratch,
                                    slack=slack, chunks=True, share=share, **options)
            if within_budget(coarse_trace):
                return coarse, coarse_trace
            over = [p.index for p in coarse_trace.partitions
                    if over_budget(p, p.device_peak_requested)] or \
                [max(coarse_trace.partitions, key=lambda p: p.device_peak).index]
            # Fine: the coarse partitions among each one over and the ones before it,
            # 1, 2, 4 ... of them in successive rounds (what the partitions before hold
            # can be what does not fit).
            grown = set()
            for index in over:
                coarse_before = [i for i in range(index, -1, -1)
                                 if not fine.issuperset(positions[i])]
                for i in coarse_before[:2 ** round_]:
                    grown.update(positions[i])
            if not grown:
                return None
            fine.update(grown)
        return None

    def raised(size, levels):
        """(plan, trace, levels) with the positions of the order at `size // 2` ops a
        partition (`levels`: each position's size) raised to `size` where the plan still
        fits: all of them, then halves, quarters ... of them (at most COARSENING_ROUNDS
        predictions), each part kept when the plan with it fits; None when no part is.
        On the whole device the replayed allocator can fail a coarse plan where it finds
        no chunk, far from what made the plan coarse: growing fine partitions around the
        one that failed (`coarsened`) then finds nothing; parts of the plan tried one by
        one do."""
        parts = collections.deque([[p for p, level in enumerate(levels) if level == size // 2]])
        best, fewest, predictions = None, len(plan.partitions), 0
        while parts and predictions < COARSENING_ROUNDS:
            part = parts.popleft()
            trial = list(levels)
            for position in part:
                trial[position] = size
            partitions, _ = slice_order_sized(groups, order, trial, cut)
            if len(partitions) >= fewest:
                continue  # no fewer calls (nor would its halves make fewer)
            predictions += 1
            coarse = build_plan(view, partitions, size, plan.policy, placement)
            coarse_trace = simulate(coarse, shapes, early_frees=False, scratch=scratch,
                                    slack=slack, chunks=True, share=share,
                                    give_up=over_budget,
                                    reject=lambda trace: not within_budget(trace), **options)
            if within_budget(coarse_trace):
                best, levels, fewest = (coarse, coarse_trace, trial), trial, len(partitions)
            elif len(part) >= 4 * size:  # halves of two partitions and more
                parts += [part[:len(part) // 2], part[len(part) // 2:]]
        return best

    # Once budget mode has learned (after a step over its prediction or out of memory),
    # plans stay uniform: one factor scales every working set, and a coarse partition
    # holding a tensor of unknown size ran out again and again (tests/test_oom_run_again.py).
    size, fine, levels = low * 2, set(), None
    while coarsen and correction is None and size < whole:
        if levels is None:
            fine_so_far = set(fine)
            better = coarsened(size, fine)
            if better is not None:
                plan, trace = better
                size *= 2
                continue
            if not on_whole_device(budget_bytes, sizing.regions):
                break  # below the device a plan fails by its bytes, where growth looks
            levels = [low if position in fine_so_far else size // 2
                      for position in range(len(order))]
        better = raised(size, levels)
        if better is None:
            break
        plan, trace, levels = better
        size *= 2
    validate(plan)
    return plan, trace
