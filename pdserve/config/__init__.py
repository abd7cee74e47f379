"""pdserve.config."""
