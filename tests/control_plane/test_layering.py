"""control_plane sits beside inference_server and uses only its public surface: the modules listed here (the
HTTP routes themselves are the rest of the contract). The engine never imports the control plane, except its
command line, which dispatches ``inference-server cluster``."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"
PUBLIC = {
    "inference_server.cli.settings_flags",  # the settings as flags
    "inference_server.config",  # Settings, load_settings, env_name
    "inference_server.core.block_hashes",  # the chained hashes /kv/events publishes
    "inference_server.core.validation",  # PromptTokenizer, the tokenizer protocol
    "inference_server.engine_factory",  # build_engine_parts (a replica builds its engine)
    "inference_server.http.errors",  # ApiError: errors in the OpenAI shape
    "inference_server.http.sse",  # SSE framing (the in-band error event)
    "inference_server.models.loading.source",  # load_tokenizer
    "inference_server.server",  # run_server, ThreadControls (a replica's server in a thread)
}


def imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
    return found


def test_the_control_plane_uses_only_the_engines_public_modules() -> None:
    used = {name for path in (SRC / "control_plane").rglob("*.py") for name in imports(path)
            if name.split(".")[0] == "inference_server"}
    assert used and used <= PUBLIC, used - PUBLIC


def test_the_engine_does_not_import_the_control_plane_but_for_its_command_line() -> None:
    importers = {str(path.relative_to(SRC)) for path in (SRC / "inference_server").rglob("*.py")
                 if any(name.split(".")[0] == "control_plane" for name in imports(path))}
    assert importers == {"inference_server/__main__.py"}
