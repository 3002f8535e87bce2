"""CUDA graphs: capture per gear, replay, output handling."""
