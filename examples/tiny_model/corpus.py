"""The training corpus of the tiny pair: Python sources of the standard library and of a
virtual environment's site-packages, deduplicated by file content, split by file.

Recipe (each step deterministic):

1. Roots: the standard library of the Python running the script
   (``sysconfig.get_paths()["stdlib"]``) and ``<venv>/lib/python3.*/site-packages`` of a
   fresh virtual environment holding servelab's dependencies
   (``python3 -m venv V && V/bin/pip install -e ".[test]"``).
2. Files: every ``*.py`` below a root, except files in a folder named in ``EXCLUDED_DIRS``
   (test suites, caches, stdlib data tables) and files named in ``EXCLUDED_FILES``
   (an editable install's machine-specific finder).
3. Held out: the top-level site-packages entries in ``TORCH_PACKAGES`` (``torch``,
   ``torchgen``, ``functorch``) never enter training or validation; they form the
   ``torch`` evaluation set.
4. Deduplicated by file content (SHA-256 of the bytes): of identical files the one with the
   smallest ``(root, relative path)`` is kept, so copies shared by two packages count once.
   Torch files that also occur in the corpus are dropped from the torch set.
5. Split by the file's key (``stdlib/<path>`` or ``site-packages/<path>``): a file is
   validation when the first 8 bytes of SHA-256(key), as an integer, modulo 1000 are below
   ``VAL_PER_MILLE``. Adding or removing other files never moves a file between splits.
"""

from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

EXCLUDED_DIRS = frozenset({
    "__pycache__", "test", "tests", "idle_test",      # caches and test suites
    "site-packages",                                    # inside stdlib: read as its own root
    "idlelib", "encodings", "pydoc_data",               # stdlib GUI, codec tables, topic strings
})
EXCLUDED_FILES = ("__editable__",)                      # prefixes of machine-specific files
TORCH_PACKAGES = frozenset({"torch", "torchgen", "functorch"})
VAL_PER_MILLE = 25


@dataclass(frozen=True)
class SourceFile:
    """One deduplicated ``.py`` file: ``key`` is ``<root name>/<relative path>``."""

    key: str
    path: Path
    size: int


@dataclass(frozen=True)
class Corpus:
    """Files of the three sets, each sorted by key."""

    train: tuple[SourceFile, ...]
    val: tuple[SourceFile, ...]
    torch: tuple[SourceFile, ...]
    duplicates_dropped: int

    def summary(self) -> dict:
        """File counts and byte totals of each set, as stored in ``training.json``."""
        out: dict = {}
        for name in ("train", "val", "torch"):
            files = getattr(self, name)
            out[f"{name}_files"] = len(files)
            out[f"{name}_bytes"] = sum(f.size for f in files)
        out["duplicate_files_dropped"] = self.duplicates_dropped
        return out


def site_packages(venv: Path) -> Path:
    """The ``site-packages`` folder of the virtual environment ``venv``."""
    found = sorted(Path(venv).glob("lib/python3*/site-packages"))
    if len(found) != 1:
        raise SystemExit(f"expected one lib/python3*/site-packages in {venv}, found {found}")
    return found[0]


def python_files(root: Path) -> list[Path]:
    """Sorted ``*.py`` files below ``root`` that the recipe keeps (step 2)."""
    return sorted(
        p for p in root.rglob("*.py")
        if p.is_file()
        and not EXCLUDED_DIRS.intersection(p.relative_to(root).parts[:-1])
        and not p.name.startswith(EXCLUDED_FILES)
    )


def is_validation(key: str) -> bool:
    """Whether the file ``key`` belongs to the validation split (step 5)."""
    digest = hashlib.sha256(key.encode()).digest()
    return int.from_bytes(digest[:8], "big") % 1000 < VAL_PER_MILLE


def build_corpus(venv: Path, stdlib: Path | None = None) -> Corpus:
    """Apply the recipe to the standard library and ``venv``'s site-packages."""
    stdlib = Path(stdlib or sysconfig.get_paths()["stdlib"])
    packages = site_packages(venv)
    candidates: list[tuple[str, Path, bool]] = []      # (key, path, is_torch)
    for root_name, root in (("stdlib", stdlib), ("site-packages", packages)):
        for path in python_files(root):
            rel = path.relative_to(root)
            is_torch = root_name == "site-packages" and (
                rel.parts[0] in TORCH_PACKAGES or rel.parts[0].split(".")[0] in TORCH_PACKAGES)
            candidates.append((f"{root_name}/{rel.as_posix()}", path, is_torch))
    seen: set[bytes] = set()
    kept: list[tuple[SourceFile, bool]] = []
    dropped = 0
    # Corpus files first, so a torch file equal to a corpus file is the one dropped.
    for key, path, is_torch in sorted(candidates, key=lambda c: (c[2], c[0])):
        data = path.read_bytes()
        digest = hashlib.sha256(data).digest()
        if digest in seen:
            dropped += 1
            continue
        seen.add(digest)
        kept.append((SourceFile(key, path, len(data)), is_torch))
    train = tuple(f for f, t in kept if not t and not is_validation(f.key))
    val = tuple(f for f, t in kept if not t and is_validation(f.key))
    torch_files = tuple(f for f, t in kept if t)
    return Corpus(train, val, torch_files, dropped)


def read_text(source: SourceFile) -> str:
    """The file's text; bytes that are not UTF-8 become U+FFFD."""
    return source.path.read_text(encoding="utf-8", errors="replace")
