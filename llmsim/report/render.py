"""A :class:`~llmsim.report.document.Report` written as one self-contained HTML page and as Markdown.

Both come from Jinja2 templates (``templates/``) over the same Report object, so they hold the
same tables cell for cell. The HTML inlines its styles and its SVG figures and loads nothing:
it opens without a network and runs no script. The Markdown embeds each figure as a base64
SVG data URI.
"""
from __future__ import annotations

import base64

import jinja2

from llmsim.report.document import Report

_ENV = jinja2.Environment(loader=jinja2.PackageLoader("llmsim.report", "templates"),
                          autoescape=jinja2.select_autoescape(["html.j2"]), trim_blocks=True, lstrip_blocks=True,
                          undefined=jinja2.StrictUndefined)


def _md_cell(text) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _data_uri(svg: str) -> str:
    return "data:image/svg+xml;base64," + base64.b64encode(svg.encode()).decode()


_ENV.filters["md_cell"] = _md_cell
_ENV.filters["data_uri"] = _data_uri


def to_html(report: Report) -> str:
    return _ENV.get_template("report.html.j2").render(report=report)


def to_markdown(report: Report) -> str:
    return _ENV.get_template("report.md.j2").render(report=report)
