"""Operational scripts: local runner and benchmarks (run as files, see each docstring)."""
