"""Horovod: its collective and the strategy for jobs started by ``horovodrun``."""
