"""``cache.lower_tier=disk``: cached KV blocks in files, kept across restarts, checked as read."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
from pathlib import Path

import torch

from servelab.core.component import ComponentSpec
from servelab.core.errors import ConfigError
from servelab.core.kv_tier import KVTier, KVTierContext, TierEntry

log = logging.getLogger(__name__)

MAGIC = b"SLKV\x01"
HEADER_LENGTH = struct.Struct("<I")


class DiskTier(KVTier):
    """One file per block under ``<cache.lower_tier_path>/<fingerprint>/``: a header (the
    block's hash, parent hash, tokens, length and a BLAKE2b checksum of the content) and
    the content. Files are written under a temporary name and renamed, so a crash leaves
    no half-written block under a real name; a file whose header, length or checksum does
    not match is a miss (and deleted), never loaded. Blocks of another model or layout
    live in another folder and are left alone. ``stored`` reads only the headers, oldest
    file first, so a restarted engine serves what earlier runs saved.
    """

    def __init__(self, context: KVTierContext):
        super().__init__(context)
        if not context.location:
            raise ConfigError(["cache.lower_tier=disk keeps blocks in files: set cache.lower_tier_path to a folder"])
        self.folder = Path(context.location) / context.fingerprint
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            probe = self.folder / f".probe-{os.getpid()}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as error:
            raise ConfigError([f"cache.lower_tier_path={context.location!r} is not a writable folder: "
                               f"{error.strerror or error}"]) from error
        self.failed_saves = 0

    def _path(self, digest: int) -> Path:
        return self.folder / f"{digest & 0xFFFF_FFFF_FFFF_FFFF:016x}.kv"

    def stored(self) -> list[TierEntry]:
        """Every readable header, oldest file first."""
        found = []
        for path in self.folder.glob("*.kv"):
            try:
                with open(path, "rb") as file:
                    header = self._header(file)
                found.append((path.stat().st_mtime_ns, TierEntry(header["digest"], header["parent"],
                                                                 tuple(header["tokens"]))))
            except (OSError, ValueError, KeyError, TypeError):
                path.unlink(missing_ok=True)
        return [entry for _, entry in sorted(found, key=lambda pair: pair[0])]

    @staticmethod
    def _header(file) -> dict:
        """The header at the start of an open block file (ValueError when malformed)."""
        if file.read(len(MAGIC)) != MAGIC:
            raise ValueError("not a servelab KV block file")
        raw = file.read(HEADER_LENGTH.size)
        if len(raw) != HEADER_LENGTH.size:
            raise ValueError("truncated header")
        (length,) = HEADER_LENGTH.unpack(raw)
        header = json.loads(file.read(length))
        if not isinstance(header, dict):
            raise ValueError("malformed header")
        return header

    def save(self, entry: TierEntry, payload: torch.Tensor) -> bool:
        """Write the block to a temporary file and rename it into place."""
        content = payload.numpy().tobytes()
        header = json.dumps({"digest": entry.digest, "parent": entry.parent, "tokens": list(entry.tokens),
                             "length": len(content), "blake2b": hashlib.blake2b(content).hexdigest()}).encode()
        path = self._path(entry.digest)
        temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            with open(temporary, "wb") as file:
                file.write(MAGIC + HEADER_LENGTH.pack(len(header)) + header)
                file.write(content)
            os.replace(temporary, path)
            return True
        except OSError as error:
            temporary.unlink(missing_ok=True)
            self.failed_saves += 1
            if self.failed_saves == 1:
                log.warning("cache.lower_tier=disk could not write %s (%s); blocks it cannot keep are recomputed "
                            "when next needed", self.folder, error.strerror or error)
            return False

    def load(self, entry: TierEntry, out: torch.Tensor) -> bool:
        """Read the block back when its header names ``entry`` and its content is whole."""
        path = self._path(entry.digest)
        try:
            with open(path, "rb") as file:
                header = self._header(file)
                content = file.read()
            whole = (header.get("digest"), header.get("parent"), tuple(header.get("tokens", ()))) == (
                entry.digest, entry.parent, entry.tokens) and len(content) == header.get("length") == out.numel()
            if not whole or hashlib.blake2b(content).hexdigest() != header.get("blake2b"):
                raise ValueError("content does not match its header")
        except FileNotFoundError:
            return False
        except (OSError, ValueError, TypeError) as error:
            log.warning("cache.lower_tier=disk: %s is unreadable (%s); recomputing that block", path, error)
            return False
        out.copy_(torch.frombuffer(bytearray(content), dtype=torch.uint8))
        return True

    def discard(self, digest: int) -> None:
        """Delete the block's file."""
        self._path(digest).unlink(missing_ok=True)


SPEC = ComponentSpec("kv_tier", "disk", DiskTier, None,
                     "cached KV blocks in files below the host tier, kept across restarts")
