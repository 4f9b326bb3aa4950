"""The sidecar server, above the kernel (sidecar_common) and below the engine packages.

The engine protocol, dispatch, relay and coalesce, the Worker servicer, health and drain,
the daemon, metrics and the sidecar command line.
"""
