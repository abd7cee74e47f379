"""pdserve.launch."""
