"""tfmem.tf2.sorted_names: encoded names sort as the originals, references and
arguments alike (what keeps a partition's AddN in the whole function's order)."""

from hypothesis import given, settings
from hypothesis import strategies as st

from tfmem.tf2 import sorted_names

FIRST = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789."
REST = FIRST + "_-/>\\"
OP_NAMES = st.builds(lambda a, b: a + b, st.sampled_from(FIRST), st.text(REST, max_size=12))
TENSORS = st.tuples(OP_NAMES, st.sampled_from((0, 0, 1, 2, 10)))


def _original(tensor):
    name, index = tensor
    return name if index == 0 else f"{name}:{index}"


# Pairs that share a prefix: where two names first differ is what the order depends on.
# Suffixes from the characters on either side of ':' and of each other.
EDGES = "-./09>AZ\\_az"
PAIRS = st.builds(lambda prefix, a, b: ((prefix + a[0], a[1]), (prefix + b[0], b[1])),
                  OP_NAMES, st.tuples(st.text(EDGES, max_size=3), st.sampled_from((0, 1, 2, 10))),
                  st.tuples(st.text(EDGES, max_size=3), st.sampled_from((0, 1, 2, 10))))


@settings(max_examples=1500, deadline=None)
@given(st.one_of(st.tuples(TENSORS, TENSORS), PAIRS))
def test_encoded_references_and_arguments_sort_as_the_originals(pair):
    a, b = pair
    forms = [(sorted_names.tensor_reference(*a), sorted_names.tensor_reference(*b)),
             (sorted_names.argument_name(*a), sorted_names.argument_name(*b))]
    if a[0] != b[0]:  # one op is either in the partition (a node) or outside (an argument)
        forms += [(sorted_names.tensor_reference(*a), sorted_names.argument_name(*b)),
                  (sorted_names.argument_name(*a), sorted_names.tensor_reference(*b))]
    for encoded_a, encoded_b in forms:
        assert (encoded_a < encoded_b) == (_original(a) < _original(b)), (a, b)
        assert (encoded_a == encoded_b) == (a == b)


@settings(max_examples=200, deadline=None)
@given(OP_NAMES)
def test_an_encoded_name_is_a_valid_argument_name_and_decodes(name):
    encoded = sorted_names.encode(name)
    assert encoded[0].isalpha() and set(encoded) <= set("abcdefghijklmnopqrstuvwxyz0123456789_")
    assert encoded == encoded.lower()  # TensorFlow lower-cases argument names
    assert sorted_names.decode(encoded) == name
