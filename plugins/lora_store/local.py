"""``lora.store=local`` (the default): every load names the adapter's folder (``lora_path``)."""

from __future__ import annotations

from servelab.core.component import ComponentSpec
from servelab.core.errors import InvalidRequestError
from servelab.core.lora_store import LoRAStore, StoredAdapter
from servelab.plugins.lora_store.peft_folder import read_peft_folder


class LocalStore(LoRAStore):
    """Reads the PEFT adapter folder each load gives, on this machine; serves nothing by
    name alone."""

    def fetch(self, name: str, path: str | None) -> StoredAdapter:
        """The folder ``path``; ``InvalidRequestError`` on ``lora_path`` when there is none."""
        if path is None:
            raise InvalidRequestError("lora_path", f"lora.store=local reads the adapter folder a load names: give "
                                                   f"{name!r} a lora_path (lora.store=directory serves names)")
        return read_peft_folder(path)

    def available(self) -> list[str]:
        """None: every load names its folder."""
        return []


SPEC = ComponentSpec("lora_store", "local", LocalStore, None, "PEFT adapter folders named by each load's lora_path")
