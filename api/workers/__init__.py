"""/workers: operator endpoints that drive the queue from the API process."""
