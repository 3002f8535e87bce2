"""Warm-up: compile or load every gear now, in parallel workers, with progress and a timeline."""
