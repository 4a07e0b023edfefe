"""``kvledger serve``'s defaults by the names the admission line (``admission/line.py``) and
the front door (``frontend/door.py``) read them: each is ``ServeConfig``'s own default
(``serve_config.py``, the one declaration), never a second copy of its value."""

from __future__ import annotations

from kvledger.engine.serve_config import ServeConfig

MAX_QUEUE_LEN = ServeConfig.max_queue_len  # requests that may wait in line for their KV
TENANT_FAIRNESS = ServeConfig.tenant_fairness  # the line takes turns between tenants
