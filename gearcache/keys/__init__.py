"""Keys and guards: cache keys from named factors, fingerprints, Dynamo's guards and their per-call watch."""
