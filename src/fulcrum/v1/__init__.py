"""Generated protobuf and gRPC code of the fulcrum.v1 API (``make proto``)."""
