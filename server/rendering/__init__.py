"""pdserve.server.rendering."""
