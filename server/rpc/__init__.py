"""The RPC hall: the gRPC service (``service``: Write, Seal, Read, Stat, the sidecar's start and
stop), a Write stream (``write_stream``), Reads and their budget (``reads``, ``read_limits``),
the call and stream slots (``slots``), request parsing (``ingest``), shared-memory pools (``shm``)
and reflection. Built on the engine hall; only the commands (``cli.py``) import it."""
