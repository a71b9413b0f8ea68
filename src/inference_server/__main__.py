"""Command line: ``inference-server serve``, ``generate PROMPT...``, ``export-tokenizer DIR``, ``tail``,
``report RUN.sqlite`` and ``cluster`` (replicas behind a routing front: the ``control_plane`` package).

The only place argv is read. Every setting of ``config.Settings`` is also a flag (``MAX_BATCH_SIZE`` is
``--max-batch-size``); flags override the environment and ``.env``.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from inference_server.cli.settings_flags import add_setting_flags, setting_overrides
from inference_server.config import Settings, SettingsError, load_settings


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="inference-server", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    generate = commands.add_parser("generate", help="complete prompts offline through the engine and print them")
    generate.add_argument("prompts", nargs="+", help="prompt texts")
    generate.add_argument("--max-tokens", type=int, default=32)
    generate.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    generate.add_argument("--top-p", type=float, default=1.0)
    generate.add_argument("--top-k", type=int, default=0)
    generate.add_argument("--sampling-seed", type=int, default=None, help="per-request sampling seed")
    generate.add_argument("--chat", action="store_true", help="send each prompt as a user chat message")
    add_setting_flags(generate)
    serve = commands.add_parser("serve", help="run the HTTP server")
    add_setting_flags(serve)
    export = commands.add_parser("export-tokenizer", help="write the served tokenizer (tokenizer.json + "
                                 "tokenizer_config.json, chat template included) to DIR for transformers, aiperf "
                                 "and lm-eval")
    export.add_argument("directory", help="folder to write (created if needed)")
    add_setting_flags(export)
    from inference_server.cli import report, tail

    tail.add_parser(commands)
    report.add_parser(commands)
    from control_plane import cli as cluster

    cluster.add_parser(commands)
    return parser


def settings_from_args(args: argparse.Namespace) -> Settings:
    return load_settings(overrides=setting_overrides(args))


def run_generate(args: argparse.Namespace, settings: Settings) -> int:
    from inference_server.offline import LLM
    from inference_server.records.sampling_params import SamplingParams

    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_tokens=args.max_tokens, seed=args.sampling_seed)
    try:
        params.validate()
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    llm = LLM(settings)
    if not settings.model:
        from inference_server.models.loading.embedded import embedded_licence_path

        print(f"[default model: Gemma 3 270M, Gemma Terms of Use: {embedded_licence_path()}]", file=sys.stderr)
    for prompt, completion in zip(args.prompts, llm.generate(args.prompts, params, chat=args.chat), strict=True):
        if completion.error:
            print(f"error: {completion.error}", file=sys.stderr)
            return 1
        print(prompt + completion.text if not args.chat else completion.text)
    return 0


def run_export_tokenizer(args: argparse.Namespace, settings: Settings) -> int:
    from inference_server.models.loading.source import load_tokenizer
    from inference_server.models.tokenizer import TokenizerError
    from inference_server.models.tokenizer_export import export_tokenizer

    try:
        tokenizer = load_tokenizer(settings)
        if tokenizer is None:
            print(f"error: MODEL={settings.model!r} has no tokenizer to export", file=sys.stderr)
            return 2
        folder = export_tokenizer(tokenizer, args.directory)
    except TokenizerError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(f"wrote {folder / 'tokenizer.json'} and {folder / 'tokenizer_config.json'}; load them with "
          f"transformers.AutoTokenizer.from_pretrained({str(folder)!r})")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command in ("tail", "report"):  # clients of a server or of a run file: no engine settings
        from inference_server.cli import report, tail

        return tail.run(args) if args.command == "tail" else report.run(args)
    if args.command == "cluster":  # the front and its replicas read their settings themselves
        from control_plane import cli as cluster

        return cluster.run(args)
    try:
        settings = settings_from_args(args)
    except SettingsError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if args.command == "generate":
            return run_generate(args, settings)
        if args.command == "export-tokenizer":
            return run_export_tokenizer(args, settings)
        from inference_server.server import serve

        return serve(settings)
    except SettingsError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # offline.LLM.generate unwraps a Ctrl-C from trio's exception groups
        return 130
    except BaseExceptionGroup as group:  # an actor crashed: every request already got its terminal error
        if group.subgroup(KeyboardInterrupt) is not None:
            return 130
        logging.getLogger("inference_server").error("engine failure", exc_info=group)
        print(f"error: the engine failed: {group.exceptions[0]!r}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
