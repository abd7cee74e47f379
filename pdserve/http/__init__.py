"""pdserve.http."""
