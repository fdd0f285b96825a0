"""The write-ahead log hall: the log (``log.WriteAheadLog``: O_DIRECT group commit, rotation,
replay), its files and entry format (``files``), its durable-bytes record (``mark``) and entries
streamed through its buffers (``stream``). The bottom floor beside ``security``: imports the core
and ``server/config.py`` only."""
