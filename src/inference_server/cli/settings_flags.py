"""Every field of ``config.Settings`` as a command-line flag (``MAX_BATCH_SIZE`` is ``--max-batch-size``), for
each command that runs an engine (``serve``, ``generate``, ``export-tokenizer``, ``cluster``)."""

from __future__ import annotations

import argparse

import attrs

from inference_server.config import Settings, env_name


def add_setting_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("settings (also read from the environment and .env)")
    for field in attrs.fields(Settings):
        flag = "--" + field.name.replace("_", "-")
        help_text = field.metadata["help"] + f" [env {env_name(field)}, default {field.default!r}]"
        if field.type in (bool, "bool"):
            group.add_argument(flag, dest=field.name, nargs="?", const="true", default=None, metavar="BOOL",
                               help=help_text)
        else:
            group.add_argument(flag, dest=field.name, default=None, help=help_text)


def setting_overrides(args: argparse.Namespace) -> dict[str, str]:
    """The settings given as flags, by environment name (for ``config.load_settings(overrides=...)``)."""
    return {env_name(f): getattr(args, f.name) for f in attrs.fields(Settings)
            if getattr(args, f.name, None) is not None}
