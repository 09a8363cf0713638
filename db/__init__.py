"""Storage layer: tables, engine construction and every queue SQL statement.

Imports no web framework, schema or metrics library (see the import-linter contracts).
"""
