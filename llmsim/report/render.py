"""A :class:`~llmsim.report.document.Report` written as one self-contained HTML page and as Markdown.

Both come from Jinja2 templates (``templates/``) over the same Report object, so they hold the
same tables cell for cell. The HTML inlines its styles and its SVG figures and loads nothing:
it opens without a network and runs no script. The Markdown embeds each figure as a base64
SVG data URI.

Every text reaches the page escaped, whatever it holds (a scenario's name, a class name, a
trace's file name, a profile's notes): in the HTML by Jinja's autoescape, in the Markdown by
:func:`markdown_text`, applied to every expression of its template (``finalize``), so a
template cannot forget it. A Markdown viewer renders inline HTML, links and images; escaped,
they are shown as the characters they are.
"""
from __future__ import annotations

import base64
import re

import jinja2

from llmsim.report.document import Report

# Punctuation with a meaning anywhere in a line (code, emphasis, links and images, a table's cells,
# strikethrough), and what starts a block only at the start of one (a heading, a list, a rule).
_INLINE = re.compile(r"([\\`*_\[\]|~])")
_BLOCK_START = re.compile(r"^(\s*)(?:([#+=-])|(\d{1,9})([.)])(?=\s|$))")
_ENTITIES = {"&": "&amp;", "<": "&lt;", ">": "&gt;"}


class _Markdown(str):
    """Text that is Markdown already (a data URI made here): not escaped again."""


def markdown_text(text) -> str:
    """``text`` as Markdown that shows exactly these characters on one line: '&', '<' and '>' as
    entities (no tag, entity or autolink survives), the punctuation that has a meaning in Markdown
    where it stands backslash-escaped, line breaks as spaces."""
    if isinstance(text, _Markdown):
        return text
    text = " ".join(str(text).splitlines())
    text = "".join(_ENTITIES.get(char, char) for char in text)
    text = _INLINE.sub(r"\\\1", text)
    return _BLOCK_START.sub(lambda m: m[1] + (f"\\{m[2]}" if m[2] else f"{m[3]}\\{m[4]}"), text, count=1)


def _data_uri(svg: str) -> _Markdown:
    return _Markdown("data:image/svg+xml;base64," + base64.b64encode(svg.encode()).decode())


_LOADER = jinja2.PackageLoader("llmsim.report", "templates")
_HTML = jinja2.Environment(loader=_LOADER, autoescape=True, trim_blocks=True, lstrip_blocks=True,
                           undefined=jinja2.StrictUndefined)
_MARKDOWN = jinja2.Environment(loader=_LOADER, autoescape=False, finalize=markdown_text, trim_blocks=True,
                               lstrip_blocks=True, undefined=jinja2.StrictUndefined)
_MARKDOWN.filters["data_uri"] = _data_uri


def to_html(report: Report) -> str:
    return _HTML.get_template("report.html.j2").render(report=report)


def to_markdown(report: Report) -> str:
    return _MARKDOWN.get_template("report.md.j2").render(report=report)
