"""What the operator reads and writes outside itself: the API server (kube), hub model
listings within a budget (hub_models), the threads blocking work runs on (workers), the
webhook's certificates (certs)."""
