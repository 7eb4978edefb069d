"""Any JSON value, and every place in a document where one can go: for the tests that hand kvverify's
readers a document with one field replaced (paths documents, stress and probe reports)."""

from __future__ import annotations

from collections.abc import Iterator

from hypothesis import strategies as st

JSON_VALUES = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70)
                           | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8),
                           lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.text(max_size=5), inner, max_size=3),
                           max_leaves=8)
"""Finite JSON values, nested up to a few levels."""


def slots(doc, at: tuple = (), opaque: frozenset = frozenset()) -> Iterator[tuple[tuple, object]]:
    """Every (path of keys and indices, value) in ``doc``, depth first; the inside of a value whose
    path is in ``opaque`` (free-form content) is left out."""
    items = doc.items() if isinstance(doc, dict) else enumerate(doc) if isinstance(doc, list) else ()
    for key, value in items:
        path = (*at, key)
        yield path, value
        if path not in opaque:
            yield from slots(value, path, opaque)
