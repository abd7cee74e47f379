"""pdserve.bench.transfer."""
