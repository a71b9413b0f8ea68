"""Modules the benchmark scripts (and some tests) import, not scripts to run: launching and stopping a server
(``server_process``), an SSE client (``sse_client``), sampling the server's threads and the GPU (``host_sampling``),
timing kernels inside CUDA graphs over weight copies that miss L2 (``graph_timing``). ``bench/`` is on ``sys.path``
(each script puts it there; ``tests/conftest.py`` does for the tests), so they import as ``kit.<module>``."""
