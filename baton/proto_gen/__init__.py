"""Generated protobuf/gRPC stubs for package baton.v1 (regenerate with `python -m baton.proto_gen.gen`)."""
