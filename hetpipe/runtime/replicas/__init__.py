"""Mixed data-parallel replicas: the replica trainer, gradient sync and its buckets."""
