"""Shared by every sidecar: public API, engine transport, errors, servicer and daemon."""
