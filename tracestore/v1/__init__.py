"""Generated protobuf code for tracestore.v1 (see proto/)."""
