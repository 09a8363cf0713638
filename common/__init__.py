"""What the API and the worker both use and neither owns: environment parsing, log setup, the
Prometheus multiprocess directory, and marshmallow fields for JSON.

Layers: api -> worker -> common -> db. It imports nothing of `api` or `worker`.
"""
