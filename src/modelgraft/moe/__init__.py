"""Record and replay MoE expert routing (rollout routing replay) for every MoE family.

Public API: :func:`record_routing`, :func:`replay_routing` (yields a :class:`ReplaySession` with
micro-batches), :class:`RoutingTrace`, :func:`compact_dtype`, the engine adapters
:func:`from_vllm`, :func:`from_sglang`, :func:`layout_requests`, :func:`join_routes`, and the
packing helpers :func:`pack_routes`, :func:`pack_sequences`, and :func:`compare_routing` (how often two
routings of the same tokens differ, per layer). See ``docs/moe.md``.

Example:
    >>> from modelgraft.moe import RoutingTrace, record_routing, replay_routing
    >>> callable(record_routing) and callable(replay_routing)
    True
"""

from __future__ import annotations

from modelgraft.moe.compare import RoutingComparison, compare_routing
from modelgraft.moe.engines import from_sglang, from_vllm, join_routes, layout_requests
from modelgraft.moe.packing import pack_routes, pack_sequences
from modelgraft.moe.routing import ReplaySession, moe_layers, record_routing, replay_routing
from modelgraft.moe.trace import RoutingTrace, compact_dtype

__all__ = [
    "ReplaySession",
    "RoutingComparison",
    "RoutingTrace",
    "compact_dtype",
    "compare_routing",
    "from_sglang",
    "from_vllm",
    "join_routes",
    "layout_requests",
    "moe_layers",
    "pack_routes",
    "pack_sequences",
    "record_routing",
    "replay_routing",
]
