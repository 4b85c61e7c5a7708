"""The append-only JSON-lines files a run reads back (metrics.jsonl, goodput.jsonl), read so that a line a kill
or a full disk cut short never stops a resume.

A write cut off mid-line leaves a last line without its newline; the next
append would glue its record onto it, and both would be lost. `read_records`
leaves such a line out, and the writer of the file cuts it off before it
appends again (`cut=True`), saying so in one line.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from nestor.orchestrator.paths import shown


def _parsed(line: bytes) -> dict | None:
    """Returns the JSON object a line holds, or None for anything else (cut short, binary, not an object)."""
    try:
        record = json.loads(line.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def read_records(path: Path, log=print, cut: bool = False) -> list[dict]:
    """Returns the JSON objects of the lines of `path` ([] when it does not exist), leaving out the lines
    that are not one (a last line cut short, bytes a full disk left).

    Says in one `log` line what it left out. With `cut` (the file's writer,
    before it appends), a last line without its newline is cut off the file.
    """
    if not path.is_file():
        return []
    data = path.read_bytes()
    lines = data.split(b"\n")
    tail = lines.pop()  # b"" when the file ends with a newline
    records, skipped = [], []
    for number, line in enumerate(lines, 1):
        if line.strip():
            if (record := _parsed(line)) is None:
                skipped.append(number)
            else:
                records.append(record)
    said = []
    if skipped:
        said.append(f"left out line{'s' if len(skipped) > 1 else ''} {', '.join(map(str, skipped[:5]))}"
                    f"{', ...' if len(skipped) > 5 else ''} (not a JSON record)")
    if tail:
        said.append(f"{'cut off' if cut else 'left out'} its last line of {len(tail)} bytes, which a write that "
                    "stopped (a kill, a full disk) cut short")
        if cut:
            os.truncate(path, len(data) - len(tail))
    if said:
        log(f"warning: {shown(path)}: {'; '.join(said)}")
    return records
