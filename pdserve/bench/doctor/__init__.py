"""pdserve.bench.doctor."""
