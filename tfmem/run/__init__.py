"""The run wing: a plan copied into the session's graph and executed step by step.

    session.py            TFMemSession, the drop-in Session wrapper
    options.py            tfmem.Options: the rarely changed settings of both front ends
    session_interface.py  what makes it a session in every sense TensorFlow checks
    session_factory.py    sessions tfmem creates itself (tfmem.Session)
    graph_copy.py         ... whose session graph copies only what requests reach
    regrouping.py         whether the session reorders sums (Grappler's arithmetic optimizer)
    monitored.py          monitored sessions whose every run goes through tfmem
    request.py            a Session.run request, normalised
    plan_cache.py         each request planned once, compiled once
    request_planner.py    ... its plan made, and made again when the graph or the model changed
    request_compiler.py   ... its plan predicted, checked and copied into the graph
    budget_learning.py    budget mode around steps, for both front ends
    memory_report.py      what the last step used, measured and predicted
    step_record.py        what a step listener is told of a step
    placement_pass.py     the user's state put on the host before placement
    colocation.py         the groups of ops TensorFlow's placer keeps together
    rewrite.py            each partition copied into the session's graph
    plan_import.py        ... or a whole plan in one import
    graph_growth.py       adding those copies to a finalized graph
    step_loop.py          one step: a call per partition, shared with tfmem.function
    execute.py            the Session front end of that loop: one Session callable per stretch
    interrupts.py         Ctrl-C held until a partition's outputs are handed over
    host_memory.py        a plan refused when the host cannot hold its swapped tensors
    sampling.py           which steps are measured
    c_path.py             a partition run through Session.run's C path
    swap_manager.py       the transfers of one step, on the device or in host buffers
    residence.py          where a kept tensor waits (session handles, worker staging)
    prefetch.py           uploads back to the device on a background thread
    buffers.py            the pool of host buffers
    remote.py             what tfmem sees of a distributed session
    accelerator.py        the device a session runs on, an emulated one, the memory budget
    stats.py, compile_stats.py, trace.py   what a step and a first step cost

It uses the plan and memory wings and never the command line.
"""
