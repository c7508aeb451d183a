"""The experiments behind the published results (experiments/README.md lists them).

A package so that the tests import the experiments' models and harness from the
repository's root (`from experiments import resnet`); each script still runs as
`python experiments/<name>.py`.
"""
