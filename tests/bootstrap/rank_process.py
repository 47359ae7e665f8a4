"""A stand-in prefill node for the end-to-end tests: `python -m tests.bootstrap.rank_process`.

It holds some ranks of one instance, each a real TCP listener that answers with its
coordinate, registers them to the leader's directory as an SGLang prefill would, and
keeps them registered until SIGTERM, so a restarted directory refills itself.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal

import httpx

from bootstrap.protocol import Coordinate, RankRegistration
from bootstrap.registrar import KeepAlive, register_rank


def parse_ranks(text: str) -> list[Coordinate]:
    """`"dp,cp,tp,pp;dp,cp,tp,pp"` -> coordinates."""
    return [Coordinate(*(int(v) for v in part.split(","))) for part in text.split(";")]


async def listen(coord: Coordinate) -> asyncio.Server:
    async def identify(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(f"{coord}\n".encode())
        await writer.drain()
        writer.close()

    return await asyncio.start_server(identify, "127.0.0.1", 0)


def registration(args: argparse.Namespace, coord: Coordinate, port: int) -> RankRegistration:
    return RankRegistration(
        attn_tp_size=args.tp_size,
        attn_tp_rank=coord.tp_rank,
        attn_cp_size=args.cp_size,
        attn_cp_rank=coord.cp_rank,
        attn_dp_size=args.dp_size,
        attn_dp_rank=coord.dp_rank,
        pp_size=args.pp_size,
        pp_rank=coord.pp_rank,
        system_dp_size=1,
        system_dp_rank=0,
        rank_ip="127.0.0.1",
        rank_port=port,
        page_size=16,
        kv_cache_dtype="auto",
    )


async def serve(args: argparse.Namespace) -> None:
    coords = parse_ranks(args.ranks)
    servers = [await listen(c) for c in coords]
    registrations = [
        registration(args, coord, server.sockets[0].getsockname()[1])
        for coord, server in zip(coords, servers, strict=True)
    ]
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stopping.set)
    async with httpx.AsyncClient() as client:
        for reg in registrations:
            await register_rank(client, args.url, reg, base_delay=0.2)
        keep_alive = KeepAlive(client, args.url, registrations, interval=args.interval)
        keep_alive.start()
        logging.info("registered %s", ", ".join(str(c) for c in coords))
        await stopping.wait()
        await keep_alive.stop()
    for server in servers:
        server.close()
        await server.wait_closed()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", required=True)
    parser.add_argument("--ranks", required=True)
    for size in ("dp", "cp", "tp", "pp"):
        parser.add_argument(f"--{size}-size", type=int, default=1)
    parser.add_argument("--interval", type=float, default=0.5)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    asyncio.run(serve(args))


if __name__ == "__main__":
    main()
