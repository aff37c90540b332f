"""The worker process (``actor``): one device's replicas, their batcher and generation engine."""
