"""A device witness for each recorded race (``kvverify record --confirm``)."""
