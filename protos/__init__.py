"""Protobuf contracts. The generated *_pb2 modules are built by `make protos`, never committed."""
