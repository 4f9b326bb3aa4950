"""The sidecar server, above the kernel (sidecar_common) and below the engine packages.

The engine protocol and the engine-client skeleton every engine package builds on, dispatch,
relay and coalesce, the Worker servicer, health and drain, the daemon, metrics and the sidecar
command line.
"""
