"""The vLLM sidecar: vLLM's native gRPC VllmEngine <-> the public sidecar API."""
