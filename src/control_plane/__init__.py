"""control_plane: replicas of the inference server behind one HTTP front, routed by a global prefix index.

Beside ``inference_server`` and built on its public surface only (the HTTP routes, ``GET /kv/events``, the
chained block hashes of ``inference_server.core.block_hashes``, settings and the tokenizer loader):

* ``prefix_index``: which replica holds which cached block (fed by every replica's ``/kv/events``);
* ``router``: the policies ``round_robin``, ``least_loaded`` and ``prefix_aware`` (llm-d style scoring);
* ``front``: the Quart-Trio app that routes and proxies the single server's routes (SSE passed through) and
  aggregates ``/metrics`` and ``/scheduler/stats``;
* ``replicas`` / ``ray_replica``: replicas as Ray actors (placed, restarted by Ray) or given as URLs;
* ``cli``: ``inference-server cluster --replicas N``.

See docs/control_plane.md.
"""
