"""Collectives: the contract, the wrappers, async ops, the recorder and the watchdog."""
