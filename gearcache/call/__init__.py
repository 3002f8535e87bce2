"""The call path: a cached method's ``__call__``, the signature key, loaded entries, the C per-call path."""
