"""The ``ckptstore`` command line: thin — parse, call the library, print, exit with the error's code.

One module per command (``cmd_<name>.py``); what they share (store options, opening the store,
output helpers, errors → exit codes) is in :mod:`._common`. Every command is wired below with an
explicit ``add_command``: a command module that fails to import fails the whole CLI loudly.
The ``demo`` command's module imports without its extra; the command itself checks the extra
before any work. Nothing here imports torch: ``ckptstore --help`` and the catalogue commands start fast.

Exit codes are those of :mod:`ckptstore.errors` (0 success; 2 usage; 3 version not found;
4 integrity; 5 key; 6 exists; 7 storage; 8 unsupported format; 9 no store at ROOT / --remote;
10/11/12 scrub outcomes; 13 key service: AWS KMS refused or did not answer).
"""

from __future__ import annotations

import click

from .._version import __version__
from ..demo.cli import demo
from . import cmd_advise, cmd_drop, cmd_gc, cmd_goodput, cmd_keygen, cmd_list, cmd_pin, cmd_rekey, cmd_scrub, cmd_show
from ._common import CONTEXT_SETTINGS, Group


@click.group(cls=Group, context_settings=CONTEXT_SETTINGS)
@click.version_option(__version__, prog_name="ckptstore")
def main():
    """ckptstore: list, inspect, prune and verify DCP checkpoints on local disk and remote object stores (S3, GCS, Azure Blob)."""


main.add_command(cmd_list.list_cmd)
main.add_command(cmd_show.show)
main.add_command(cmd_pin.pin)
main.add_command(cmd_pin.unpin)
main.add_command(cmd_gc.gc)
main.add_command(cmd_drop.drop)
main.add_command(cmd_scrub.scrub)
main.add_command(cmd_rekey.rekey)
main.add_command(cmd_keygen.keygen)
main.add_command(cmd_advise.advise)
main.add_command(cmd_goodput.goodput)
main.add_command(demo)

__all__ = ["main"]
