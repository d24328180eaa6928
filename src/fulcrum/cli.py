"""The ``fulcrum`` command: serve | gateway | check-config | health | fit-cost | simulate."""

from __future__ import annotations

import argparse
import asyncio
import errno
import re
import socket
import sys
from collections.abc import Sequence
from typing import Any

from fulcrum import __version__

EXIT_CONFIG = 2
EXIT_BIND = 2


def _load(path: str | None, overrides: dict[str, Any] | None = None) -> Any:
    """Validated settings from ``path`` (None: the embedded defaults) with ``overrides``
    applied; prints every problem and exits 2 when refused."""
    from fulcrum.config import ConfigError, load_settings, with_overrides

    try:
        settings = load_settings(path)
        return with_overrides(settings, overrides) if overrides else settings
    except ConfigError as err:
        for problem in err.problems:
            print(f"config error: {problem}", file=sys.stderr)
        raise SystemExit(EXIT_CONFIG) from None


def serve_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The YAML keys ``--host``, ``--port`` and ``--metrics-port`` override."""
    out: dict[str, Any] = {}
    if args.host is not None:
        out.setdefault("server", {})["host"] = args.host
    if args.port is not None:
        out.setdefault("server", {})["port"] = args.port
    if args.metrics_port is not None:
        out["metrics"] = {"port": args.metrics_port}
    return out


def bind_failure(exc: BaseException, settings: Any) -> str | None:
    """One line for a port that cannot be bound (gRPC's RuntimeError or the metrics
    server's OSError): the address, the key to change and a hint; None for other errors."""
    s, m, g = settings.server, settings.metrics, settings.gateway
    keys = [(f"{s.host}:{s.port}", "server.port (or --port)"),
            (f"{m.host}:{m.port}", "metrics.port (or --metrics-port)"),
            (f"{g.host}:{g.port}", "gateway.port"),
            (f"{g.host}:{g.health_port}", "gateway.health_port")]
    if isinstance(exc, RuntimeError):
        found = re.search(r"bind to address ([^\s;]+)", str(exc))
        if found is None:
            return None
        address = found.group(1)
        reason = "address in use or not available"
    elif isinstance(exc, OSError) and exc.errno in (
        errno.EADDRINUSE, errno.EADDRNOTAVAIL, errno.EACCES
    ):
        address, reason = keys[1][0], exc.strerror or "cannot bind"
    else:
        return None
    port = address.rsplit(":", 1)[-1]
    key = next((k for a, k in keys if a == address), None) or next(
        (k for a, k in keys if a.rsplit(":", 1)[-1] == port), "the port in the configuration"
    )
    return f"fulcrum: {address}: {reason}; change {key}. Another fulcrum running?"


def busy_port(settings: Any) -> str | None:
    """One line (as :func:`bind_failure`) if the gRPC or metrics port is taken now.
    Checked before starting, so the gRPC core's own log line never comes first; the bind
    itself still reports a port taken in between."""
    ports = [(settings.server.host, settings.server.port)]
    if settings.metrics.enabled:
        ports.append((settings.metrics.host, settings.metrics.port))
    for host, port in ports:
        if not port:
            continue
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except socket.gaierror:
            continue  # the bind reports it
        with socket.socket(infos[0][0], socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(infos[0][4])
            except OSError as exc:
                is_grpc = (host, port) == (settings.server.host, settings.server.port)
                error = RuntimeError(f"Failed to bind to address {host}:{port}")
                return bind_failure(error if is_grpc else exc, settings)
    return None


def cmd_serve(args: argparse.Namespace) -> int:
    from fulcrum import logs
    from fulcrum.config import ConfigError, Settings, load_settings, with_overrides
    from fulcrum.metrics import CONFIG_RELOADS
    from fulcrum.service.server import Daemon, serve

    overrides = serve_overrides(args)
    settings = _load(args.config, overrides)
    assert isinstance(settings, Settings)
    line = busy_port(settings)
    if line is not None:
        print(line, file=sys.stderr)
        return EXIT_BIND
    logs.configure(settings.logging.level, settings.logging.format)

    import structlog

    log = structlog.get_logger("fulcrum.cli")

    def reload(daemon: Daemon) -> None:
        """SIGHUP: read the file again (the command-line overrides still apply);
        Daemon.reload applies it (restart-only keys keep their running values and are
        reported by name)."""
        try:
            new = load_settings(args.config)
            new = with_overrides(new, overrides) if overrides else new
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
    except (RuntimeError, OSError) as exc:
        line = bind_failure(exc, settings)
        if line is None:
            raise
        print(line, file=sys.stderr)
        return EXIT_BIND


def cmd_gateway(args: argparse.Namespace) -> int:
    from fulcrum.gateway import launch

    return launch.main(args, _load, bind_failure, busy_port)


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


def _add_serve(sub: Any) -> None:
    p = sub.add_parser("serve", help="run the daemon",
                       description="Run the daemon. The flags override the YAML.")
    p.add_argument("--config", help="YAML configuration (default: the embedded one)")
    p.add_argument("--host", help="gRPC listen address (server.host)")
    p.add_argument("--port", type=int, help="gRPC port (server.port; 0 = any free port)")
    p.add_argument("--metrics-port", type=int, help="Prometheus port (metrics.port)")
    p.set_defaults(fn=cmd_serve)


def _add_health(sub: Any) -> None:
    p = sub.add_parser("health", help="query gRPC health of a running daemon")
    p.add_argument("--target", default="127.0.0.1:50051", help="HOST:PORT")
    p.add_argument("--service", default="", help="service name ('' = whole server)")
    p.add_argument("--timeout", type=float, default=3.0, help="seconds")
    p.add_argument("--ca", help="PEM file of the CA that signed the server (turns on TLS)")
    p.add_argument("--cert", help="client certificate, PEM (mutual TLS)")
    p.add_argument("--key", help="client private key, PEM (mutual TLS)")
    p.add_argument("--token", help="file holding a bearer token (sent over TLS only)")
    p.set_defaults(fn=cmd_health)


def build_parser() -> argparse.ArgumentParser:
    """The ``fulcrum`` argument parser (fit-cost and simulate parse their own)."""
    from fulcrum.gateway.launch import add_parser as add_gateway

    parser = argparse.ArgumentParser(prog="fulcrum", description=__doc__)
    parser.add_argument("--version", action="version", version=f"fulcrum {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_serve(sub)
    add_gateway(sub).set_defaults(fn=cmd_gateway)
    p = sub.add_parser("check-config", help="validate a configuration file and exit")
    p.add_argument("file")
    p.set_defaults(fn=cmd_check_config)
    _add_health(sub)
    sub.add_parser("fit-cost", help="fit the prefill cost model from samples (CSV q,c,ns)")
    sub.add_parser("simulate", help="replay a workload through the policies (see --help)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # Subcommands owned by other modules take their own arguments.
    if argv and argv[0] == "fit-cost":
        from fulcrum.tools.fit_cost import main as fit_main

        return fit_main(argv[1:])
    if argv and argv[0] == "simulate":
        from fulcrum.sim.cli import main as sim_main

        return sim_main(argv[1:])
    args = build_parser().parse_args(argv)
    result: int = args.fn(args)
    return result


if __name__ == "__main__":
    sys.exit(main())
