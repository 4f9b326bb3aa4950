"""Admission (docs/frontend.md, "Admission"): one queue per model in front of routing, with
priority bands, fair share between tenants by tokens, a maximum wait and depth per band, and
refusals. The pure parts: how much a model's fleet can take now (``capacity``), the bands and
their fair queueing (``queue``), one model's admission over both (``state``), the per-tenant
rate limits (``rates``); the I/O around them is the gate (``gate``)."""
