"""``kvledger serve``'s line: how many requests may wait for their KV reservations, for how
long, how the line takes turns between tenants, and where a gateway's tenant and objective
headers are believed from. One of the parts ``ServeConfig`` (``serve_config.py``) is made of.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvledger.engine.settings.declare import Crd, setting
from kvledger.engine.settings.kinds import COUNT, SECONDS_OR_ZERO, SWITCH, TEXT
from kvledger.engine.settings.serve_values import SERVER, WORDS


@dataclass(frozen=True)
class LineConfig:
    """The line's options, each declared once (``setting``); checked and used as part of
    ``ServeConfig``."""

    max_queue_wait_s: float | None = setting(  # None: a waiter waits as long as it takes
        None, "--max-queue-wait", SECONDS_OR_ZERO, group=SERVER,
        help="a request waits in line at most this long before its 429 (default: as long as "
             "it takes, or until its client leaves; 0: answer at once)",
        crd=Crd("", "how long a request may wait in line for its KV reservation before a 429 "
                    "(--max-queue-wait; 0: refused at once; not set: as long as it takes)",
                name="maxQueueWaitSeconds", schema={"type": "integer", "maximum": 600}))
    max_queue_len: int = setting(
        256, "--max-queue-len", COUNT, group=SERVER,
        help="requests that cannot be reserved now wait in one line of at most N (default "
             "%(default)s; nobody overtakes the first in its order, unless --backfill); a "
             "request that finds it full is a 429 queue_full (0: no line, answer at once)",
        crd=Crd("", "how many requests may wait in line for their KV reservations, taking "
                    "turns between tenants; one more is a 429 queue_full (--max-queue-len; 0: "
                    "refused at once; not set: %(default)s); what requestsWaiting autoscaling "
                    "counts", name="maxQueueLength", schema={"maximum": 100000}))
    max_queue_len_per_tenant: int | None = setting(  # None: Tenants' default (half, or all)
        None, "--max-queue-len-per-tenant", COUNT, group=SERVER,
        help="places in line one API key may hold; one more is a 429 tenant_queue_full for "
             "that key alone (default: half the line with two keys or more, else all of it)",
        crd=Crd("", "places in line one tenant (API key) may hold; one more is its own 429 "
                    "tenant_queue_full (--max-queue-len-per-tenant; not set: half the line "
                    "with two keys or more)", name="maxQueueLengthPerTenant",
                schema={"maximum": 100000}))
    tenant_fairness: bool = setting(
        True, "--tenant-fairness", SWITCH, group=SERVER,
        help="the line takes turns between API keys (weighted fair queuing), so one key's "
             "flood delays another key's request by about one admission (default on; "
             "--no-tenant-fairness: arrival order)",
        crd=Crd("", "the line takes turns between tenants (default %(default)s; false: arrival "
                    "order, --no-tenant-fairness)"))
    tenants_file: str | None = setting(  # the operator's: spec.tenantsSecretRef, mounted
        None, "--tenants-file", TEXT, metavar="PATH", group=SERVER,
        help="tenants as YAML (a mounted Secret): each a name (its metrics label), its API "
             "keys, its weight in the line, its places in line (maxQueued) and its default "
             "and most urgent priorities; its keys open /v1/* as --api-key's do "
             "(docs/serving.md, tenants)")
    tenant_header: str | None = setting(  # a gateway's header naming the tenant
        None, "--tenant-header", TEXT, metavar="NAME", group=SERVER,
        help="a header a gateway sets to name the request's tenant (e.g. x-kvledger-tenant), "
             "believed only from --tenant-header-from, once (given twice: a 400); a name the "
             "tenants file lacks runs at its least urgent tier")
    tenant_header_from: tuple[str, ...] = setting(
        (), "--tenant-header-from", WORDS, metavar="CIDR", group=SERVER,
        help="the peers whose --tenant-header is believed (e.g. the gateway's pod network)")
    objective_header: str | None = setting(  # the operator's, behind an InferencePool
        None, "--objective-header", TEXT, metavar="NAME", group=SERVER,
        help="a header a gateway sets to name the request's InferenceObjective (e.g. "
             "x-gateway-inference-objective), believed only from --tenant-header-from, "
             "once; its priority (from --objectives-file) is the request's when it asks "
             "none, under --scheduling-policy priority")
    objectives_file: str | None = setting(  # the operator's: the pool's objectives, mounted
        None, "--objectives-file", TEXT, metavar="PATH", group=SERVER,
        help="the objectives --objective-header may name, as YAML (objectives: a list of "
             "name and priority, higher more urgent, as InferenceObjective's), read again "
             "each second when it changes (docs/serving.md, objectives)")
    backfill: bool = setting(
        False, "--backfill", SWITCH, group=SERVER,
        help="plan the first 4 in line at their soonest starts, as the KV pool is projected "
             "(a token per step), and let one planned for now go first: it delays none of "
             "those plans (default off: strict FIFO)")
