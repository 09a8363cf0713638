"""Operational scripts: the local runner and benchmarks.

Run each as a module from the repository root, e.g. `.venv/bin/python -m scripts.bench_claim`
(see each module's docstring). What scripts share with the tests lives in `devtools`.
"""
