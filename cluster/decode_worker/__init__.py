"""The decode pool: an engine in decode role, the owner of each request's hand-off."""
