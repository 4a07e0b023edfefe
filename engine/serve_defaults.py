"""`kvledger serve`'s own defaults, THE one place they are written: the server's flags, its
options, the admission line, and the operator's CRD, spec and rendered pods read them here
(torch-free, importing nothing: the operator may read them)."""

from __future__ import annotations

PORT = 8000
SHUTDOWN_GRACE_S = 30  # on SIGTERM, how long in-flight requests may finish
MAX_QUEUE_LEN = 256  # requests that may wait in line for their KV reservations
TENANT_FAIRNESS = True  # the line takes turns between tenants (admission/order.py)
