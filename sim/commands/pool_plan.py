"""``kvsim pool-plan``: the KV pool each side-cache layout gives, as the fork
logs it at boot."""

from __future__ import annotations

import argparse
import json
from typing import Any

from sim.commands.common import add_model_flags, model_and_deployment


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "pool-plan", help="the KV pool each layout gives, as the fork logs it at boot"
    )
    add_model_flags(parser)
    parser.add_argument("--layout", choices=["both", "on", "off"], default="both")
    parser.add_argument("--json", action="store_true", help="one JSON object with keys off and on")
    parser.set_defaults(func=cmd_pool_plan)


def cmd_pool_plan(args: argparse.Namespace) -> int:
    model, deployment = model_and_deployment(args)
    from sim.kv_cache_plan import format_plan, plan_kv_cache
    from sim.vllm_bridge import vllm_info

    wanted = {"both": (False, True), "on": (True,), "off": (False,)}[args.layout]
    plans = {("on" if on else "off"): plan_kv_cache(model, deployment, side_cache_layout=on) for on in wanted}
    if args.json:
        print(json.dumps({name: plan.to_dict() for name, plan in plans.items()}, indent=2))
        return 0
    print(
        f"kvsim pool-plan: {model.name} (SSM state {model.ssm_state_dtype}) on "
        f"TP{deployment.tensor_parallel_size} x PP{deployment.pipeline_parallel_size}, "
        f"{deployment.kv_cache_memory_bytes:,} B per rank,"
        f" max_model_len {deployment.max_model_len:,}, max_num_seqs {deployment.max_num_seqs}"
    )
    print(f"  {vllm_info().describe()}")
    for plan in plans.values():
        print("\n".join(format_plan(plan, deployment)))
    if len(plans) == 2:
        off, on = plans["off"].kv_cache_tokens, plans["on"].kv_cache_tokens
        print(f"gain: {on - off:+,} tokens ({(on - off) / off:+.2%}) at the same pool")
    return 0
