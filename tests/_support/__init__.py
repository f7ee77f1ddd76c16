"""Helpers shared by the test modules: tiny model builders and their diffusers references, gated
stores, HTTP servers on 127.0.0.1, numerics. A test module imports helpers from here only, never
from another test module (``tests/test_test_layout.py`` checks it)."""
