"""Helpers the test packages share, kept apart from the tests that mirror kvgen's packages:
tolerances.py (the error bounds numerics are checked against), pairwise.py (all-pairs case
generation), servers.py (waiting on a server started in a subprocess), torch_threads.py (a block run
on n torch threads)."""
