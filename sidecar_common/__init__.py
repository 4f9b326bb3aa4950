"""The kernel of llm-sidecars: what more than one program needs (the sidecar server and its
engine packages, the frontend, the testkit), defined once. It imports no other package of ours
(``tests/unit/test_layering.py`` checks; docs/architecture.md, "Packages and the arrows
between them").

What it holds: the one failure vocabulary (``errors``); addresses (``endpoint``: host:port,
engine endpoints, ZeroMQ tcp:// addresses, the wildcard rule) and listen checks (``ports``);
the worker roles (``disaggregation``); limits and message sizes; the wire shapes and codecs
both sides read (``structs``, ``prompt_logprobs``, ``bootstrap_handoff``, ``kv_keys``,
``kv_request``, ``kv_lag``, ``sampling_schema``); the flag library and the flags the programs
share; exit codes and the event loop (``programs``); retry and backoff; the channel pool and
unary calls (``pool``, ``rpc``); etcd registration and worker records; logs, TLS, tracing,
metrics buckets (``histograms``); and ``api/``, generated from ``protos/``.
"""
