"""The session front end: what the user's program calls.

    session.py            TFMemSession, the drop-in Session wrapper
    options.py            tfmem.Options: the rarely changed settings of both front ends
    request_planner.py    plans made, cached and made again for a request
    budget_learning.py    budget mode around steps, for both front ends: learn, run again
    step_record.py        what step listeners receive
    session_interface.py  what makes it a session in every sense TensorFlow checks
    session_factory.py    sessions tfmem creates itself (tfmem.Session)
    monitored.py          monitored sessions whose every run goes through tfmem
    request.py            a Session.run request, normalised
    plan_cache.py         each request planned once, compiled once
    run_metadata.py       the RunMetadata of a whole partitioned step
    interrupts.py         Ctrl-C held until a partition's outputs are handed over
    remote.py             what tfmem sees of a distributed session
"""
