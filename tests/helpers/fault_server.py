"""A tiny fault-injecting OpenAI-style server for the replay tests (aiohttp,
127.0.0.1 only). Run in a thread (``running_server``) or as a process
(``python tests/helpers/fault_server.py --port P ...``, for ``--launch``).

Faults: given HTTP statuses for given request numbers (0-based, in the order
requests arrive), a ``/metrics`` page with malformed or missing lines, and a
server that dies (the process exits, or the thread's site closes) when
request number ``die_at`` arrives, mid-stream.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import socket
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from aiohttp import web

GOOD_METRICS = """\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="fault"} 1.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="fault"} 0.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="fault"} 0.25
# TYPE vllm:num_preemptions counter
vllm:num_preemptions_total{engine="0",model_name="fault"} 2.0
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{engine="0",model_name="fault"} 100.0
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{engine="0",model_name="fault"} 40.0
# TYPE vllm:spec_decode_num_draft_tokens counter
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="fault"} 30.0
# TYPE vllm:spec_decode_num_accepted_tokens counter
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="fault"} 20.0
# TYPE vllm:prompt_tokens counter
vllm:prompt_tokens_total{engine="0",model_name="fault"} 500.0
# TYPE vllm:generation_tokens counter
vllm:generation_tokens_total{engine="0",model_name="fault"} 50.0
"""

# GOOD_METRICS read by hand: the replay column each family fills, and its value.
GOOD_PAGE_VALUES = {
    "num_requests_running": 1.0,
    "num_requests_waiting": 0.0,
    "kv_cache_usage_perc": 0.25,
    "num_preemptions_total": 2.0,
    "prefix_cache_queries_total_tokens": 100.0,
    "prefix_cache_hits_total_tokens": 40.0,
    "num_draft_total_tokens": 30.0,
    "num_accepted_total_tokens": 20.0,
    "num_prompt_total_tokens": 500.0,
    "num_generation_total_tokens": 50.0,
}

# No preemption counter and no spec-decode counters (as a server without MTP).
MISSING_METRICS = "\n".join(
    line for line in GOOD_METRICS.splitlines() if "preemptions" not in line and "spec_decode" not in line
)
MALFORMED_METRICS = "vllm:num_requests_running{engine=0 1.0\nthis is not prometheus text {{{\n"


@dataclass
class FaultOptions:
    statuses: dict[int, int] = field(default_factory=dict)
    garbled: set[int] = field(default_factory=set)  # request numbers whose stream is not JSON
    die_at: int | None = None
    metrics_text: str = GOOD_METRICS
    token_delay_s: float = 0.01
    exit_process_on_death: bool = False
    boot_lines: list[str] = field(default_factory=list)


class FaultServer:
    def __init__(self, options: FaultOptions) -> None:
        self.options = options
        self.num_requests = 0
        self.dead = asyncio.Event()

    async def completions(self, request: web.Request) -> web.StreamResponse:
        number = self.num_requests
        self.num_requests += 1
        body = await request.json()
        status = self.options.statuses.get(number)
        if status is not None:
            error = {"error": {"message": f"injected {status}", "type": "Injected", "code": status}}
            return web.json_response(error, status=status)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        num_tokens = int(body["max_tokens"])
        if number in self.options.garbled:
            await response.write(b"data: {not json\n\n")
            return response
        for index in range(num_tokens):
            if self.options.die_at is not None and number >= self.options.die_at and index == 1:
                self._die(request)
                return response
            finish = "length" if index == num_tokens - 1 else None
            choice = {"index": 0, "text": " x", "token_ids": [index], "finish_reason": finish}
            await response.write(f"data: {json.dumps({'choices': [choice], 'usage': None})}\n\n".encode())
            await asyncio.sleep(self.options.token_delay_s)
        usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": num_tokens}
        await response.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        return response

    def _die(self, request: web.Request) -> None:
        if self.options.exit_process_on_death:
            os._exit(3)
        self.dead.set()
        if request.transport is not None:
            request.transport.close()

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fault", "object": "model"}]})

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(text=self.options.metrics_text, content_type="text/plain")

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        return app


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def app_in_thread(
    make_app: Callable[[], web.Application],
    *,
    start_timeout_s: float,
    stop_when: asyncio.Event | None = None,
) -> Iterator[str]:
    """``make_app()`` (built inside the server's loop) served from a thread of
    its own on 127.0.0.1; stopped on exit. ``stop_when`` closes the listening
    socket once set, so later requests fail as on a dead server."""
    port = free_port()
    loop = asyncio.new_event_loop()
    started = threading.Event()
    runners: list[web.AppRunner] = []

    async def serve() -> None:
        runners.append(web.AppRunner(make_app(), shutdown_timeout=1.0))
        await runners[0].setup()
        site = web.TCPSite(runners[0], "127.0.0.1", port)
        await site.start()
        started.set()
        if stop_when is not None:
            await stop_when.wait()
            await site.stop()

    def run() -> None:
        asyncio.set_event_loop(loop)
        loop.create_task(serve())
        loop.run_forever()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        assert started.wait(start_timeout_s), "the server did not start"
        yield f"http://127.0.0.1:{port}"
    finally:
        if runners:
            asyncio.run_coroutine_threadsafe(runners[0].cleanup(), loop).result(10)
        # A serve() still waiting on stop_when is cancelled here: left pending,
        # it is destroyed at some later garbage collection, whose asyncio
        # error then lands in whatever test runs at that moment.
        asyncio.run_coroutine_threadsafe(_cancel_pending_tasks(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


async def _cancel_pending_tasks() -> None:
    pending = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)


@contextlib.contextmanager
def running_server(options: FaultOptions) -> Iterator[str]:
    """The fault server on 127.0.0.1; when it dies (``die_at``), its
    listening socket closes: later requests fail."""
    server = FaultServer(options)
    with app_in_thread(server.app, start_timeout_s=10, stop_when=server.dead) as url:
        yield url


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--die-at", type=int)
    parser.add_argument("--boot-line", action="append", default=[])
    args = parser.parse_args()
    for line in args.boot_line:
        print(line, flush=True)
    options = FaultOptions(die_at=args.die_at, exit_process_on_death=True)
    web.run_app(FaultServer(options).app(), host="127.0.0.1", port=args.port, print=None)


if __name__ == "__main__":
    main()
