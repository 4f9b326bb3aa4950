"""What a ``sidecar.v1`` request's KV-cache block keys depend on (pure: reads the message only).

The frontend computes a request's keys to route it; the sidecar computes the same keys to
announce the blocks it is about to prefill (``KvCacheDelta.announced_keys``). Both read the
adapter and the salt here, so the two agree on every key.
"""

from __future__ import annotations

from sidecar_common.api import sidecar_pb2

__all__ = ["cacheable", "key_namespace"]


def key_namespace(request: sidecar_pb2.PreprocessedRequest) -> tuple[str | None, str | None]:
    """The LoRA adapter name and the cache salt (``routing.cache_namespace``: vLLM's
    ``cache_salt``) of ``request``; empty counts as absent."""
    routing = request.routing
    lora = routing.lora_name if routing.HasField("lora_name") and routing.lora_name else None
    salt = (
        routing.cache_namespace if routing.HasField("cache_namespace") and routing.cache_namespace else None
    )
    return lora, salt


def cacheable(request: sidecar_pb2.PreprocessedRequest) -> bool:
    """Whether ``request``'s cache entries depend on its tokens alone (no images or other
    media)."""
    return not request.multi_modal_data
