"""Benchmark of KV-cache-aware routing (issue 20, "Benchmark"): ``python -m bench.kv_routing``.

* ``workloads``: the request streams (shared prefix, multi-turn), pure and seeded;
* ``oracle``: the best hit rate a workload's arrival order allows (pure);
* ``fleet``: testkit vLLM engines with a prefix cache, their sidecars and a frontend on
  loopback, and the client that replays a workload through the frontend;
* ``micro``: the routing decision's CPU cost and the index's memory, in process;
* ``__main__``: the command line, the profiles and the report (bench/README.md).
"""
