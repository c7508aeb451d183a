"""Measuring steps: what they cost in time and memory.

    sampling.py           which steps are measured
    stats.py              per-step statistics
    call_peaks.py         a partial-run step's device peaks from process figures
    remeasure.py          kernel scratch measured again for budget mode's learning
    memory_report.py      TFMemSession's memory report
    report_text.py        a memory report's figures and text
    trace.py              a step's timeline as a Chrome trace
"""
