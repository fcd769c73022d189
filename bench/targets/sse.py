"""Server-sent events: the ``data`` payloads of an event stream, line by line."""

from __future__ import annotations

from typing import AsyncIterator


async def sse_data(lines: AsyncIterator[str]) -> AsyncIterator[str]:
    """Yield the data of each event in ``lines`` (without line endings).

    An event ends at a blank line; its ``data:`` lines are joined with newlines (one
    optional space after the colon is dropped); comments (``:``) and other fields are
    skipped. A final event without its blank line is still yielded.
    """
    data: list[str] = []
    async for line in lines:
        line = line.rstrip("\r\n")
        if not line:
            if data:
                yield "\n".join(data)
                data = []
            continue
        if line.startswith(":"):
            continue
        name, _, value = line.partition(":")
        if name == "data":
            data.append(value[1:] if value.startswith(" ") else value)
    if data:
        yield "\n".join(data)
