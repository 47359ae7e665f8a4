"""Assembling and running one engine process: sockets first, then the engine, then HTTP.

Every listening socket is bound before anything is advertised, so port 0 works for all of
them (HTTP, bootstrap directory, KV-event PUB and replay, transfer ranks: one publisher
per DP rank, `rank_publishers`) and the startup log line and `/server_info` give the real
ports.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import socket
import uuid
from collections.abc import Iterator
from contextlib import AsyncExitStack
from importlib.metadata import version
from typing import Any

import httpx
import uvicorn
import zmq.asyncio
from prometheus_client import CollectorRegistry

from bootstrap.resolver import DecodeResolver
from bootstrap.server import BootstrapConfig, BootstrapServer
from enginesim.app import create_app
from enginesim.config import WILDCARD_HOSTS, EngineConfig
from enginesim.decode import DecodeEngine
from enginesim.engine import Engine
from enginesim.faults import Faults
from enginesim.handshake import RankId
from enginesim.kvcache import PagedKVCache
from enginesim.latency import DecodeStalls, PrefillModel, PrefillScheduler
from enginesim.metrics import EngineMetrics
from enginesim.prefill import DPRank, PrefillEngine
from enginesim.publisher import KVEventPublisher
from enginesim.rank_publishers import start_rank_publishers
from enginesim.textgen import ReplyWriter
from enginesim.transfer import DecodeTransfer, PrefillTransfer
from globalkv.tokenize import load_tokenizer
from kvplumbing.auth import ProtectionFlags
from kvplumbing.topics import kv_topic

log = logging.getLogger(__name__)

DIRECTORY_FLAGS = ProtectionFlags("engine", "--bootstrap-admin-token", "--bootstrap-insecure")
"""Where a prefill's directory takes its admin token, as its refusals name them."""


def advertised_host(config: EngineConfig) -> str:
    """Where peers reach this engine: explicit, the bound host, or this machine's address."""
    if config.advertise_host:
        return config.advertise_host
    if config.host not in WILDCARD_HOSTS:
        return config.host
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


async def peer_address(host: str) -> str:
    """The IP address ZMQ peers are given for `host` (rank addresses, KV-event endpoints).

    libzmq resolves a host name on its I/O thread, so one lookup that hangs (the name of a
    peer whose container went away, on a network whose DNS forwards it to a server that
    does not answer) stalls every socket of the process, every peer included. Real engines
    advertise addresses too (SGLang registers its `rank_ip`). A name that does not resolve
    here is passed on as it is.
    """
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError as exc:
        log.warning("advertising %s unresolved: %s", host, exc)
        return host
    return str(infos[0][4][0])


