"""The policy registry: each --kv-evict-policy name and its Policy class (vase_sglang/policies.py).

Filled by policies.py (the built-ins) and register_policy (a VASE_KV_EVICT_PLUGINS module's);
read by config.py to validate settings. It lives apart so that config.py needs no import of
policies.py, which imports config.py (tests/test_layout.py forbids import cycles). The package
imports policies.py when it is imported, so the built-ins are always here."""

from __future__ import annotations

POLICIES: dict = {}  # name -> Policy subclass, in registration order
