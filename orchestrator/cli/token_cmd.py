"""`fauxmad token mint|attenuate|inspect|revoke`: HTTP API tokens; thin, the work is in `security.tokens`."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import typer

from bus.contract.base import seconds
from bus.transport.connection import connect
from bus.transport.jetstream import revoked_tokens_bucket
from bus.transport.nats_adapter import Nats
from orchestrator.cli.render import print_json
from orchestrator.cli.runtime import JsonOption, NatsOption, check_app, fail, with_connected
from orchestrator.security.tokens import (
    KEY_BYTES,
    Token,
    TokenError,
    attenuate,
    caveats_for,
    decode,
    mint,
    new_root_key,
)

token_app = typer.Typer(
    help="HTTP API tokens: app-scoped, expiring, revocable; anyone holding one can narrow it (macaroons).",
    no_args_is_help=True,
)
AppScope = typer.Option(None, "--app", "-a", help="only this app's paths", callback=check_app)
TtlOption = typer.Option(None, "--ttl", help="expires after this long: 30m, 12h, 7d")
ReadOnly = typer.Option(False, "--read-only", help="GET requests only")


def _caveats(app: str | None, ttl: str | None, read_only: bool) -> list[str]:
    try:
        return caveats_for(app=app, ttl=seconds(ttl) if ttl else None, read_only=read_only, now=time.time())
    except ValueError as exc:
        fail(f"--ttl: {exc}", 2)


def _show(token: Token, as_json: bool, text: str | None = None) -> None:
    if as_json:
        expires = token.expires
        print_json(
            {"id": token.id, "root": token.root_id, "caveats": list(token.caveats), "expires": expires, "token": text}
        )
    elif text is not None:
        print(text)


@token_app.command("mint")
def mint_command(
    key: Path = typer.Option(..., "--key", help="the fleet's token root key (made, 0600, if the file is missing)"),
    app: str | None = AppScope,
    ttl: str | None = TtlOption,
    read_only: bool = ReadOnly,
    as_json: bool = JsonOption,
) -> None:
    """Mint a token from the fleet's root key; `fauxmad api --token-key` accepts it.

    `fauxmad token mint --key fleet/token.key -a web --ttl 7d`
    """
    caveats = _caveats(app, ttl, read_only)
    if not key.exists():
        fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as out:
            out.write(new_root_key())
        print(f"made a new token root key in {key} (keep it secret: it mints any token)", file=sys.stderr)
    root = key.read_bytes()
    if len(root) != KEY_BYTES:
        fail(f"{key} is not a token key ({KEY_BYTES} bytes)", 2)
    token = mint(root, caveats)
    _show(token, as_json, token.encode())


@token_app.command("attenuate")
def attenuate_command(
    token: str = typer.Argument(..., help="the token to narrow"),
    app: str | None = AppScope,
    ttl: str | None = TtlOption,
    read_only: bool = ReadOnly,
    as_json: bool = JsonOption,
) -> None:
    """Narrow a token without the root key (hand CI a token for one app, read-only, for an hour).

    `fauxmad token attenuate "$TOKEN" --read-only --ttl 1h`
    """
    caveats = _caveats(app, ttl, read_only)
    if not caveats:
        fail("say how to narrow it: --app, --ttl or --read-only", 2)
    narrower = attenuate(_decode(token), caveats)
    _show(narrower, as_json, narrower.encode())


@token_app.command("inspect")
def inspect_command(token: str = typer.Argument(..., help="a token"), as_json: bool = JsonOption) -> None:
    """What a token says it allows (its id and caveats; only the API, with the root key, can verify it)."""
    found = _decode(token)
    if as_json:
        _show(found, True)
        return
    print(f"id       {found.id}")
    print(f"root     {found.root_id}  (shared with every token narrowed from the same mint)")
    for caveat in found.caveats or ("(none: any app, any request, no expiry)",):
        print(f"caveat   {caveat}")


@token_app.command("revoke")
def revoke_command(
    token_id: str = typer.Argument(..., help="the token's id (`fauxmad token inspect` shows it), or the token"),
    nats: str | None = NatsOption,
) -> None:
    """Revoke a token and every token narrowed from it (never the one it was narrowed from), on every API process
    at once."""
    if token_id.startswith("fm1_"):
        token_id = _decode(token_id).id
    if not token_id.isalnum():
        fail(f"invalid token id {token_id!r}", 2)

    async def act(nc: Nats) -> None:
        bucket = await revoked_tokens_bucket(nc.jetstream())
        await bucket.put(token_id, f"revoked at {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}".encode())
        print(f"revoked token {token_id}")

    with_connected(nats, lambda url: connect(url, "fauxmad-token"), act)


def _decode(text: str) -> Token:
    try:
        return decode(text)
    except TokenError as exc:
        fail(exc.message, 2)
