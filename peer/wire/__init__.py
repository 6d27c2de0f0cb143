"""The wire contract: generated protobuf stubs (from proto/), tensor <-> TensorPayload with validation."""
