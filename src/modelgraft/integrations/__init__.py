"""Routing replay wired into trainers people run.

* :mod:`modelgraft.integrations.trl`: TRL's GRPO and RLOO trainers (``RoutingReplayGRPOTrainer``,
  ``RoutingReplayRLOOTrainer``, ``enable_routing_replay``). Needs ``trl``.

verl and OpenRLHF need no module: their actors' forward takes two calls, shown in ``docs/moe.md``.

Example:
    >>> import modelgraft.integrations
    >>> modelgraft.integrations.__name__
    'modelgraft.integrations'
"""

from __future__ import annotations

__all__: list[str] = []
