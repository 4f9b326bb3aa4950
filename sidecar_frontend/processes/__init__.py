"""``sidecar-frontend --processes N``: N whole frontends serving one port, under one parent.

Each process is a frontend as one process is (its own discovery, worker connections, KV cache
streams and routing view, admission), listening on its own socket of the port (SO_REUSEPORT;
the kernel spreads new connections over them), so the frontend's Python work spreads over N
cores. The parent binds the sockets, starts and restarts the processes, merges their metrics
into one ``/metrics`` and stops them all on SIGTERM (``parent.py``); the decisions it takes are
``policy.py``; the merge is ``exposition.py``; what it hands a process and hears back is
``spec.py``; a process's own entry is ``child.py``. Admission: each process admits against
its share of every worker's running limit (sidecar_frontend/admission/capacity.py).
"""
