"""``inference-server cluster``: replicas of the server behind one front that routes by prefix.

    inference-server cluster --replicas 2                        # a local Ray, two replicas
    inference-server cluster --replicas 4 --ray-address auto     # an existing Ray cluster (run on a node)
    inference-server cluster --replica-url http://a:8001 --replica-url http://b:8001   # servers started elsewhere

Every setting of ``inference-server serve`` (flags, environment, ``.env``) goes to each replica, except
``HOST`` and ``PORT``, which are the front's (replicas listen on ephemeral ports). The front loads the
model's tokenizer (not its weights) to hash text and chat prompts like the replicas do.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any

from inference_server.cli.settings_flags import add_setting_flags, setting_overrides
from inference_server.config import Settings, SettingsError, load_settings

log = logging.getLogger(__name__)

LOCAL_HOST = "127.0.0.1"


def add_parser(commands: Any) -> None:
    parser = commands.add_parser("cluster", help="replicas behind one HTTP front routed by a global prefix index "
                                 "(Ray)", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    group = parser.add_argument_group("cluster")
    group.add_argument("--replicas", type=int, default=1, help="replica actors to start on Ray (default 1)")
    group.add_argument("--policy", default="prefix_aware", choices=("round_robin", "least_loaded", "prefix_aware"))
    group.add_argument("--ray-address", default=None,
                       help="an existing Ray cluster ('auto', 'ray://head:10001', or RAY_ADDRESS); default: start "
                            "a local one")
    group.add_argument("--replica-gpus", type=float, default=None,
                       help="GPUs per replica (default: 1 where the driver sees CUDA, else 0)")
    group.add_argument("--replica-cpus", type=float, default=1.0, help="CPUs Ray reserves per replica (default 1)")
    group.add_argument("--max-restarts", type=int, default=-1,
                       help="times Ray restarts a dead replica (-1: always, the default)")
    group.add_argument("--ray-num-cpus", type=int, default=None, help="CPUs of a local Ray (default: all)")
    group.add_argument("--replica-url", action="append", default=[],
                       help="route to a server started elsewhere instead of starting replicas (repeat; no Ray)")
    add_setting_flags(parser)


def run(args: argparse.Namespace) -> int:
    try:
        settings = load_settings(overrides=setting_overrides(args))
    except SettingsError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per proxied request otherwise
    from control_plane.front import Front
    from control_plane.serving import serve_front
    from inference_server.models.loading.source import load_tokenizer

    tokenizer = load_tokenizer(settings)
    if args.replica_url:
        from control_plane.replicas import StaticReplicas

        serve_front(Front(StaticReplicas(args.replica_url), args.policy, tokenizer), settings.host, settings.port,
                    max_body_bytes=settings.max_body_bytes)
        return 0
    if args.replicas < 1:
        print("error: --replicas must be at least 1", file=sys.stderr)
        return 2
    return _run_on_ray(args, settings, tokenizer)


def _run_on_ray(args: argparse.Namespace, settings: Settings, tokenizer: Any) -> int:
    # Ray's uv hook would re-run every worker through `uv run` with the working folder uploaded (seconds per
    # actor): our workers use the driver's interpreter and environment as they are.
    os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
    import ray

    from control_plane.front import Front
    from control_plane.ray_replica import RayReplicas, settings_overrides
    from control_plane.serving import serve_front

    address = args.ray_address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address)
    else:
        ray.init(num_cpus=args.ray_num_cpus, include_dashboard=False)
    gpus = args.replica_gpus
    if gpus is None:
        import torch

        gpus = 1.0 if torch.cuda.is_available() else 0.0
    replicas = None
    try:
        replicas = RayReplicas(args.replicas, settings_overrides(settings), num_gpus=gpus, num_cpus=args.replica_cpus,
                               max_restarts=args.max_restarts, host=LOCAL_HOST if not address else "0.0.0.0",
                               advertise_node_ip=bool(address), sequential=not settings.model)
        serve_front(Front(replicas, args.policy, tokenizer), settings.host, settings.port,
                    max_body_bytes=settings.max_body_bytes)
    finally:
        if replicas is not None:
            replicas.shutdown()
        ray.shutdown()
    return 0
