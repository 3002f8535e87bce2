"""Ranks: where a process sits in a job, and warm-up phases across ranks that cannot deadlock."""
