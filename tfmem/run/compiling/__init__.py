"""Making a plan runnable: its partitions copied into the session's graph.

    request_compiler.py   a planned request predicted, checked and copied into the graph
    rewrite.py            each partition copied into the session's graph
    plan_import.py        ... or a whole plan in one import
    prun_import.py        ... or gated for one partial run per step
    graph_copy.py         tfmem.Session's graph: a copy of only what requests reach
    graph_growth.py       adding those copies to a finalized graph
    colocation.py         the groups of ops TensorFlow's placer keeps together
    regrouping.py         whether the session reorders sums (Grappler's arithmetic optimizer)
    compile_stats.py      what making a request runnable cost
"""
