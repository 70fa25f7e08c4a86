"""Runnable examples (importable so the test suite can smoke-test them)."""
