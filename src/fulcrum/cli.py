"""The ``fulcrum`` command: serve | check-config | health | fit-cost | simulate."""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence

EXIT_CONFIG = 2


def _load(path: str | None) -> object:
    from fulcrum.config import ConfigError, load_settings

    try:
        return load_settings(path)
    except ConfigError as err:
        for problem in err.problems:
            print(f"config error: {problem}", file=sys.stderr)
        raise SystemExit(EXIT_CONFIG) from None


def cmd_serve(args: argparse.Namespace) -> int:
    from fulcrum import logs
    from fulcrum.config import ConfigError, Settings, load_settings
    from fulcrum.metrics import CONFIG_RELOADS
    from fulcrum.service.server import Daemon, serve

    settings = _load(args.config)
    assert isinstance(settings, Settings)
    logs.configure(settings.logging.level, settings.logging.format)

    import structlog

    log = structlog.get_logger("fulcrum.cli")

    def reload(daemon: Daemon) -> None:
        """SIGHUP: read the file again; Daemon.reload applies it (restart-only keys keep
        their running values and are reported by name)."""
        try:
            new = load_settings(args.config)
        except ConfigError as err:
            CONFIG_RELOADS.labels("refused").inc()
            log.error("config_reload_refused", path=args.config, problems=err.problems)
            return
        daemon.reload(new)

    try:
        import uvloop

        return uvloop.run(serve(settings, reload))
    except KeyboardInterrupt:
        return 0


def cmd_check_config(args: argparse.Namespace) -> int:
    _load(args.file)
    print(f"{args.file}: ok")
    return 0


def cmd_health(args: argparse.Namespace) -> int:
    from fulcrum.client import check_health
    from fulcrum.client.tls import channel_credentials, read_token

    creds = None
    if args.ca or args.cert or args.key or args.token:
        creds = channel_credentials(args.ca, args.cert, args.key)
    token = read_token(args.token) if args.token else None
    status = asyncio.run(
        check_health(args.target, args.service, args.timeout, credentials=creds, token=token)
    )
    print(status)
    return 0 if status == "SERVING" else 1


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # Subcommands owned by other modules take their own arguments.
    if argv and argv[0] == "fit-cost":
        from fulcrum.tools.fit_cost import main as fit_main

        return fit_main(argv[1:])
    if argv and argv[0] == "simulate":
        from fulcrum.sim.cli import main as sim_main

        return sim_main(argv[1:])

    parser = argparse.ArgumentParser(prog="fulcrum", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("serve", help="run the daemon")
    p.add_argument("--config", help="YAML configuration (default: the embedded one)")
    p.set_defaults(fn=cmd_serve)
    p = sub.add_parser("check-config", help="validate a configuration file and exit")
    p.add_argument("file")
    p.set_defaults(fn=cmd_check_config)
    p = sub.add_parser("health", help="query gRPC health of a running daemon")
    p.add_argument("--target", default="127.0.0.1:50051", help="HOST:PORT")
    p.add_argument("--service", default="", help="service name ('' = whole server)")
    p.add_argument("--timeout", type=float, default=3.0, help="seconds")
    p.add_argument("--ca", help="PEM file of the CA that signed the server (turns on TLS)")
    p.add_argument("--cert", help="client certificate, PEM (mutual TLS)")
    p.add_argument("--key", help="client private key, PEM (mutual TLS)")
    p.add_argument("--token", help="file holding a bearer token (sent over TLS only)")
    p.set_defaults(fn=cmd_health)
    sub.add_parser("fit-cost", help="fit the prefill cost model from samples (CSV q,c,ns)")
    sub.add_parser("simulate", help="replay a trace through the policies (see --help)")
    args = parser.parse_args(argv)
    result: int = args.fn(args)
    return result


if __name__ == "__main__":
    sys.exit(main())
