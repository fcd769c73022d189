"""Builds the two local lm-evaluation-harness tasks from Python sources the default model
never trained on (the ``torch`` package, held out of its corpus, docs/shipped_models.md).

- ``python_next_line.jsonl``: 200 multiple-choice items. ``context``: six consecutive
  non-blank lines of a file (none over 100 characters); ``choices``: the line that follows and three lines of
  similar length drawn from other files, each after a newline; ``answer``: the index of
  the true one.
- ``python_files.jsonl``: 24 documents, each the first lines of a file, at most 900
  characters (within one 512-token window of the default model's tokenizer).

Deterministic for a given torch version (files sorted, seed 0):

    python benchmarks/lm_eval_tasks/build_tasks.py --source $(python -c \\
        "import torch, os; print(os.path.dirname(torch.__file__))")
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

HERE = Path(__file__).parent
CONTEXT_LINES = 6
LINE_CHARS = (12, 80)
MAX_CONTEXT_LINE_CHARS = 100


def python_files(source: Path) -> list[Path]:
    """Non-test ``.py`` files of at least 40 lines, sorted."""
    files = []
    for path in sorted(source.rglob("*.py")):
        if "test" in path.parts or path.name.startswith("test_"):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if text.count("\n") >= 40:
            files.append(path)
    return files


def code_lines(path: Path) -> list[str]:
    """The file's non-blank lines, trailing spaces removed."""
    return [line.rstrip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def next_line_items(files: list[Path], count: int, rng: random.Random) -> list[dict]:
    """``count`` items, each from a different file."""
    pool = [line for path in rng.sample(files, min(len(files), 400)) for line in code_lines(path)
            if LINE_CHARS[0] <= len(line.strip()) <= LINE_CHARS[1]]
    items = []
    for path in rng.sample(files, len(files)):
        lines = code_lines(path)
        candidates = [i for i in range(CONTEXT_LINES, len(lines))
                      if LINE_CHARS[0] <= len(lines[i].strip()) <= LINE_CHARS[1]
                      and max(map(len, lines[i - CONTEXT_LINES:i])) <= MAX_CONTEXT_LINE_CHARS]
        if not candidates:
            continue
        at = rng.choice(candidates)
        truth = lines[at]
        distractors: list[str] = []
        while len(distractors) < 3:
            line = rng.choice(pool)
            if line.strip() != truth.strip() and line not in distractors:
                distractors.append(line)
        choices = distractors + [truth]
        rng.shuffle(choices)
        items.append({"context": "\n".join(lines[at - CONTEXT_LINES:at]),
                      "choices": ["\n" + c for c in choices], "answer": choices.index(truth)})
        if len(items) == count:
            break
    return items


def documents(files: list[Path], count: int, max_chars: int, rng: random.Random) -> list[dict]:
    """``count`` file openings of whole lines, at most ``max_chars`` characters each."""
    docs = []
    for path in rng.sample(files, count):
        text = ""
        for line in path.read_text(encoding="utf-8").splitlines(keepends=True):
            if len(text) + len(line) > max_chars:
                break
            text += line
        docs.append({"text": text})
    return docs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", type=Path, required=True, help="a folder of Python sources (torch's)")
    parser.add_argument("--items", type=int, default=200)
    parser.add_argument("--documents", type=int, default=24)
    parser.add_argument("--max-chars", type=int, default=900)
    args = parser.parse_args()
    rng = random.Random(0)
    files = python_files(args.source)
    outputs = {"python_next_line.jsonl": next_line_items(files, args.items, rng),
               "python_files.jsonl": documents(files, args.documents, args.max_chars, rng)}
    for name, rows in outputs.items():
        with open(HERE / name, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
        print(f"{name}: {len(rows)} rows from {len(files)} files")


if __name__ == "__main__":
    main()