_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class EngineProcess:
    """Owns everything one `globalkv engine` process runs, and closes it in reverse.

    Building it opens nothing yet raises `ValueError` for a tokenizer that cannot be
    loaded, so a bad path is reported before any port is taken.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.registry = CollectorRegistry()
        self.metrics = EngineMetrics(self.registry)
        self.tokenizer = load_tokenizer(config.tokenizer)
        self.writer = ReplyWriter(self.tokenizer)
        self.faults = Faults(config.faults, self.metrics)
        self._stack = AsyncExitStack()
        self.engine: Engine | None = None
        self.http_socket: socket.socket | None = None
        self.info: dict[str, Any] = {}

    async def start(self) -> None:
        config = self.config
        # One line per keep-alive PUT and heartbeat would drown the engine's own log.
        logging.getLogger("httpx").setLevel(max(logging.WARNING, log.getEffectiveLevel()))
        family = socket.AF_INET6 if ":" in config.host else socket.AF_INET
        self.http_socket = socket.create_server((config.host, config.port), family=family)
        self._stack.callback(self.http_socket.close)
        port = int(self.http_socket.getsockname()[1])
        advertise = advertised_host(config)
        pod = config.pod_id or f"{advertise}:{port}"
        address = await peer_address(advertise)
        context = zmq.asyncio.Context()
        self._stack.callback(context.destroy, 0)
        client = httpx.AsyncClient(timeout=httpx.Timeout(5.0))
        self._stack.push_async_callback(client.aclose)
        if config.role == "prefill":
            engine: Engine = await self._prefill(context, client, port, address, pod)
        else:
            engine = await self._decode(context, client, address, pod)
        self._stack.push_async_callback(engine.stop)  # also undoes a start that failed halfway
        await engine.start()
        self.engine = engine
        self.info.update(
            engine="enginesim",
            version=version("globalkv"),
            model_path=config.model,
            served_model_name=config.model,
            tokenizer_path=self.tokenizer.name,
            host=config.host,
            port=port,
            advertise_host=advertise,
            pod_id=pod,
            tp_size=config.tp,
            dp_size=config.dp,
            pp_size=config.pp,
            page_size=config.page_size,
            kv_capacity=config.kv_capacity,
            load_balance_method=config.load_balance_method,
            api=config.api,
        )
        self.info.setdefault("disaggregation_bootstrap_port", config.bootstrap_port)
        summary = {**self.info, **engine.server_info()}
        log.info(
            "enginesim %s ready: http://%s:%d pod=%s bootstrap_port=%s kv_events=%s",
            config.role,
            advertise,
            port,
            pod,
            summary["disaggregation_bootstrap_port"],
            json.dumps(summary.get("kv_events")),
        )

    async def _prefill(
        self,
        context: zmq.asyncio.Context,
        client: httpx.AsyncClient,
        port: int,
        advertise: str,
        pod: str,
    ) -> PrefillEngine:
        config = self.config
        directory = BootstrapServer(
            BootstrapConfig(
                host=config.host,
                port=config.bootstrap_port,
                sglang_compat=config.sglang_compat,
                admin_token=config.bootstrap_admin_token,
                insecure=config.bootstrap_insecure,
            ),
            registry=self.registry,
            flags=DIRECTORY_FLAGS,
        )
        await directory.start()
        self._stack.push_async_callback(directory.stop)
        self.info["disaggregation_bootstrap_port"] = directory.port
        publishers = await self._start_publishers(context, self._events_topic(pod))
        ranks = [
            DPRank(
                index=index,
                cache=PagedKVCache(config.page_size, config.kv_capacity),
                scheduler=PrefillScheduler(self._prefill_model()),
                publisher=publishers[index] if publishers else None,
                metrics=self.metrics,
            )
            for index in range(config.dp)
        ]
        rank_ids = [
            RankId(dp, tp, pp)
            for dp in range(config.dp)
            for tp in range(config.tp)
            for pp in range(config.pp)
        ]
        transfer = PrefillTransfer(
            context, self.metrics, rank_ids, bind_host=config.host, advertise_host=advertise
        )
        return PrefillEngine(
            config,
            ranks=ranks,
            transfer=transfer,
            client=client,
            bootstrap_url=directory.url,
            http_port=port,
            advertise_host=advertise,
            faults=self.faults,
            metrics=self.metrics,
            writer=self.writer,
        )

    def _events_topic(self, pod: str) -> str:
        """The KV events' topic, also advertised as SGLang's `kv_events_config`."""
        config = self.config
        events = config.kv_events
        topic = events.topic if events.topic is not None else kv_topic(pod, config.model)
        self.info["kv_events_config"] = (
            None
            if events.endpoint is None
            else json.dumps(
                {
                    "publisher": "zmq",
                    "endpoint": events.endpoint,
                    "replay_endpoint": events.replay_endpoint,
                    "topic": topic,
                }
            )
        )
        return topic

    async def _start_publishers(
        self, context: zmq.asyncio.Context, topic: str
    ) -> list[KVEventPublisher]:
        """One publisher per DP rank, stopped when the process closes."""
        publishers = await start_rank_publishers(
            self.config.kv_events,
            self.config.dp,
            topic,
            context,
            self.metrics,
            drop=self.faults.drop_event_batch,
        )
        for publisher in publishers:
            self._stack.push_async_callback(publisher.stop)
        return publishers

    def _prefill_model(self) -> PrefillModel:
        latency = self.config.latency
        return PrefillModel(
            tokens_per_s=latency.prefill_tokens_per_s,
            per_request_overhead_s=latency.prefill_overhead_ms / 1000,
            max_batch_tokens=latency.max_batch_tokens,
        )

    async def _decode(
        self, context: zmq.asyncio.Context, client: httpx.AsyncClient, advertise: str, pod: str
    ) -> DecodeEngine:
        config = self.config
        publishers = []
        if config.decode_kv_events:
            publishers = await self._start_publishers(context, self._events_topic(pod))
        else:
            self.info["kv_events_config"] = None
        stalls = DecodeStalls()
        rank = DPRank(
            index=0,
            cache=PagedKVCache(config.page_size, config.kv_capacity),
            scheduler=PrefillScheduler(self._prefill_model(), on_step=stalls.step),
            publisher=publishers[0] if publishers else None,
            metrics=self.metrics,
        )
        resolver = DecodeResolver(
            client,
            retry_interval=config.bootstrap_retry_interval,
            max_tries=config.bootstrap_max_tries,
        )
        transfer = DecodeTransfer(
            context,
            self.metrics,
            bind_host=config.host,
            advertise_host=advertise,
            session=f"{pod}/{uuid.uuid4().hex[:12]}",
        )
        return DecodeEngine(
            config,
            resolver=resolver,
            transfer=transfer,
            faults=self.faults,
            metrics=self.metrics,
            writer=self.writer,
            rank=rank,
            stalls=stalls,
            advertise_host=advertise,
        )

    async def serve(self) -> None:
        """Serve HTTP until SIGINT/SIGTERM; `run_engine` then closes everything."""
        if self.engine is None or self.http_socket is None:
            raise RuntimeError("EngineProcess.start() must succeed before serve()")
        app = create_app(
            self.engine,
            tokenizer=self.tokenizer,
            writer=self.writer,
            metrics=self.metrics,
            max_new_tokens=self.config.max_new_tokens,
            model=self.config.model,
            server_info=lambda: dict(self.info),
            api=self.config.api,
            adapters=self.config.lora_adapters,
        )
        server = _EngineServer(
            uvicorn.Config(
                app,
                http="httptools",
                loop="none",
                lifespan="off",
                access_log=False,
                log_config=None,
                timeout_graceful_shutdown=5,
            ),
            self.engine,
        )
        await server.serve(sockets=[self.http_socket])

    async def close(self) -> None:
        await self._stack.aclose()


class _EngineServer(uvicorn.Server):
    """uvicorn, which tells the engine first when it starts to shut down, and does not
    kill the process once it has.

    uvicorn lets requests in flight finish within its graceful timeout, then cancels them.
    A prompt waiting on a peer (a prefill for the decode's handshake, a decode for the KV)
    could wait far longer, so the engine fails those at once with a 503 the router can
    retry elsewhere; answers already generating keep the grace period. uvicorn's own
    signal handling raises SIGTERM again after its shutdown, which killed the process
    before the engine closed its sockets and tasks; these handlers only ask it to stop.
    """

    def __init__(self, config: uvicorn.Config, engine: Engine) -> None:
        super().__init__(config)
        self._engine = engine

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        loop = asyncio.get_running_loop()
        for sig in _STOP_SIGNALS:
            loop.add_signal_handler(sig, self.handle_exit, sig, None)
        try:
            yield
        finally:
            for sig in _STOP_SIGNALS:
                loop.remove_signal_handler(sig)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        await self._engine.begin_shutdown()
        await super().shutdown(sockets)


async def run_engine(process: EngineProcess) -> None:
    try:
        await process.start()
        await process.serve()
    finally:
        await asyncio.shield(process.close())
