"""pdserve.bench.planning."""
