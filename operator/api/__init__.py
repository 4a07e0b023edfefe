"""The InferenceService API: names and defaults (resource), the spec's rules with their
CEL and messages (spec_rules), the env names a resource may set (env_policy), quantities
and parallelism, the spec parsed once into a frozen ``ServiceSpec`` (spec), and the CRD
generated from them (crd, crd_schema, crd_pod). Pure: no I/O, no cluster."""
