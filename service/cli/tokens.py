"""``edge-un token create NAME | list | revoke ID``: API tokens for the HTTP service.

They read the same settings as ``edge-un serve`` (EDGE_UN_DATA_DIR, EDGE_UN_DATABASE_URL), so a
token created here is valid against a server started with the same environment.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import TYPE_CHECKING, Annotated

import typer
from rich.text import Text

from service.errors import UsageError

from . import output
from .app import app, command

if TYPE_CHECKING:
    from service.settings import Settings

token_app = typer.Typer(
    name="token",
    help="Create, list and revoke the API tokens of the HTTP service.",
    no_args_is_help=True,
    rich_markup_mode="markdown",
)
app.add_typer(token_app, rich_help_panel="Service")


def settings() -> Settings:
    """The service's settings; a clear line if the service extra is not installed."""
    try:
        from service.settings import get_settings
    except ModuleNotFoundError as error:
        raise ModuleNotFoundError(
            f"the HTTP service needs {error.name}: pip install 'edge-un[service]'"
        ) from None
    return get_settings()


def _when(moment: datetime | None) -> str:
    if moment is None:
        return "-"
    if moment.tzinfo is not None:
        moment = moment.astimezone(UTC)
    return moment.strftime("%Y-%m-%d %H:%M:%S UTC")


@command(token_app)
def create(
    name: Annotated[str, typer.Argument(help="What the token is for, e.g. ci or alice-laptop.")],
) -> int:
    """Create a token. It is printed once, alone on the last line of stdout; only its hash is
    stored, so keep it now."""
    from service.tokens import create_token

    info, secret = create_token(settings(), name)
    output.note(
        f"created token {info.id} ({info.name}); it is shown once and only its hash is stored:"
    )
    # The secret alone on stdout: TOKEN=$(edge-un token create ci) captures just it.
    output.stdout().print(secret)
    return 0


@command(token_app, name="list")
def list_() -> int:
    """List the tokens: id, name, created, revoked (never the secrets)."""
    from service.tokens import list_tokens

    tokens = list_tokens(settings())
    listing = output.table("id", "name", "created", "revoked", numeric=("id",))
    for info in tokens:
        revoked = Text(_when(info.revoked_at), style="red" if info.revoked_at else "dim")
        listing.add_row(str(info.id), info.name, _when(info.created_at), revoked)
    if tokens:
        output.print_table(output.stdout(), listing)
    else:
        output.note("no tokens yet: edge-un token create NAME")
    return 0


@command(token_app)
def revoke(token_id: Annotated[int, typer.Argument(metavar="ID", help="The token's id.")]) -> int:
    """Revoke a token: requests with it are refused from now on (its jobs stay)."""
    from service.tokens import revoke_token

    try:
        info = revoke_token(settings(), token_id)
    except KeyError:
        raise UsageError(f"no token with id {token_id} (see edge-un token list)") from None
    output.stdout().print(f"revoked token {info.id} ({info.name}) at {_when(info.revoked_at)}")
    return 0
