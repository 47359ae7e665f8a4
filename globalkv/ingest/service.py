"""Ingest assembled: its parts built around one index and registry, started and stopped.

Each part holds one thing and is handed what it needs: `followed` the pods and their
workers (and waits on what they applied), `following` which pods are followed and their
sources, `bound` the bound socket, `discovery` the pods that appear on it, `recovery`
what the index lost. Callers use the part they need; this class only wires them
together, starts the bound socket, stops everything, and reports each pod's state.
"""

from __future__ import annotations

import contextlib

import zmq.asyncio

from globalkv.index.base import Index, IndexUnavailable
from globalkv.ingest.bound import BoundSocket
from globalkv.ingest.config import IngestConfig
from globalkv.ingest.discovery import Discovery
from globalkv.ingest.followed import FollowedPods
from globalkv.ingest.following import EveryPod, Following, PodGate
from globalkv.ingest.recovery import Recovery
from globalkv.ingest.replay import ReplayClient
from globalkv.ingest.tasks import Background
from globalkv.metrics import IngestMetrics
from globalkv.registry import PodState, Registry


class IngestService:
    def __init__(
        self,
        index: Index,
        registry: Registry,
        metrics: IngestMetrics,
        config: IngestConfig | None = None,
        *,
        gate: PodGate | None = None,
        context: zmq.asyncio.Context | None = None,
    ) -> None:
        """`gate`: which pods this indexer may follow when it shares them with others
        (`ownership.HeldLeases`); every pod when None."""
        config = config or IngestConfig()
        gate = gate or EveryPod()
        self.registry = registry
        self.context = context or zmq.asyncio.Context()
        self._own_context = context is None
        self.background = Background()
        self.followed = FollowedPods()
        self.recovery = Recovery(self.followed, registry, metrics, self.background)
        self.discovery = Discovery(
            self.followed,
            registry,
            gate.holds,
            self.background,
            config.max_discovered_pods,
            config.max_discovered_sources,
            config.discovered_idle_secs,
        )
        replayer = ReplayClient(
            self.context,
            metrics,
            reply_timeout=config.replay_reply_timeout,
            total_timeout=config.replay_total_timeout,
            max_message_bytes=config.max_message_bytes,
            max_bytes=config.replay_max_bytes,
        )
        self.following = Following(
            index,
            self.followed,
            config=config,
            context=self.context,
            replayer=replayer,
            recovery=self.recovery,
            discovery=self.discovery,
            gate=gate,
            metrics=metrics,
            background=self.background,
        )
        self.bound = BoundSocket(
            config,
            self.followed,
            self.following,
            self.discovery,
            metrics,
            self.background,
        )

    async def start(self) -> None:
        await self.bound.start()

    async def stop(self) -> None:
        await self.following.stop()
        await self.background.stop()
        self.bound.close()
        if self._own_context:
            self.context.destroy(linger=0)

    def states(self) -> dict[str, PodState]:
        return self.followed.states(
            listening=self.bound.listening, resyncing=self.recovery.resyncing
        )

    async def publish_states(self) -> None:
        """Write our ingest state next to each pod in the registry (best effort)."""
        with contextlib.suppress(IndexUnavailable):
            await self.registry.put_states(self.states())
