"""What making a request runnable cost: planning, copying into the graph, callables.

The first step of a request pays for these once (see docs/how-it-works.md, "Two
front ends"); `TFMemSession.last_compile` holds the figures of the last
request that was planned or compiled, so tools can show where the time went.
"""

import dataclasses


@dataclasses.dataclass(frozen=True)
class CompileStats:
    """Seconds spent on one plan, and how the session graph grew (ops)."""
    plan_time: float = 0.0  # analysis, partitioning, planning (and the budget search)
    simulate_time: float = 0.0  # the memory prediction checked before compiling
    rewrite_time: float = 0.0  # copying the partitions into the session graph
    extend_time: float = 0.0  # TensorFlow taking the grown graph into the session (once)
    callables_time: float = 0.0  # Session callables: TensorFlow builds each from the graph
    # calls made runnable: one per stretch of partitions (see plan/stretches.py); none for
    # a plan whose steps run as partial runs (made when a step first needs them)
    callables: int = 0
    # of those, the calls run through Session.run by name (run/executing/c_path.py), the
    # rest are session callables: TensorFlow builds a call's executors on its first run,
    # inside the first step (StepStats.executors_built, build_time), not in callables_time
    run_by_name: int = 0
    # of those, the calls whose copies (and callables) an earlier plan of the request made:
    # a re-plan imports and makes callable only the partitions that changed (see reuse)
    reused_calls: int = 0
    graph_ops_before: int = 0
    graph_ops_after: int = 0
    reused: bool = False  # True: the copies and callables of an earlier plan serve this one
    partial_run: bool = False  # True: steps run as partial runs, callables made when needed
    # tfmem.Session: copying the ops the request reached first into its session graph
    # (run/compiling/graph_copy.py); 0 for a wrapped session
    copy_time: float = 0.0

    @property
    def made_callables(self):
        """Session callables made for this plan (neither reused nor run by name)."""
        return self.callables - self.run_by_name - self.reused_calls

    def __str__(self):
        copied = f"copying into the session graph {self.copy_time:.2f} s, " \
            if self.copy_time else ""
        if self.reused:
            return (f"reused the copies of an earlier plan ({copied}planning "
                    f"{self.plan_time:.2f} s, prediction {self.simulate_time:.2f} s)")
        return (f"{copied}planning {self.plan_time:.2f} s, prediction {self.simulate_time:.2f} s, "
                f"rewrite {self.rewrite_time:.2f} s, session extend {self.extend_time:.2f} s, "
                + ("partial runs (callables when needed), upload callables "
                   if self.partial_run else
                   f"{self.callables} calls ({self.reused_calls} reused from an earlier "
                   f"plan, {self.run_by_name} by name, built on their first run; "
                   f"{self.made_callables} callables made) ")
                + f"{self.callables_time:.2f} s; session graph {self.graph_ops_before} -> "
                f"{self.graph_ops_after} ops")
