"""Generated protobuf/gRPC stubs (``make protos`` regenerates them from ``protos/``)."""
