"""``kvsim serve``'s app on 127.0.0.1 inside the test's process: a check
runs against it with a bound, and the server is closed whatever happens."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp.test_utils import TestClient, TestServer

from sim.scenario import Scenario
from sim.serving.live_engine import LiveEngine
from sim.serving.openai_requests import ParsedRequest
from sim.serving.server import Bounds, build_app

CHECK_BOUND_S = 60


def serve_in_process(scenario: Scenario, check: Callable[[TestClient], Awaitable[Any]], speed: float) -> Any:
    """Run ``check`` against a server of ``scenario`` (layout on), stopped afterwards."""
    return serve_engine(LiveEngine(scenario, "on", speed=speed), check)


def serve_engine(
    engine: LiveEngine, check: Callable[[TestClient], Awaitable[Any]], bounds: Bounds | None = None
) -> Any:
    """Run ``check`` against a server of ``engine`` (with ``bounds``, else
    the server's), stopped afterwards."""

    async def main() -> Any:
        client = TestClient(TestServer(build_app(engine, bounds), host="127.0.0.1"))
        await client.start_server()
        try:
            return await asyncio.wait_for(check(client), CHECK_BOUND_S)
        finally:
            await client.close()

    return asyncio.run(main())


def parsed_request(
    kind: str = "completion", stream: bool = False, return_token_ids: bool = False
) -> ParsedRequest:
    """A parsed request for prompt ids [1, 2, 3] and 5 output tokens, no usage chunk."""
    return ParsedRequest(
        kind=kind,  # type: ignore[arg-type]
        prompt_ids=[1, 2, 3],
        max_tokens=5,
        stream=stream,
        include_usage=False,
        return_token_ids=return_token_ids,
    )
