"""The SGLang sidecar: SGLang's native gRPC and HTTP APIs <-> the public sidecar API."""
