"""Ready-made wrappers that serve third-party model libraries through gearcache (each imports its library lazily)."""
