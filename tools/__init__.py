"""Benchmarks, the soak, the GPU check and the result-table generator (tools/README.md).

A package so that the tests import them from the repository's root
(`from tools import soak`); each still runs as `python tools/<name>.py`.
"""
