"""What every ``ckptstore`` command shares: the store options, opening the store, output helpers,
and the one place where a :class:`~ckptstore.errors.CkptStoreError` becomes an exit code.

Kept free of torch (and of the heavier ckptstore modules) so that ``ckptstore --help`` and the
catalogue commands start fast; commands import what they need inside their bodies.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys

import click

from ..errors import CkptStoreError, StorageError, StoreNotFoundError

CONTEXT_SETTINGS = {"help_option_names": ["-h", "--help"]}

#: How a master key file looks; shown in the ``--help`` of every command that takes one.
KEY_FILE_FORMAT = ("A key file holds one AES-256 master key: 32 raw bytes, or their base64 on one line "
                   "(what 'ckptstore keygen' writes).")

#: Where a CLI user supplies the master key (replaces the library's ``key=`` in key error hints).
KEY_SOURCES = "--key-file, CKPTSTORE_KEY or CKPTSTORE_KEY_FILE"
#: ... and an AWS KMS key
KMS_SOURCES = "--kms-key or CKPTSTORE_KMS_KEY_ID"


# -- errors → exit codes (the one place) ---------------------------------------------------------------
class Group(click.Group):
    """The ``ckptstore`` group: a :class:`CkptStoreError` raised by any command is printed as
    ``error: <message>`` on stderr and the process exits with the error's ``exit_code``. With
    ``--json`` the error is also written to stdout as ``{"error": {"type", "message", "exit_code"}}``
    (usage errors too: type ``UsageError``, exit code 2), so a script reading stdout always gets JSON."""

    def invoke(self, ctx: click.Context):
        from ..codec import crypto

        setup_logging()
        as_json = "--json" in [*(getattr(ctx, "_protected_args", None) or getattr(ctx, "protected_args", ()) or ()),
                               *ctx.args]
        library_words, crypto.KEY_SOURCES = crypto.KEY_SOURCES, KEY_SOURCES
        library_kms, crypto.KMS_SOURCES = crypto.KMS_SOURCES, KMS_SOURCES
        try:
            return super().invoke(ctx)
        except CkptStoreError as e:
            if as_json:
                _json_error(type(e).__name__, str(e), e.exit_code)
            click.echo(f"error: {e}", err=True)
            ctx.exit(e.exit_code)
        except click.ClickException as e:
            if as_json:
                _json_error(type(e).__name__, e.format_message(), e.exit_code)
            raise
        finally:
            crypto.KEY_SOURCES = library_words
            crypto.KMS_SOURCES = library_kms


def _json_error(kind: str, message: str, exit_code: int) -> None:
    click.echo(json.dumps({"error": {"type": kind, "message": message, "exit_code": exit_code}}, indent=2))


# -- library warnings ------------------------------------------------------------------------------------
class _WarningHandler(logging.Handler):
    """Prints each distinct ckptstore warning once per command as ``warning: <message>`` on the
    current stderr (looked up at emit time, so it follows click's test runner too)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.seen: set[str] = set()
        self.muted = 0

    def emit(self, record: logging.LogRecord) -> None:
        if self.muted:
            return
        msg = record.getMessage()
        if msg in self.seen:
            return
        self.seen.add(msg)
        click.echo(f"{record.levelname.lower()}: {msg}", err=True)


_handler: _WarningHandler | None = None


def setup_logging() -> None:
    """Route the library's ``ckptstore`` logger through :class:`_WarningHandler` (once per process;
    the seen-set is reset for every command)."""
    global _handler
    if _handler is None:
        _handler = _WarningHandler()
        logging.getLogger("ckptstore").addHandler(_handler)
    _handler.seen.clear()
    _handler.muted = 0


@contextlib.contextmanager
def reported_here():
    """Mute library warnings while a command gathers findings it prints itself (the invalid
    manifests of ``list``, ``gc`` and ``scrub``), so each is reported once, in the command's words."""
    if _handler is not None:
        _handler.muted += 1
    try:
        yield
    finally:
        if _handler is not None:
            _handler.muted -= 1


# -- the store options ---------------------------------------------------------------------------------
def _remote_option(ctx, param, value):
    """Collect ``--endpoint-url`` and ``--remote-option KEY=VALUE`` into the remote tier's options
    (``ctx.meta["ckptstore.remote_options"]``, what :func:`open_store` passes on: docs/tiers.md)."""
    opts = ctx.meta.setdefault("ckptstore.remote_options", {})
    if param.name == "endpoint_url":
        if value:
            opts["endpoint_url"] = value
        return
    for item in value or ():
        name, sep, v = item.partition("=")
        if not sep or not name.isidentifier():
            raise click.BadParameter(f"{item!r} is not KEY=VALUE", ctx=ctx, param=param)
        opts[name] = _option_value(v)


def _option_value(v: str):
    """``--remote-option`` values: integers, floats, true/false as such, else the string."""
    if v.lower() in ("true", "false"):
        return v.lower() == "true"
    for conv in (int, float):
        try:
            return conv(v)
        except ValueError:
            pass
    return v


def store_options(f):
    """``ROOT``, ``--remote URL``, ``--endpoint-url``, ``--remote-option``, ``--json`` shared by every
    store command."""
    f = click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")(f)
    f = click.option("--remote-option", "remote_option", multiple=True, metavar="KEY=VALUE", expose_value=False,
                     callback=_remote_option,
                     help="An option of the remote tier (repeatable; docs/tiers.md, \"Options\"), e.g. "
                          "region_name=eu-west-1, project=my-project, account_name=acct.")(f)
    f = click.option("--endpoint-url", "endpoint_url", default=None, expose_value=False, callback=_remote_option,
                     help="Endpoint of the remote tier's server (default: its SDK's environment: AWS_ENDPOINT_URL, "
                          "STORAGE_EMULATOR_HOST, AZURE_STORAGE_CONNECTION_STRING...).")(f)
    f = click.option("--remote", default=None, metavar="URL",
                     help="Remote tier: s3://bucket/prefix, gs://bucket/prefix or az://container/prefix.")(f)
    f = click.argument("root", metavar="ROOT")(f)
    return f


def key_file_option(*names: str, required: bool = False, what: str = "Master key file", env: bool | None = None):
    """A ``--key-file``-style option whose help states the key file format. ``env``: the command
    also reads the key from the environment (default: when the option is not required); the file
    must exist unless the environment may stand in for it."""
    env = not required if env is None else env
    hint = " (else CKPTSTORE_KEY / CKPTSTORE_KEY_FILE)" if env else ""
    return click.option(*names, default=None, required=required, type=click.Path(dir_okay=False, exists=not env),
                        help=f"{what}{hint}. {KEY_FILE_FORMAT}")


def load_key(path: str):
    """The 32-byte master key in ``path`` (format: :data:`KEY_FILE_FORMAT`)."""
    from ..codec import crypto

    return crypto.load_key_file(path)


def kms_key_option(*names: str, what: str = "AWS KMS key"):
    """A ``--kms-key``-style option: an AWS KMS key id, key ARN, alias or alias ARN."""
    return click.option(*names, default=None, metavar="KEY-ID",
                        help=f"{what}: key id, key ARN, alias (alias/NAME) or alias ARN; region, endpoint and credentials "
                             "from the boto3 chain (AWS_REGION, AWS_ENDPOINT_URL, AWS_PROFILE, ...).")


def master_key(key_file: str | None, kms_key: str | None = None) -> tuple[object, str | None]:
    """``(key, where it came from)``: ``--key-file``, else ``--kms-key``, else ``CKPTSTORE_KEY``,
    ``CKPTSTORE_KEY_FILE`` or ``CKPTSTORE_KMS_KEY_ID``; ``(None, None)`` when none is set. The key is
    32 bytes or a :class:`ckptstore.KmsKey`. A key that cannot be read or decoded raises
    :class:`~ckptstore.errors.KeyMismatchError` (exit 5) naming its source, however given."""
    from ..codec import crypto

    if key_file and kms_key:
        raise click.UsageError("give --key-file or --kms-key, not both")
    if key_file:
        return crypto.load_key_file(key_file), f"--key-file {key_file}"
    if kms_key:
        from ..kms import shared

        return shared(kms_key), f"--kms-key {kms_key}"
    if os.environ.get("CKPTSTORE_KMS_KEY_ID"):
        from ..keys import from_env

        return from_env(), f"CKPTSTORE_KMS_KEY_ID {os.environ['CKPTSTORE_KMS_KEY_ID']}"
    if os.environ.get("CKPTSTORE_KEY"):
        return crypto.resolve_key(None), "CKPTSTORE_KEY"
    if os.environ.get("CKPTSTORE_KEY_FILE"):
        return crypto.resolve_key(None), f"CKPTSTORE_KEY_FILE {os.environ['CKPTSTORE_KEY_FILE']}"
    return None, None


def open_store(root: str, remote: str | None, key=None):
    """The :class:`~ckptstore.Store` at ``ROOT`` / ``--remote``, after checking that the tiers named
    are initialised stores (docs/operations/cli.md, docs/FORMAT.md "An initialised store"):

    * ``ROOT`` ``''`` means *no local tier* (a remote-only store; ``--remote`` is then required);
    * a local ``ROOT`` must be an existing, readable directory (it may be empty). With a
      ``--remote`` that is a store, a ``ROOT`` that does not exist only draws a warning and the
      store is opened without a local tier (a node that never saved locally);
    * a ``--remote`` prefix must hold at least one object under ``versions/``. A remote that cannot
      be listed is left to the command (``scrub`` reports it as not checked, exit 12).

    Raises :class:`StoreNotFoundError` (exit 9) or :class:`StorageError` (exit 7, unreadable).
    """
    from ..store import Store

    local = root if root else None
    if local is None and not remote:
        raise click.UsageError("ROOT is '' (no local tier) and no --remote is given: name at least one tier")
    missing = local is not None and not os.path.lexists(local)
    if local is not None and not (missing and remote):
        _check_local_root(local)
    ctx = click.get_current_context(silent=True)
    options = dict(ctx.meta.get("ckptstore.remote_options", {})) if ctx is not None else {}
    st = Store(None if missing else local, remote=remote, remote_options=options, key=key)
    if st.remote is not None:
        _check_remote(st.remote)
        if missing:
            click.echo(f"warning: the local root {local!r} does not exist; using the remote tier only", err=True)
    return st


def _check_remote(tier) -> None:
    from ..manifest import layout

    try:
        first = next(iter(tier.list(layout.VERSIONS + "/")), None)
    except StorageError:
        return  # unreachable: the command says so in its own terms
    if first is None:
        raise StoreNotFoundError(
            f"no ckptstore store at {tier.url}: nothing under {layout.VERSIONS}/ there "
            "(a typo in --remote, or nothing was ever saved to it)"
        )


def _check_local_root(root: str) -> None:
    from ..store import check_root

    check_root(root)


# -- output ------------------------------------------------------------------------------------------------
def human(n: int | float | None) -> str:
    """``1536`` → ``"1.5 KiB"``; None → ``"-"``."""
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def emit_json(obj) -> None:
    click.echo(json.dumps(obj, indent=2, default=str))


def plural(n: int, one: str, many: str | None = None) -> str:
    return f"{n} {one if n == 1 else (many or one + 's')}"


@contextlib.contextmanager
def progress(description: str, unit: str = "bytes"):
    """Yields ``(set_total, advance)``; draws a rich progress bar only when stderr is a TTY."""
    if not sys.stderr.isatty():
        yield (lambda n: None), (lambda n: None)
        return
    from rich.console import Console
    from rich.progress import (BarColumn, DownloadColumn, MofNCompleteColumn, Progress, TextColumn,
                               TimeRemainingColumn, TransferSpeedColumn)

    cols = [TextColumn("{task.description}"), BarColumn()]
    cols += [DownloadColumn(), TransferSpeedColumn()] if unit == "bytes" else [MofNCompleteColumn()]
    cols.append(TimeRemainingColumn())
    with Progress(*cols, console=Console(stderr=True), transient=True) as prog:
        task = prog.add_task(description, total=None)
        yield (lambda n: prog.update(task, total=n)), (lambda n: prog.advance(task, n))


def pin_note(tier, version: str) -> str | None:
    """The ``--note`` stored with the pin of ``version`` in ``tier`` (None: not pinned there;
    ``""``: pinned without a note)."""
    from ..errors import ObjectNotFoundError
    from ..manifest import layout

    try:
        data = tier.get(layout.pin_key(version))
    except ObjectNotFoundError:
        return None
    try:
        note = json.loads(data).get("note", "")
    except (ValueError, AttributeError):
        return ""
    return note if isinstance(note, str) else str(note)


def pin_notes(st, version: str, tiers=None) -> dict[str, str]:
    """``{tier: note}`` for every tier (of ``tiers``, default all) where ``version`` is pinned."""
    out = {}
    for n, t in st.tiers.items():
        if tiers is not None and n not in tiers:
            continue
        note = pin_note(t, version)
        if note is not None:
            out[n] = note
    return out


def one_note(notes: dict[str, str]) -> str | None:
    """The pin note to show for a version: the first non-empty one (None when not pinned)."""
    if not notes:
        return None
    return next((v for v in notes.values() if v), "")


class Duration(click.ParamType):
    """A duration such as ``7d``, ``12h``, ``1d12h``, ``90m``, ``30s``, ``2w`` or ``0``, in seconds."""

    name = "duration"

    def convert(self, value, param, ctx):
        if isinstance(value, float):
            return value
        from ..retention import parse_duration

        try:
            return parse_duration(value)
        except ValueError as e:
            self.fail(str(e), param, ctx)


DURATION = Duration()
