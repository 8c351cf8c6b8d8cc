"""``ckptstore keygen``: create a new random master key."""

from __future__ import annotations

import base64
import os
import secrets

import click

from ..errors import CkptStoreError, StorageError
from ._common import KEY_FILE_FORMAT


def new_key_text() -> bytes:
    """A new AES-256 master key as a key file holds it: base64 of 32 random bytes, then a newline."""
    return base64.b64encode(secrets.token_bytes(32)) + b"\n"


@click.command("keygen", help=f"""Write a new random master key to FILE (created with mode 0600; an existing FILE is never
overwritten), or print it to stdout when FILE is omitted.

{KEY_FILE_FORMAT} Use it with CKPTSTORE_KEY_FILE=FILE (training and loading) or
--key-file FILE (scrub, rekey); keep a copy elsewhere: without it the checkpoints it encrypts cannot
be read.""")
@click.argument("file", required=False, type=click.Path(dir_okay=False))
def keygen(file):
    from ..codec.crypto import key_id

    text = new_key_text()
    if file is None:
        click.echo(text.decode(), nl=False)
        return
    try:
        fd = os.open(file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise KeyFileExistsError(f"{file!r} already exists; keygen never overwrites a key (choose another FILE)") from None
    except OSError as e:
        raise StorageError(f"cannot create the key file {file!r}: {e.strerror}") from None
    try:
        os.fchmod(fd, 0o600)  # whatever the umask
        os.write(fd, text)
        os.fsync(fd)
    finally:
        os.close(fd)
    kid = key_id(base64.b64decode(text))
    click.echo(f"wrote a new master key (key id {kid}) to {file} (mode 0600)", err=True)


class KeyFileExistsError(CkptStoreError, FileExistsError):
    """The key file given to ``keygen`` exists already (exit 6, as every "already exists")."""

    exit_code = 6
