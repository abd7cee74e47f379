"""pdserve.observability."""
