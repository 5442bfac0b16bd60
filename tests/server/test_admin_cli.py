"""`sits serve` flags of the MoE expert admin surface: --admin-key (or $SITS_ADMIN_KEY),
--expert-freeze-after and --restore-frozen-experts."""

from __future__ import annotations

import argparse

from sits.cli.serve import add_serve_parser, resolve_admin_key


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="sits")
    add_serve_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["serve", *argv])


def test_admin_key_from_flag_then_environment() -> None:
    assert resolve_admin_key(_parse(["--admin-key", "k1"]), {"SITS_ADMIN_KEY": "k2"}) == "k1"
    assert resolve_admin_key(_parse([]), {"SITS_ADMIN_KEY": "k2"}) == "k2"
    assert resolve_admin_key(_parse([]), {}) is None
    assert resolve_admin_key(_parse([]), {"SITS_ADMIN_KEY": ""}) is None


def test_admin_key_help_names_the_dashboard_data() -> None:
    parser = argparse.ArgumentParser(prog="sits")
    add_serve_parser(parser.add_subparsers(dest="command", required=True))
    serve = parser._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr]
    (action,) = [a for a in serve._actions if "--admin-key" in a.option_strings]
    assert "/v1/admin" in action.help and "/dashboard/data" in action.help


def test_expert_health_flags() -> None:
    args = _parse([])
    assert (args.expert_freeze_after, args.restore_frozen_experts) == (3, False)
    args = _parse(["--expert-freeze-after", "5", "--restore-frozen-experts"])
    assert (args.expert_freeze_after, args.restore_frozen_experts) == (5, True)
