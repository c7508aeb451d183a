"""Names for a partition's nodes and arguments that sort as the traced graph's do.

Grappler's arithmetic optimizer, run on each partition function on its own,
turns a tree of sums into one AddN and orders its inputs by their names; the
float sum depends on that order.  In the whole function an input is named by
its producer (`block/conv/Conv2D`, `block/relu:1`); in a partition a producer
from another partition is an argument, and an op imported under a prefix
gets `p3/...`: the order changes, and with it the last bits.  The planner
keeps a sum with its producers where it can (tfmem/plan/units.py, rule 5),
but not when the leaves lie on one path (`conv(h) + h + skip`).

So every name in a partition function is an order-preserving encoding of
the name Grappler sees in the whole function: each character becomes two,
digits-first for the characters that sort below ':' and letters-first for
those above it, so that comparing encoded names, with TensorFlow's ':k'
output suffix appended to a node's name, gives the order of the originals;
an argument standing for output k > 0 of a producer is named with '__' in
place of ':' (between the digits and the letters, where ':' sorts).  The
encoding only uses [a-z0-9_], so it is a valid node and argument name.
A TensorFlow error raised in a partition names its nodes so encoded:
`readable_message` turns them back into the traced graph's names.
"""

import re

_BELOW_COLON = "-./0123456789"  # characters of op names that sort before ':'
_ABOVE_COLON = ">ABCDEFGHIJKLMNOPQRSTUVWXYZ\\_abcdefghijklmnopqrstuvwxyz"
_LETTERS = "abcdefghijklmnopqrstuvwxyz"


def _codes():
    codes = {}
    for position, char in enumerate(_BELOW_COLON):
        codes[char] = f"{position // 10}{position % 10}"
    for position, char in enumerate(_ABOVE_COLON):
        codes[char] = _LETTERS[position // 26] + _LETTERS[position % 26]
    return codes


_CODES = _codes()
_PREFIX = "t"  # a node or argument name starts with a letter


def encode(name):
    """The encoded node name of the op named `name` (order-preserving)."""
    return _PREFIX + "".join(_CODES[char] for char in name)


def tensor_reference(op_name, index):
    """How a GraphDef input refers to output `index` of the encoded op."""
    return encode(op_name) if index == 0 else f"{encode(op_name)}:{index}"


def argument_name(op_name, index):
    """The name of an argument standing for output `index` of op `op_name`: it sorts
    among tensor references as `op_name:index` sorts among the originals."""
    if index == 0:
        return encode(op_name)
    return encode(op_name) + "__" + "".join(_CODES[char] for char in str(index))


_DECODE = {code: char for char, code in _CODES.items()}


def decode(name):
    """The traced graph's name of an encoded node name (as a TensorFlow error in a
    partition names it); names that are not encoded come back unchanged."""
    body = name[len(_PREFIX):] if name.startswith(_PREFIX) else None
    if body is None or len(body) % 2:
        return name
    pairs = [body[i:i + 2] for i in range(0, len(body), 2)]
    if not all(pair in _DECODE for pair in pairs):
        return name
    return "".join(_DECODE[pair] for pair in pairs)


_ENCODED = re.compile(r"\bt[0-9a-z_]{4,}\b")


def readable_message(message, is_op_name):
    """`message` with every encoded node name that decodes to an op of the traced graph
    (`is_op_name(name)`) replaced by that name: what a TensorFlow error raised in a
    partition says, in the user's names."""
    def back(match):
        name = decode(match.group(0))
        return name if name != match.group(0) and is_op_name(name) else match.group(0)
    return _ENCODED.sub(back, message)
