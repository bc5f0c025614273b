{{/* A KEDA ScaledObject on a pool's queue (dict root role) */}}
{{- define "specdec.scaledObject" -}}
{{- $cfg := index .root.Values .role }}
{{- if and $cfg.enabled $cfg.keda.enabled (include "specdec.served" (dict "root" .root "api" "keda.sh/v1alpha1/ScaledObject")) }}
{{- $k := $cfg.keda }}
{{- $query := $k.prometheus.query }}
{{- if not $query }}
{{- if not $cfg.metricsPort }}
{{- fail (printf "%s.keda.enabled: the default query reads the %ss' own queue metrics, which need %s.metricsPort (or set %s.keda.prometheus.query)" .role .role .role .role) }}
{{- end }}
{{- $query = include "specdec.queueQuery" . }}
{{- end }}
# KEDA scales the {{ .role }} Deployment on a Prometheus query (needs KEDA's CRDs).
apiVersion: keda.sh/v1alpha1
kind: ScaledObject
metadata:
  {{- include "specdec.metadata" . | nindent 2 }}
spec:
  scaleTargetRef:
    apiVersion: apps/v1
    kind: Deployment
    name: {{ include "specdec.roleName" . }}
  minReplicaCount: {{ $k.minReplicas }}
  maxReplicaCount: {{ $k.maxReplicas }}
  pollingInterval: {{ $k.pollingInterval }}
  cooldownPeriod: {{ $k.cooldownPeriod }}
  triggers:
    - type: prometheus
      metricType: AverageValue
      metadata:
        serverAddress: {{ $k.prometheus.serverAddress | quote }}
        query: {{ $query | quote }}
        threshold: {{ $k.prometheus.threshold | toString | quote }}
{{- end }}
{{- end }}

{{/* The default KEDA query of a pool: its replicas' requests running and queued, summed
over the release's namespace (dict root role) */}}
{{- define "specdec.queueQuery" -}}
{{- $sel := printf "{namespace=%q}" .root.Release.Namespace }}
{{- printf "sum(specdec_%s_num_requests_running%s) + sum(specdec_%s_num_requests_waiting%s)" .role $sel .role $sel }}
{{- end }}

{{/* A HorizontalPodAutoscaler (dict root role); a pool driven by KEDA has KEDA's own */}}
{{- define "specdec.hpa" -}}
{{- $cfg := index .root.Values .role }}
{{- if and $cfg.enabled $cfg.autoscaling.enabled }}
{{- $a := $cfg.autoscaling }}
apiVersion: autoscaling/v2
kind: HorizontalPodAutoscaler
metadata:
  {{- include "specdec.metadata" . | nindent 2 }}
spec:
  scaleTargetRef:
    apiVersion: apps/v1
    kind: Deployment
    name: {{ include "specdec.roleName" . }}
  minReplicas: {{ $a.minReplicas }}
  maxReplicas: {{ $a.maxReplicas }}
  metrics:
    {{- if $a.metrics }}
    {{- toYaml $a.metrics | nindent 4 }}
    {{- else }}
    - type: Resource
      resource:
        name: cpu
        target:
          type: Utilization
          averageUtilization: {{ $a.targetCPUUtilizationPercentage }}
    {{- end }}
{{- end }}
{{- end }}

{{/* "true" when a role's replica count belongs to an autoscaler (dict root cfg role), else
empty; fails when KEDA and the HorizontalPodAutoscaler both claim it. KEDA counts only where
the cluster serves its ScaledObject (else the pool keeps its replicas) */}}
{{- define "specdec.autoscaled" -}}
{{- $keda := and (hasKey .cfg "keda") .cfg.keda.enabled }}
{{- if and $keda .cfg.autoscaling.enabled }}
{{- fail (printf "%s.keda.enabled and %s.autoscaling.enabled are both true: pick one (KEDA makes its own HorizontalPodAutoscaler; %s.autoscaling is the fallback for clusters without KEDA)" .role .role .role) }}
{{- end }}
{{- $served := include "specdec.served" (dict "root" .root "api" "keda.sh/v1alpha1/ScaledObject") }}
{{- if or (and $keda $served) .cfg.autoscaling.enabled }}true{{ end }}
{{- end }}

{{/* A prometheus-operator ServiceMonitor or PodMonitor of a role's metrics port (dict root role) */}}
{{- define "specdec.monitor" -}}
{{- $cfg := index .root.Values .role }}
{{- $mon := .root.Values.monitoring }}
{{- $api := printf "monitoring.coreos.com/v1/%s" $mon.kind }}
{{- if and $cfg.enabled $cfg.metricsPort (include "specdec.served" (dict "root" .root "api" $api)) }}
---
apiVersion: monitoring.coreos.com/v1
kind: {{ $mon.kind }}
metadata:
  name: {{ include "specdec.roleName" . }}
  namespace: {{ .root.Release.Namespace }}
  labels:
    {{- include "specdec.labels" . | nindent 4 }}
    {{- with $mon.labels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
spec:
  selector:
    matchLabels:
      {{- include "specdec.selectorLabels" . | nindent 6 }}
  namespaceSelector:
    matchNames: [{{ .root.Release.Namespace }}]
  {{ ternary "endpoints" "podMetricsEndpoints" (eq $mon.kind "ServiceMonitor") }}:
    - port: metrics
      path: /metrics
      interval: {{ $mon.interval }}
      scrapeTimeout: {{ $mon.scrapeTimeout }}
{{- end }}
{{- end }}
