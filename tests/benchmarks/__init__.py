"""The benchmark scripts, run small."""
