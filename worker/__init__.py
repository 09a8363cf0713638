"""The queue engine: task types, the processing pass, and the supervisor with its children.

Imports `common` and `db`, never `api`.
"""
