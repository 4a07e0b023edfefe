{{- define "kvledger.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "kvledger.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "kvledger.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "kvledger.serviceAccountName" -}}
{{- default (include "kvledger.fullname" .) .Values.serviceAccount.name -}}
{{- end -}}

{{- define "kvledger.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* The least privilege the handlers use (operator/controller/handlers.py, operator/cluster/kube.py). */}}
{{- define "kvledger.rules" -}}
- apiGroups: [kvledger.dev]
  resources: [inferenceservices]
  verbs: [get, list, watch, patch]
- apiGroups: [kvledger.dev]
  resources: [inferenceservices/status]
  verbs: [get, patch]
- apiGroups: [apps]
  resources: [deployments]
  verbs: [get, create, patch, delete]
- apiGroups: [""]
  resources: [services]
  verbs: [get, create, patch, delete]
- apiGroups: [""]
  resources: [pods]
  verbs: [get, list, watch]
{{- /*
  Sleep mode (spec.engine.enableSleepMode, operator/render/pod.py): the ConfigMap NAME-sleep
  holding spec.sleep, and behind a gateway NAME-objectives, which the engines read (they go
  with their owner: no delete).
*/}}
- apiGroups: [""]
  resources: [configmaps]
  verbs: [get, create, patch]
{{- /*
  Multi-node services (spec.nodes > 1, operator/render/render_group.py): a LeaderWorkerSet (watched
  for its status), a NetworkPolicy fencing the group's ports (also the admin's
  networkPolicy.enabled one), and the group's key Secret, created once. No Secret is read:
  the key is never read back, and a hub model behind a token is sized in its pod, which gets
  the token through a secretKeyRef (the kubelet reads it, with the pod's rights).
*/}}
- apiGroups: [leaderworkerset.x-k8s.io]
  resources: [leaderworkersets]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [networking.k8s.io]
  resources: [networkpolicies]
  verbs: [get, create, patch, delete]
{{- /*
  Behind the Gateway API Inference Extension (spec.inferencePool, operator/render/gateway.py):
  the InferencePool of the service's serving pods, and the router's InferenceObjectives
  (read and watched: their priorities go into the ConfigMap NAME-objectives, above).
*/}}
- apiGroups: [inference.networking.k8s.io]
  resources: [inferencepools]
  verbs: [get, create, patch, delete]
- apiGroups: [inference.networking.x-k8s.io]
  resources: [inferenceobjectives]
  verbs: [list, watch]
- apiGroups: [""]
  resources: [secrets]
  verbs: [create]
- apiGroups: ["", events.k8s.io]
  resources: [events]
  verbs: [create]
{{- end -}}

{{/* The engine pods and Services the operator renders (operator/render/render.py labels()). */}}
{{- define "kvledger.engineSelector" -}}
matchLabels:
  app.kubernetes.io/managed-by: kvledger-operator
matchExpressions:
  - key: kvledger.dev/inferenceservice
    operator: Exists
{{- end -}}

{{/* The admission webhook (templates/webhook.yaml): its certificates' source, names. */}}
{{- define "kvledger.webhookCerts" -}}
{{- if eq .Values.webhook.certificates "auto" -}}
{{- if .Capabilities.APIVersions.Has "cert-manager.io/v1" -}}cert-manager{{- else -}}self-signed{{- end -}}
{{- else -}}
{{- .Values.webhook.certificates -}}
{{- end -}}
{{- end -}}

{{- define "kvledger.webhookService" -}}
{{- printf "%s-webhook" (include "kvledger.fullname" . | trunc 55 | trimSuffix "-") -}}
{{- end -}}

{{- define "kvledger.webhookSecret" -}}
{{- printf "%s-webhook-tls" (include "kvledger.fullname" . | trunc 51 | trimSuffix "-") -}}
{{- end -}}

{{- define "kvledger.webhookCertDir" -}}/etc/kvledger/webhook{{- end -}}
