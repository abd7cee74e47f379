"""pdserve.server.chat."""
