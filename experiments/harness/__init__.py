"""What every experiment shares: one trial per process, the max-size search, reports.

An experiment script (`resnet.py`, `moe.py`, `deepspeech.py`, the Keras ones)
describes its model with an `experiment.Experiment` (how to build the graph, its
size knob and its defaults) and calls `main.main`.  The rest, one concept a module,
each importing only the ones listed before it:

* `steady`: a trial's step times told apart (first step, re-plans, steady state);
* `experiment`: the Experiment description and the vocabulary of trial outcomes;
* `options`: the command line and its defaults;
* `trial`: one trial in this process (the cap set before TensorFlow starts), one
  JSON line;
* `child`: trials in child processes, with a time limit, and the progress bar;
* `search`: per system, the largest size that trains (exponential then binary);
* `cap`: the cap derived from plain TensorFlow's peak on this machine, provenance;
* `reports`: markdown and CSV tables, every trial as CSV and JSON, the plot, the
  RESULT line;
* `main`: the script's entry point.

Nothing here imports TensorFlow at module level: the search's own process never
starts it.
"""
