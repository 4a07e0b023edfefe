"""Pure renderers: a ``ServiceSpec`` becomes the objects the cluster runs (render: the
Deployment, Service and pod, whose volumes, env and placement are pod's; render_group:
LeaderWorkerSet groups; autoscaling: HPA and KEDA; gateway: the inference gateway's
InferencePool), under what only a cluster admin may choose (policy). No I/O."""
