"""A griffe extension for the docs site (mkdocs.yml): the docstrings use reST roles
(:class:`ckptstore.Store`, :func:`unwrap`, :meth:`save`, :mod:`ckptstore.gc`, :attr:`code`,
:exc:`KeyError`); Markdown shows them as code (`ckptstore.Store`) instead of the raw role text."""

from __future__ import annotations

import re

import griffe

_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|attr|exc|data|obj|const):`~?([^`]+)`")


class RstRoles(griffe.Extension):
    def on_object(self, *, obj, **kwargs) -> None:  # griffe >= 1.13
        self._fix(obj)

    def on_instance(self, *, obj, **kwargs) -> None:  # older griffe
        self._fix(obj)

    @staticmethod
    def _fix(obj) -> None:
        ds = getattr(obj, "docstring", None)
        if ds is not None and ":" in ds.value:
            ds.value = _ROLE.sub(lambda m: f"`{m.group(1)}`", ds.value)
