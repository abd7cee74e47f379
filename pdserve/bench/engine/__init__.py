"""pdserve.bench.engine."""
