"""Storage internals (private): how record chunks become durable Parquet shards on any fsspec URL
and how a plan's rows come back out of them.

Nothing here is imported by users by this path: they reach storage through ``tracestore.Store``
and ``tracestore.StoreReader`` (re-exported lazily from :mod:`.store` and :mod:`.reader`), the
sidecar and ``tracestore.client.GuidanceReader``. The rooms:

- :mod:`.fs` — fsspec access with timeouts and retries, and the one create-only publish;
- :mod:`.aio` — fsspec's event loop: the request-body errors of reset connections that nobody reads;
- :mod:`.local` — publishing on a local disk (create-only rename, writeback, ``ShardFile``);
- :mod:`.store` — the run/version/writer layout, runs and ``write_shard`` (one or two shard files);
- :mod:`.catalog` — what is committed: listing, the manifest and footer caches, retention, the
  stale-temp sweep;
- :mod:`.manifest` — the manifest format: chunk index, seals, links, JSON with its checksum;
- :mod:`.shard_write` — encoding a shard: sort, row groups, codecs, one Parquet writer;
- :mod:`.shard_read` — verified decoding of a shard's row groups, and full verification;
- :mod:`.arrow` — the Arrow schema of record chunks and the lossless chunk <-> Arrow conversion;
- :mod:`.reader` — microbatch-aligned, rank-sharded, verified reads of a plan's rows;
- :mod:`.read_out` — a read's output side: its result, stats and the copies into place;
- :mod:`.links` — a run's prefix links, resolved and checked against their sources on a read;
- :mod:`.rows` — ``SiteRows``, a read's rows of one site, and the buffer layout a read fills.
"""
