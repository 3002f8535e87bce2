"""Gears and padding: the gear plan, the padding analysis that proves padded calls exact, pad values."""
