"""A generated part of a Markdown file: the text between two marker comments, which a docs generator rewrites or
checks (tools/gen_test_catalogue.py: docs/testing.md's catalogue; tools/gen_module_map.py: docs/architecture.md's
module map)."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable


class SectionError(Exception):
    """Why a generated section cannot be written (a generator's own refusals subclass it)."""


def replaced(text: str, begin: str, end: str, section: str, where: str) -> str:
    """``text`` with everything from the ``begin`` marker to the ``end`` marker replaced by ``section`` (which holds
    both markers)."""
    start, stop = text.find(begin), text.find(end)
    if start < 0 or stop < start:
        raise SectionError(f"{where} lacks the marker comments: {begin} ... {end}")
    return text[:start] + section + text[stop + len(end) :]


def write_or_check(repo: str, output: str, updated: Callable[[str], str], what: str, generator: str, argv) -> int:
    """Rewrite ``output`` (relative to ``repo``) as ``updated(its text)``; with ``--check`` in ``argv``, exit status
    1 if that differs from the file instead. ``what`` names the section in the lines printed."""
    path = os.path.join(repo, output)
    with open(path, encoding="utf-8") as f:
        current = f.read()
    try:
        text = updated(current)
    except SectionError as e:
        print(f"{generator}: error: {e}", file=sys.stderr)
        return 1
    if "--check" in argv:
        if text != current:
            print(f"{output}'s {what} is stale: run python {generator}", file=sys.stderr)
            return 1
        print(f"{output}'s {what} is up to date")
        return 0
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    print(f"wrote {output}'s {what}")
    return 0
