"""pdserve.bench.gpu."""
