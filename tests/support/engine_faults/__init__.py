"""Deliberate faults in the engine plugins, injected from outside the package (mambacache_test_faults.py)."""
