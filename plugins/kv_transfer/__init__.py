"""Built-in KV transfer connectors (``core/kv_transfer.py``)."""
