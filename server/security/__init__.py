"""The security hall: who may call (tokens and scopes: ``auth``; unix peers by uid/gid:
``peer_auth``), the unix socket's file (``unix_socket``) and TLS (``tls``). The bottom floor of
the sidecar beside ``wal``: imports the core and ``server/config.py`` only."""
