"""Plot: a plan's predicted memory over its partitions, as an image.

    MiB
     |   #           device peak (bars): the high-water mark during each run
     |   #  #        device after (line): what stays resident after it
     | # #  # #      host (line): host buffers of swapped tensors
     +------------>  partition

Drawn with matplotlib, an optional dependency (`pip install 'tfmem[plot]'`),
imported only when a plot is made.  The figure is built with matplotlib's
object API (no pyplot), so plotting changes no global matplotlib state.
"""

from tfmem.memory.sizes import MIB
INSTALL_HINT = "pip install 'tfmem[plot]'"


def available():
    """True when matplotlib can be imported."""
    try:
        import matplotlib  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
    except ImportError:
        return False
    return True


def plot_memory(trace, path, title, budget=None):
    """Write the predicted device and host bytes of `trace` (a MemoryTrace) to `path`.

    The image format follows the file name (.png, .svg, .pdf).  `budget`
    (bytes), when given, is drawn as a horizontal line.  Raises ImportError
    naming the install command when matplotlib is missing.
    """
    try:
        from matplotlib.figure import Figure  # pylint: disable=import-outside-toplevel
    except ImportError as exc:
        raise ImportError(f"plotting needs matplotlib: {INSTALL_HINT}") from exc

    parts = trace.partitions
    index = [p.index for p in parts]
    peak = [p.device_peak / MIB for p in parts]
    after = [p.device_after / MIB for p in parts]
    host = [p.host_after / MIB for p in parts]

    figure = Figure(figsize=(min(max(8.0, 0.18 * len(parts)), 16.0), 4.8), dpi=100,
                    layout="constrained")
    axes = figure.add_subplot()
    axes.bar(index, peak, width=0.8, color="#9ecae1", edgecolor="#4292c6", linewidth=0.5,
             label="device peak during the partition")
    axes.plot(index, after, color="#08519c", marker="." if len(parts) <= 60 else None,
              label="device after the partition")
    axes.plot(index, host, color="#e6550d", marker="." if len(parts) <= 60 else None,
              label="host buffers after the partition")
    axes.axhline(trace.state_bytes / MIB, color="grey", linestyle=":", linewidth=1,
                 label="state (variables, constants)")
    if budget is not None:
        axes.axhline(budget / MIB, color="#a50f15", linestyle="--", linewidth=1,
                     label=f"device budget {budget / MIB:.1f} MiB")
    if parts:
        top = trace.peak_partition
        axes.annotate(f"peak {trace.peak_device / MIB:.2f} MiB", xy=(top, trace.peak_device / MIB),
                      xytext=(0, 4), textcoords="offset points", ha="center", fontsize=8)
    axes.set_xlabel("partition")
    axes.set_ylabel("MiB (predicted)")
    axes.set_xlim(-0.6, max(len(parts) - 0.4, 0.6))
    highest = max(peak + host + [trace.state_bytes / MIB, (budget or 0) / MIB, 1e-3])
    axes.set_ylim(0, highest * 1.12)
    if len(parts) <= 30:
        axes.set_xticks(index)
    axes.grid(axis="y", alpha=0.3)
    axes.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=3,
                frameon=False)
    figure.suptitle(title, fontsize=10)
    figure.savefig(path)
