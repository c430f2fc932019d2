"""One process: the identity collective, and the strategies that need nothing else (single device, DataParallel)."""
