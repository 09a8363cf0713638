"""Tooling for development, tests and benchmarks; never part of the service.

The embedded PostgreSQL (`embedded_postgres`), the harness that runs the real system as
processes (`stack`), the TCP proxy that adds a network round trip for the scale-out benchmark
(`delay_proxy`), and what the chaos run and the tests share (`chaos`, `webhook_receiver`).
`api`, `worker` and `db` never import it (an import-linter contract), and it is not packaged:
neither the wheel nor the Docker image contains it. `scripts/` and `tests/` import it; run
them from the repository root (`python -m scripts.<name>`, `pytest`).
"""
