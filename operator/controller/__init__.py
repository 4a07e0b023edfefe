"""The reconcile loop: kopf's handlers (handlers), the children applied and pruned
(children), and what the pods report copied into the resource's status (status)."""
