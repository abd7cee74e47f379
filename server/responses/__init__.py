"""pdserve.server.responses."""
