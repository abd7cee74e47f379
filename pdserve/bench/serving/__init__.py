"""pdserve.bench.serving."""
