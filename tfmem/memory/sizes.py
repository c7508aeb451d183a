"""Sizes: bytes in MiB, written one way in every message and table."""

MIB = 1 << 20


def mib(nbytes, digits=1, unit=True):
    """'12.3 MiB' (or '12.30' with digits=2, unit=False); 'n/a' for None."""
    if nbytes is None:
        return "n/a"
    return f"{nbytes / MIB:.{digits}f}" + (" MiB" if unit else "")
