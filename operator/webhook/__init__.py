"""The admission webhook: kopf's handler, plans and deadline (webhook), the verdict
(fit), the GPU nodes and which a pod may use (inventory), its HTTPS server's limits
(webhook_server) and the AdmissionReview contract (admission_review)."""
