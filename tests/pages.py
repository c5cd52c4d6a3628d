"""Reading the hand-written results pages: their table rows and the numbers printed in a cell,
each with the precision it was printed at. The results-page tests compare those numbers with the
files a study report wrote, so a number copied wrong by hand fails a test, not a reader."""

from __future__ import annotations

import re

NUMBER = re.compile(r"(<\s*)?[+\-−]?\d+(?:\.\d+)?(?:e[+\-−]?\d+)?")


def numbers(cell: str) -> list[tuple[float, float, bool]]:
    """(value, half a unit of its last printed digit, printed as an upper bound) per number."""
    out = []
    cell = re.sub(r"(?<=\d),(?=\d{3}(?!\d))", "", cell)  # 1,149 is one number, [1.0,2.0] two
    for m in NUMBER.finditer(cell.replace(",", " ")):
        text = m.group(0)
        bound = text.lstrip().startswith("<")
        text = text.lstrip("< ").replace("−", "-")
        mantissa, _, exponent = text.partition("e")  # 8.2e-6: half a unit is 0.05e-6
        decimals = len(mantissa.split(".")[1]) if "." in mantissa else 0
        half = 0.5 * 10.0 ** (int(exponent or 0) - decimals)
        out.append((float(text), half * (1 + 1e-9), bound))
    return out


def agree(cell: str, expected: list[float], where: str, slack: list[float] | None = None) -> None:
    """Every number printed in `cell` is its `expected` value rounded as printed. `slack` widens
    each tolerance, for a value that was itself read from a rounded report (half its unit)."""
    printed = numbers(cell)
    assert len(printed) == len(expected), f"{where}: {cell!r} shows {len(printed)} numbers, " \
                                          f"the source has {len(expected)}"
    slack = slack or [0.0] * len(expected)
    for (value, half, bound), want, more in zip(printed, expected, slack, strict=True):
        ok = want < value if bound else abs(value - want) <= half + more
        assert ok, f"{where}: {cell!r} prints {value}, the source says {want:.6g}"


def agree_rounded(cell: str, source: str, where: str) -> None:
    """`cell` prints the numbers of a report's `source` cell, maybe with fewer digits."""
    read = numbers(source)
    agree(cell, [v for v, _, _ in read], where, [h for _, h, _ in read])


def rows(text: str, first: str) -> list[list[str]]:
    """Cells of the table rows whose first cell starts with `first`."""
    out = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and cells[0].startswith(first):
            out.append(cells)
    return out
