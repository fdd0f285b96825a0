"""The engine hall: the sidecar's state and its rules, below the RPC layer. ``core.Engine``
coordinates the writer sessions (``sessions``), run slots (``runs``), the memory budget
(``memory``), the dedupe index (``dedupe``), trajectory owners (``owners``), the shard flusher
(``flusher``), the message / WAL-entry format (``message``) and the WAL bookkeeping (``journal``).
Imports the core, ``server/config.py``, ``metrics.py``, and the ``wal`` and ``security`` halls."""
