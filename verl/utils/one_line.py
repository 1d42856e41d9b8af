"""Error text as one line of bounded length: a refusal is one line a script's log keeps whole."""

from __future__ import annotations

from typing import Any


def one_line(text: Any, limit: int | None = None) -> str:
    """``text`` on one line: a heading ending in ':' followed by its list becomes 'heading item; item', other lines
    are joined by '; '; cut to ``limit`` characters when given."""
    lines = [" ".join(line.split()).removeprefix("- ") for line in str(text).splitlines() if line.strip()]
    joined = " ".join(lines[:1] + ["; ".join(lines[1:])]).strip() if lines and lines[0].endswith(":") else "; ".join(lines)
    return joined if limit is None or len(joined) <= limit else f"{joined[: limit - 3]}..."


def shown(value: Any, limit: int = 200) -> str:
    """``value`` as echoed in a one-line message: its repr, at most ``limit`` characters and then its length."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"
