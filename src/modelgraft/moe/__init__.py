"""Record and replay MoE expert routing (rollout routing replay) for every MoE family.

Public API: :func:`record_routing`, :func:`replay_routing`, :class:`RoutingTrace`,
:func:`from_vllm`, :func:`from_sglang`. See ``docs/moe.md``.

Example:
    >>> from modelgraft.moe import RoutingTrace, record_routing, replay_routing
    >>> callable(record_routing) and callable(replay_routing)
    True
"""

from __future__ import annotations

from modelgraft.moe.engines import from_sglang, from_vllm, join_routes, layout_requests
from modelgraft.moe.routing import moe_layers, record_routing, replay_routing
from modelgraft.moe.trace import RoutingTrace

__all__ = [
    "RoutingTrace",
    "from_sglang",
    "from_vllm",
    "join_routes",
    "layout_requests",
    "moe_layers",
    "record_routing",
    "replay_routing",
]
