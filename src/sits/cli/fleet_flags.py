"""The fleet flags of `sits serve`: registration with `sits router`, the router key, and fault
injection (`add_fleet_args`), and their resolution into server settings.

- `--register-with URL` registers with the router at URL and sends it heartbeats
  (`sits.server.registration`); it needs the router key, from `--router-key` or else the
  SITS_ROUTER_KEY environment variable (read here, at run time). The replica advertises
  `--advertise-url`, by default http://HOST:PORT of `--host`/`--port` (with `--port 0`, the
  port the server binds); a wildcard host (0.0.0.0, ::) is no address the router can reach,
  so it needs `--advertise-url`.
- `--router-key` alone lets the router name a request's tenant in `x-sits-tenant`
  (`sits.server.trusted`).
- `--fault-injection SPEC` (`sits.server.faults`) is refused unless `--enable-fault-injection`
  is also given; `--fault-seed` seeds its decisions.
The resolvers raise `InvalidParameterError`, which `run_serve` turns into exit status 2 before
any model work.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import TYPE_CHECKING

from sits.cli.key_flags import add_secret_args, resolve_secret
from sits.config import ROUTER_KEY_ENV
from sits.core.errors import InvalidParameterError
from sits.core.fleet import DEFAULT_VERSION_LABEL

if TYPE_CHECKING:
    from sits.server.faults import FaultSpec
    from sits.server.registration import RegistrationSettings

_WILDCARD_HOSTS = frozenset({"0.0.0.0", "::", ""})
_FLAG_OF = {
    "router_url": "--register-with",
    "advertise_url": "--advertise-url",
    "version_label": "--version-label",
}


def add_fleet_args(p: argparse.ArgumentParser) -> None:
    """Add the fleet flags (see the module docstring) to the `serve` parser."""
    group = p.add_argument_group("fleet (sits router)")
    group.add_argument(
        "--register-with",
        default=None,
        metavar="URL",
        help="register with the fleet router at URL (e.g. http://127.0.0.1:8000) and send it a "
        "heartbeat with this server's load every 2 s; deregister on SIGTERM. Needs the router "
        f"key (--router-key or ${ROUTER_KEY_ENV})",
    )
    add_secret_args(
        group,
        "router-key",
        ROUTER_KEY_ENV,
        "the fleet router's bearer key: used for registration, and requests with this key may "
        "name their tenant in the x-sits-tenant header",
    )
    group.add_argument(
        "--advertise-url",
        default=None,
        metavar="URL",
        help="the URL the router reaches this server at (default http://HOST:PORT; with "
        "--port 0 the bound port)",
    )
    group.add_argument(
        "--version-label",
        default=DEFAULT_VERSION_LABEL,
        metavar="LABEL",
        help="the version label sent to the router: 'stable' (default) or 'canary' (the "
        "router ramps a canary's traffic up or rolls it back)",
    )
    group.add_argument(
        "--fault-injection",
        default=None,
        metavar="SPEC",
        help="FOR TESTS AND CHAOS DRILLS ONLY: inject faults into a share of /v1/completions "
        "and /v1/chat/completions requests, as Envoy's fault filter; SPEC is comma-separated "
        "delay=SECONDS@PERCENT, abort=STATUS@PERCENT, hang@PERCENT (e.g. "
        "'delay=0.5@20,abort=503@5'). Refused without --enable-fault-injection",
    )
    group.add_argument(
        "--enable-fault-injection",
        action="store_true",
        help="allow --fault-injection (off by default)",
    )
    group.add_argument(
        "--fault-seed",
        type=int,
        default=0,
        metavar="N",
        help="seed of the fault decisions (default 0: the same requests fail on every run)",
    )


def resolve_router_key(args: argparse.Namespace, environ: Mapping[str, str]) -> str | None:
    """--router-key, else --router-key-file, else $SITS_ROUTER_KEY, else None (an empty value
    means no key). Raises InvalidParameterError: an unreadable key file."""
    return resolve_secret(args, "router-key", ROUTER_KEY_ENV, environ)


def registration_arg(
    args: argparse.Namespace, router_key: str | None
) -> RegistrationSettings | None:
    """The `RegistrationSettings` of --register-with (None without it).

    Raises:
        InvalidParameterError: no router key, a wildcard --host without --advertise-url, a bad
            URL or version label.
    """
    from sits.server.registration import RegistrationSettings

    if args.register_with is None:
        return None
    if not router_key:
        raise InvalidParameterError(
            "router_key",
            f"--register-with needs the router's key: --router-key KEY or ${ROUTER_KEY_ENV}",
        )
    if args.advertise_url is None and args.host in _WILDCARD_HOSTS:
        raise InvalidParameterError(
            "advertise_url",
            f"--host {args.host!r} is no address the router can reach: give --advertise-url "
            "URL (e.g. http://10.0.0.5:8001)",
        )
    host = args.host
    url = args.advertise_url
    if url is None and args.port != 0:
        url = f"http://[{host}]:{args.port}" if ":" in host else f"http://{host}:{args.port}"
    try:
        return RegistrationSettings(
            router_url=args.register_with,
            advertise_url=url,  # None: the bound port of --port 0, known once the server listens
            advertise_host=host,
            version_label=args.version_label,
        )
    except InvalidParameterError as exc:
        flag = _FLAG_OF.get(exc.param, "--register-with")
        raise InvalidParameterError(exc.param, f"{flag}: {exc}") from None


def fault_injection_arg(args: argparse.Namespace) -> FaultSpec | None:
    """The `FaultSpec` of --fault-injection (None without it).

    Raises:
        InvalidParameterError: --fault-injection without --enable-fault-injection, or a
            malformed SPEC (the message names the item).
    """
    from sits.server.faults import parse_fault_spec

    if args.fault_injection is None:
        return None
    if not args.enable_fault_injection:
        raise InvalidParameterError(
            "fault_injection",
            "--fault-injection makes requests fail on purpose: add --enable-fault-injection "
            "to really start a server that does",
        )
    return parse_fault_spec(args.fault_injection, seed=args.fault_seed)
