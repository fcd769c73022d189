"""``lora.store=directory``: every PEFT adapter folder under ``lora.store_path``, by its
folder's name, as vLLM's filesystem resolver serves them: a load may give only
``lora_name``."""

from __future__ import annotations

import os

from servelab.core.component import ComponentSpec
from servelab.core.errors import ConfigError, InvalidRequestError
from servelab.core.lora_store import LoRAStore, LoRAStoreContext, StoredAdapter
from servelab.plugins.lora_store.peft_folder import is_peft_folder, read_peft_folder


class DirectoryStore(LoRAStore):
    """Adapters in the folders under one root (``location``), read when loaded, so folders
    added later are served too. A load with only a name reads ``<root>/<name>``; a
    ``lora_path`` is read relative to the root and must stay under it (a server that takes
    loads over HTTP reads no other folder)."""

    def __init__(self, context: LoRAStoreContext):
        super().__init__(context)
        if not context.location or not os.path.isdir(context.location):
            raise ConfigError([f"lora.store=directory serves the adapter folders under lora.store_path: set it to a "
                               f"folder (got {context.location!r})"])
        self.root = os.path.realpath(context.location)

    def fetch(self, name: str, path: str | None) -> StoredAdapter:
        """``<root>/<name>``, or ``path`` under the root; ``InvalidRequestError`` naming
        ``lora_name`` or ``lora_path`` when that is not an adapter folder under the root."""
        if path is not None:
            return read_peft_folder(self._under_root(path, "lora_path"))
        if not name or os.sep in name or name in (".", "..") or (os.altsep and os.altsep in name):
            raise InvalidRequestError("lora_name", f"{name!r} is not a folder name under lora.store_path")
        folder = self._under_root(name, "lora_name")
        if not is_peft_folder(folder):
            raise InvalidRequestError("lora_name", f"no adapter {name!r} under lora.store_path={self.root} "
                                                   f"(it serves: {', '.join(self.available()) or 'none'})")
        return read_peft_folder(folder)

    def _under_root(self, relative: str, field: str) -> str:
        """``relative`` joined to the root with links resolved; ``InvalidRequestError`` on
        ``field`` when that leaves the root."""
        folder = os.path.realpath(os.path.join(self.root, relative))
        if os.path.commonpath([folder, self.root]) != self.root:
            raise InvalidRequestError(field, f"{relative!r} is outside lora.store_path={self.root}")
        return folder

    def available(self) -> list[str]:
        """The root's folders (links resolved, staying under the root) that hold an
        ``adapter_config.json``."""
        found = []
        for entry in os.scandir(self.root):
            folder = os.path.realpath(entry.path)
            if os.path.commonpath([folder, self.root]) == self.root and is_peft_folder(folder):
                found.append(entry.name)
        return sorted(found)


SPEC = ComponentSpec("lora_store", "directory", DirectoryStore, None,
                     "every PEFT adapter folder under lora.store_path, by its name")
