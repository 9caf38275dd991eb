"""What a report holds, before it is written as HTML or Markdown: sections of tables and figures.

Every number is formatted once, into a :class:`Table` cell; the summary holds no numbers of its
own, only :class:`Fact` references to cells (table, row, column), and both renderings read
the same cell through :meth:`Report.cell`. So a figure in the summary is the figure in the
section it comes from, by construction, and the HTML and the Markdown carry the same tables.
A long text that many rows share (a hardware figure's source) is written once, in a section's
numbered ``sources``, and the rows cite it by its number.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class Table:
    key: str                      # unique in the report: the HTML id and the summary's reference
    title: str
    columns: list[str]
    rows: list[list[str]]         # formatted cells; the first column labels the row
    note: str = ""
    cites: str = ""               # a column whose cells number entries of the section's sources

    def cites_at(self, index: int) -> bool:
        return bool(self.cites) and self.columns[index] == self.cites

    def cell(self, row: str, column: str) -> str:
        for cells in self.rows:
            if cells[0] == row:
                return cells[self.columns.index(column)]
        raise KeyError(f"table {self.key!r} has no row {row!r}")


@dataclass
class Figure:
    key: str
    title: str
    svg: str                      # an inline <svg> element
    caption: str = ""


@dataclass
class Section:
    key: str
    title: str
    paragraphs: list[str] = field(default_factory=list)
    tables: list[Table] = field(default_factory=list)
    figures: list[Figure] = field(default_factory=list)
    sources: list[str] = field(default_factory=list)    # numbered from 1 below the tables; cited by number


@dataclass(frozen=True)
class Fact:
    """One line of the summary: a label and the table cell that holds its figure."""
    label: str
    table: str
    row: str
    column: str


@dataclass
class Report:
    title: str
    subtitle: str
    summary: list[Fact]
    sections: list[Section]
    conclusion: str = ""

    def table(self, key: str) -> Table:
        for section in self.sections:
            for table in section.tables:
                if table.key == key:
                    return table
        raise KeyError(f"no table {key!r}")

    def cell(self, fact: Fact) -> str:
        return self.table(fact.table).cell(fact.row, fact.column)


def num(value, digits: int = 3) -> str:
    """A number with ``digits`` significant figures and thousands separators; '-' for none."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    value = float(value)
    if value == 0:
        return "0"
    magnitude = math.floor(math.log10(abs(value)))
    decimals = max(0, digits - 1 - magnitude)
    return f"{value:,.{decimals}f}"


def ms(seconds) -> str:
    return "-" if seconds is None or not math.isfinite(seconds) else f"{num(seconds * 1000)} ms"


def percent(share, digits: int = 1) -> str:
    return "-" if share is None or not math.isfinite(share) else f"{100 * share:.{digits}f}%"


def usd(value) -> str:
    return "-" if value is None or not math.isfinite(value) else f"${num(value)}"


def plus_minus(value, half_width, fmt=num) -> str:
    """``value ± half_width``; a zero half-width is no interval (every replication agreed, which few of
    them cannot show to be exact), so it is said in words, never printed as ``± 0``."""
    if half_width is None or not math.isfinite(half_width):
        return fmt(value)
    if half_width == 0:
        return f"{fmt(value)} (± n/a: no spread across seeds)"
    return f"{fmt(value)} ± {fmt(half_width)}"
