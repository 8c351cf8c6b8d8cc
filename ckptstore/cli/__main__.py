"""``python -m ckptstore.cli``: the ``ckptstore`` command."""

from . import main

main(prog_name="ckptstore")
