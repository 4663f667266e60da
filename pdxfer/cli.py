"""The ``pdxfer`` command: arguments -> config -> daemon, plus the demo."""

from __future__ import annotations

import argparse
import logging
import sys

import msgspec

from .core import config as config_mod

log = logging.getLogger("pdxfer")


def _add_tool(sub, name: str, help: str, description: str, add_arguments, func) -> None:
    """A command whose long --help is its module's text, and whose flags its module adds."""
    parser = sub.add_parser(name, help=help, description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    parser.set_defaults(func=func)


def _add_config_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE", help="TOML file with any of the options below (env: PDXFER_CONFIG)")
    for name, default, desc in config_mod.fields():
        flag = "--" + name.replace("_", "-")
        env = f"; env {config_mod.ENV_PREFIX}{name.upper()}"
        if isinstance(default, bool):
            parser.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=None, help=f"{desc} (default: {'on' if default else 'off'}){env}")
            continue
        shown = "" if default is msgspec.NODEFAULT or default is None else f" (default: {default!r})"  # None: the text says
        parser.add_argument(flag, dest=name, default=None, metavar=name.upper(), help=f"{desc}{shown}{env}")


def cmd_serve(args: argparse.Namespace) -> int:
    try:
        cfg = config_mod.load(vars(args), file=args.config)
    except (ValueError, OSError) as exc:
        print(f"pdxfer serve: {exc}", file=sys.stderr)
        return 2
    from .logs import setup_logging

    setup_logging(cfg.log_level, cfg.log_format, cfg.instance)
    from .core.errors import PdxferError
    from .daemon.server import Daemon
    from .loop import run_uvloop

    try:
        run_uvloop(Daemon(cfg).run())
    except PdxferError as exc:
        log.error("cannot start: %s", exc)
        return 1
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from .tools.demo import run_demo

    return run_demo(args)


def cmd_soak(args: argparse.Namespace) -> int:
    from .tools.soak import run_soak

    return run_soak(args)


def cmd_bench(args: argparse.Namespace) -> int:
    from .tools.bench.main import run_bench

    return run_bench(args)


def cmd_proxy(args: argparse.Namespace) -> int:
    from .adapters.vllm.proxy import run

    return run(args)


def version_text() -> str:
    """pdxfer's version, the protocol it speaks and the transfer engine installed beside it."""
    from . import __version__
    from .core.protocol import PROTOCOL_VERSION
    from .transport.mooncake import installed_engine

    engine = installed_engine()
    return f"pdxfer {__version__}, protocol {PROTOCOL_VERSION}, transfer engine {' '.join(engine) if engine else 'not installed'}"


class VersionAction(argparse.Action):
    """--version, worked out only when asked (argparse's own takes the text up front)."""

    def __init__(self, option_strings, dest, **kwargs) -> None:
        super().__init__(option_strings, dest, nargs=0, help="print the version of pdxfer, its protocol and the transfer engine, and exit")

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        print(version_text())
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdxfer",
        description="Transfer service for prefill/decode disaggregated LLM serving: a sidecar daemon per "
        "worker ships each request's KV cache and aux metadata from prefill to decode over Mooncake's transfer engine.",
    )
    parser.add_argument("--version", action=VersionAction)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    serve = sub.add_parser(
        "serve",
        help="run a daemon beside a prefill or decode engine",
        description="Run a pdxfer daemon. Options come from flags, PDXFER_* environment variables and an optional "
        "TOML file (keys spelt as the flags, e.g. bootstrap-port, or with underscores), in that order of precedence; "
        "an empty PDXFER_* variable counts as unset. Prints one JSON 'ready' line on stdout once it serves.",
    )
    _add_config_flags(serve)
    serve.set_defaults(func=cmd_serve)

    demo = sub.add_parser(
        "demo",
        help="ship real KV between two daemons on loopback and verify every byte",
        description="Start a prefill and a decode daemon and a simulated engine beside each (four processes), "
        "ship rooms of real KV pages and aux records through the transfer engine over TCP on loopback, verify "
        "every destination byte, and print a summary. Exits non-zero on any mismatch or failed room.",
    )
    demo.add_argument("--rooms", type=int, default=400, help="rooms to ship (default: 400)")
    demo.add_argument("--in-flight", type=int, default=32, help="rooms in flight at once (default: 32)")
    demo.add_argument("--layout", default="mha", choices=["mha", "mla", "page_first", "page_first_kv"], help="KV layout (default: mha)")
    demo.add_argument("--layers", type=int, default=8, help="model layers (default: 8)")
    demo.add_argument("--page-size", type=int, default=16, help="tokens per page (default: 16)")
    demo.add_argument("--token-bytes", type=int, default=2048,
                      help="bytes per token per layer and K or V buffer; 2048 is 8 KV heads x 128 x bf16 (default: 2048)")
    demo.add_argument("--pages", type=int, default=2048, help="pages in each pool (default: 2048)")
    demo.add_argument("--max-tokens", type=int, default=512, help="largest prompt, in tokens (default: 512)")
    demo.add_argument("--aux-path", default="auto", choices=["auto", "tcp", "transfer_engine"], help="how aux records travel (default: auto)")
    demo.add_argument("--seed", type=int, default=1, help="random seed for prompts and page choices (default: 1)")
    demo.add_argument("--json", action="store_true", help="print the summary as JSON")
    demo.set_defaults(func=cmd_demo)

    from .tools.bench.args import DESCRIPTION as BENCH_DESCRIPTION, add_arguments as add_bench_arguments

    _add_tool(sub, "bench", "measure pdxfer against raw transfer engines and a plain socket on loopback", BENCH_DESCRIPTION, add_bench_arguments, cmd_bench)

    from .tools.soak import __doc__ as soak_doc, add_arguments as add_soak_arguments

    _add_tool(sub, "soak", "run rooms for minutes with every fault mixed in; report failures, corruptions and memory", soak_doc, add_soak_arguments, cmd_soak)

    from .adapters.vllm.proxy import DESCRIPTION as PROXY_DESCRIPTION, add_arguments as add_proxy_arguments

    _add_tool(sub, "proxy", "route OpenAI requests to a prefill and a decode vLLM engine that move KV through pdxfer", PROXY_DESCRIPTION, add_proxy_arguments, cmd_proxy)

    # Operator commands: rooms, room, peers, peer, slots, top (ops/inspection.py, ops/top.py) and doctor
    # (ops/doctor.py); their flags live in ops/commands.py, the commands load when run.
    from .ops.commands import add_commands as add_operator_commands

    add_operator_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:  # `pdxfer` alone: what it can do, not an error
        parser.print_help()
        return 0
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
