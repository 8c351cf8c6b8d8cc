"""A griffe extension for the docs site (mkdocs.yml). The docstrings are written as reST-flavoured
Google style; Markdown would show some of it raw, so before rendering:

* roles (:class:`ckptstore.Store`, :func:`unwrap`, :meth:`save`, :mod:`ckptstore.gc`, ...) become
  code (`ckptstore.Store`);
* a paragraph ending in ``::`` (a reST literal block follows) ends in ``:``, so the indented block
  after it renders as code;
* reST simple tables (``====  ====`` borders) become Markdown tables.

The source docstrings stay as they are (they read well in ``help()``)."""

from __future__ import annotations

import re

import griffe

_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|attr|exc|data|obj|const):`~?([^`]+)`")
_BORDER = re.compile(r"\s*=+(?:\s+=+)+\s*")


def _table(lines: list[str], i: int) -> tuple[list[str], int]:
    """The reST simple table starting at border line ``i``: (Markdown lines, index after it)."""
    spans = [m.start() for m in re.finditer(r"=+", lines[i])]
    rows: list[list[str]] = []
    header = None
    j = i + 1
    while j < len(lines) and lines[j].strip():
        ln = lines[j]
        j += 1
        if _BORDER.fullmatch(ln):
            if j < len(lines) and lines[j].strip() and header is None and rows:
                header = len(rows)  # an inner border: the rows above are the header
                continue
            break  # the closing border
        cells = [ln[a:b].strip() for a, b in zip(spans, spans[1:] + [None])]
        if rows and not cells[0]:  # a continuation line of the row above
            rows[-1] = [(p + " " + c).strip() for p, c in zip(rows[-1], cells)]
        else:
            rows.append(cells)
    if not rows:
        return [lines[i]], i + 1
    head, body = (rows[:header], rows[header:]) if header else ([[""] * len(spans)], rows)
    out = ["| " + " | ".join(r) + " |" for r in head[:1]]
    out.append("|" + "---|" * len(spans))
    out += ["| " + " | ".join(c.replace("|", "\\|") for c in r) + " |" for r in body]
    return ["", *out, ""], j


def to_markdown(text: str) -> str:
    text = _ROLE.sub(lambda m: f"`{m.group(1)}`", text)
    lines = text.split("\n")
    out: list[str] = []
    i = 0
    while i < len(lines):
        ln = lines[i]
        if _BORDER.fullmatch(ln) and ln == ln.lstrip():
            md, i = _table(lines, i)
            out += md
            continue
        if ln.rstrip().endswith("::") and not ln.strip().startswith(".."):
            ln = ln.rstrip()[:-2].rstrip() + ":" if ln.strip() != "::" else ""
        out.append(ln)
        i += 1
    return "\n".join(out)


class RstRoles(griffe.Extension):
    def on_object(self, *, obj, **kwargs) -> None:  # griffe >= 1.13
        self._fix(obj)

    def on_instance(self, *, obj, **kwargs) -> None:  # older griffe
        self._fix(obj)

    @staticmethod
    def _fix(obj) -> None:
        ds = getattr(obj, "docstring", None)
        if ds is not None and ds.value:
            ds.value = to_markdown(ds.value)
