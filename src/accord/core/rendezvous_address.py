"""Where a new default process group meets: this rank, the world size, and the address.

`find_rendezvous` takes the arguments a strategy passes to ``setup()`` and fills in the rest
from the environment torchrun, SLURM and accord's launchers set (``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT``), so a collective can equally be set up by a strategy, by
hand, or by the conformance suite.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from accord.core.env_vars import env_number
from accord.errors import ConfigurationError

__all__ = ["Rendezvous", "find_rendezvous"]


@dataclass(frozen=True)
class Rendezvous:
    """How a new default group meets: this rank, the world size, and where.

    Attributes:
        rank: this process's rank in the new group.
        world_size: the number of ranks.
        address: the host that serves the rendezvous store (rank 0's).
        port: its port (-1 when ``init_method`` replaces it).
        init_method: a torch ``init_method`` URL that replaces ``address:port``, or None.
    """

    rank: int
    world_size: int
    address: str
    port: int
    init_method: str | None = None


def find_rendezvous(
    owner: str,
    rank: int | None = None,
    world_size: int | None = None,
    main_address: str | None = None,
    main_port: int | None = None,
    init_method: str | None = None,
) -> Rendezvous:
    """Where a new group would meet: the arguments given, else the environment.

    With no port given or set and a world of one, a free port is picked.

    Args:
        owner: what sets the group up, for the messages (``"TorchCollective"``).
        rank, world_size, main_address, main_port: as given to ``setup()``; None: from
            ``RANK`` (default 0), ``WORLD_SIZE`` (default 1), ``MASTER_ADDR`` (default
            ``127.0.0.1``) and ``MASTER_PORT``.
        init_method: a torch ``init_method`` URL, which replaces the port.

    Raises:
        ConfigurationError: a non-integer variable, a rank outside the world, or a
            multi-rank world without a port.
    """
    rank = env_number("RANK", int, 0) if rank is None else rank
    world_size = env_number("WORLD_SIZE", int, 1) if world_size is None else world_size
    if not 0 <= rank < world_size:
        raise ConfigurationError(
            f"rank={rank} is outside [0, world_size={world_size}). Check RANK/WORLD_SIZE."
        )
    address = main_address or os.environ.get("MASTER_ADDR", "127.0.0.1")
    if init_method is not None:
        return Rendezvous(rank, world_size, address, -1, init_method)
    port = env_number("MASTER_PORT", int, -1) if main_port is None else main_port
    if port < 0:
        if world_size > 1:
            raise ConfigurationError(
                f"{owner}.setup() needs a port for a multi-rank group: set MASTER_PORT or "
                "pass main_port= (every rank must use the same one)."
            )
        from accord.environments.local import find_free_port

        port = find_free_port()
    return Rendezvous(rank, world_size, address, port)
