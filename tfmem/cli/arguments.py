"""Argument types shared by the command line's commands."""

import argparse


def positive_int(text):
    """An argparse type: a whole number above 0, or a message naming what was given."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value
