"""The engine-neutral core: the Collective contract, Strategy, and the collective wrappers.

Everything here is shared by every engine; nothing here imports an engine.
"""
