"""Compiling: capture (Dynamo), compile (Inductor), publish and load an artifact, background and worker compiles."""
