"""One device, one process: the collective whose every op is the identity."""
