"""Wrappers that work around any collective: debug checks, the watchdog, statistics."""
