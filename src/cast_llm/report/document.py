"""A tiny document model rendered to Markdown and to self-contained HTML (PNGs embedded as base64).

The report is built once as a list of blocks and rendered twice, so the two formats cannot drift apart.
Inline markup understood in text: ```code``` and ``**bold**`` (the subset both formats share).
"""

from __future__ import annotations

import base64
import html
import re
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Heading:
    level: int
    text: str


@dataclass
class Para:
    text: str


@dataclass
class Table:
    header: list[str]
    rows: list[list[str]]
    align: list[str] = field(default_factory=list)  # "l" or "r" per column; default: first l, rest r


@dataclass
class Image:
    file: str  # relative to the report folder
    alt: str


Block = Heading | Para | Table | Image


def _cell_md(s: str) -> str:
    return str(s).replace("|", "\\|").replace("\n", " ")


def to_markdown(blocks: list[Block]) -> str:
    out: list[str] = []
    for b in blocks:
        if isinstance(b, Heading):
            out += ["#" * b.level + " " + b.text, ""]
        elif isinstance(b, Para):
            out += [b.text, ""]
        elif isinstance(b, Table):
            align = b.align or ["l"] + ["r"] * (len(b.header) - 1)
            out.append("| " + " | ".join(_cell_md(h) for h in b.header) + " |")
            out.append("|" + "|".join("---:" if a == "r" else "---" for a in align) + "|")
            out += ["| " + " | ".join(_cell_md(c) for c in row) + " |" for row in b.rows]
            out.append("")
        elif isinstance(b, Image):
            out += [f"![{b.alt}]({b.file})", ""]
    return "\n".join(out).rstrip() + "\n"


def _inline_html(text: str) -> str:
    s = html.escape(text, quote=False)
    s = re.sub(r"`([^`]+)`", r"<code>\1</code>", s)
    return re.sub(r"\*\*([^*]+)\*\*", r"<strong>\1</strong>", s)


_CSS = """
body { font-family: -apple-system, 'Segoe UI', Helvetica, Arial, sans-serif; max-width: 1240px; margin: 2em auto;
       padding: 0 1em; color: #222; line-height: 1.45; }
h1 { border-bottom: 2px solid #ddd; padding-bottom: .2em; } h2 { border-bottom: 1px solid #eee; margin-top: 1.6em; }
table { border-collapse: collapse; margin: .6em 0 1.2em; font-size: 0.92em; }
th, td { border: 1px solid #ccc; padding: .25em .6em; } th { background: #f4f4f4; }
td.r, th.r { text-align: right; } code { background: #f3f3f3; padding: 0 .2em; border-radius: 3px; }
img { max-width: 100%; border: 1px solid #eee; margin: .4em 0 1em; }
"""


def to_html(blocks: list[Block], folder: Path, title: str) -> str:
    """HTML with every image read from ``folder`` and embedded, so the file stands alone."""
    body: list[str] = []
    for b in blocks:
        if isinstance(b, Heading):
            body.append(f"<h{b.level}>{_inline_html(b.text)}</h{b.level}>")
        elif isinstance(b, Para):
            body.append(f"<p>{_inline_html(b.text)}</p>")
        elif isinstance(b, Table):
            align = b.align or ["l"] + ["r"] * (len(b.header) - 1)
            head = "".join(f'<th class="{a}">{_inline_html(h)}</th>' for h, a in zip(b.header, align))
            rows = "".join("<tr>" + "".join(f'<td class="{a}">{_inline_html(str(c))}</td>' for c, a in zip(row, align))
                           + "</tr>" for row in b.rows)
            body.append(f"<table><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>")
        elif isinstance(b, Image):
            data = base64.b64encode((Path(folder) / b.file).read_bytes()).decode()
            body.append(f'<img alt="{html.escape(b.alt)}" src="data:image/png;base64,{data}">')
    return (f"<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>{html.escape(title)}</title>"
            f"<style>{_CSS}</style></head>\n<body>\n" + "\n".join(body) + "\n</body></html>\n")
