{{/* Names */}}
{{- define "specdec.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "specdec.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 50 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 50 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 50 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* The object name of a role: fullname-role */}}
{{- define "specdec.roleName" -}}
{{- printf "%s-%s" (include "specdec.fullname" .root) .role }}
{{- end }}

{{- define "specdec.serviceAccountName" -}}
{{- default (printf "%s-gateway" (include "specdec.fullname" .)) .Values.serviceAccount.name }}
{{- end }}

{{/* Labels: specdec.labels (dict root role) */}}
{{- define "specdec.selectorLabels" -}}
app.kubernetes.io/name: {{ include "specdec.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .role }}
{{- end }}

{{- define "specdec.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version | replace "+" "_" }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/part-of: specdec
{{ include "specdec.selectorLabels" . }}
{{- with .root.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* metadata: name, namespace, labels (dict root role [name]) */}}
{{- define "specdec.metadata" -}}
name: {{ default (include "specdec.roleName" .) .name }}
namespace: {{ .root.Release.Namespace }}
labels:
  {{- include "specdec.labels" . | nindent 2 }}
{{- end }}

{{/* The image reference of an image block (dict root image [role]): a specdec role's empty
repository is images.prefix-ROLE, its empty tag images.tag (or appVersion), followed by
-torchVariant for the drafter and verifier: what `make images` tags. */}}
{{- define "specdec.image" -}}
{{- $repo := .image.repository }}
{{- if not $repo }}
{{- $repo = printf "%s-%s" .root.Values.images.prefix .role }}
{{- end }}
{{- if .image.digest -}}
{{ $repo }}@{{ .image.digest }}
{{- else if .image.tag -}}
{{ $repo }}:{{ .image.tag }}
{{- else -}}
{{ $repo }}:{{ .root.Values.images.tag | default .root.Chart.AppVersion }}{{ with .image.torchVariant }}-{{ . }}{{ end }}
{{- end }}
{{- end }}

{{/* The pull policy of a specdec image (dict root image role); a local build (localhost/)
with Always is refused: no registry serves it, so every pull would fail */}}
{{- define "specdec.pullPolicy" -}}
{{- $ref := include "specdec.image" . }}
{{- if and (hasPrefix "localhost/" $ref) (eq .image.pullPolicy "Always") }}
{{- fail (printf "%s.image.pullPolicy is Always but %s is a local build (localhost/) that no registry serves: load it onto the nodes (kind load docker-image %s) and set %s.image.pullPolicy to IfNotPresent, or push it and set images.prefix to your registry (the published images: ghcr.io/specdec/specdec, docs/deploy/images.md)" .role $ref $ref .role) }}
{{- end }}
{{- .image.pullPolicy }}
{{- end }}

{{/* Kinds that come from CRDs, each rendered only where the cluster serves its API
(.Capabilities.APIVersions): a YAML list of {value, api, enabled} */}}
{{- define "specdec.optionalKinds" -}}
{{- $v := .Values }}
{{- $monKind := $v.monitoring.kind }}
- value: drafter.keda.enabled
  api: keda.sh/v1alpha1/ScaledObject
  enabled: {{ and $v.drafter.enabled $v.drafter.keda.enabled }}
- value: verifier.keda.enabled
  api: keda.sh/v1alpha1/ScaledObject
  enabled: {{ and $v.verifier.enabled $v.verifier.keda.enabled }}
- value: gateway.grpcRoute.enabled
  api: gateway.networking.k8s.io/v1/GRPCRoute
  enabled: {{ and $v.gateway.enabled $v.gateway.grpcRoute.enabled }}
- value: gateway.httpRoute.enabled
  api: gateway.networking.k8s.io/v1/HTTPRoute
  enabled: {{ and $v.gateway.enabled $v.gateway.httpRoute.enabled }}
- value: monitoring.enabled
  api: {{ printf "monitoring.coreos.com/v1/%s" $monKind }}
  enabled: {{ $v.monitoring.enabled }}
- value: drafterAcceptanceAlert.enabled
  api: monitoring.coreos.com/v1/PrometheusRule
  enabled: {{ $v.drafterAcceptanceAlert.enabled }}
{{- end }}

{{/* "true" when the cluster serves an API (dict root api), e.g. keda.sh/v1alpha1/ScaledObject */}}
{{- define "specdec.served" -}}
{{- if .root.Capabilities.APIVersions.Has .api }}true{{ end }}
{{- end }}

{{/* --served-model-name: servedModelName, else the verifier's hub id (source hub) */}}
{{- define "specdec.servedModelName" -}}
{{- if .Values.servedModelName -}}
{{ .Values.servedModelName }}
{{- else if eq .Values.models.source "hub" -}}
{{ .Values.verifier.model.name }}
{{- end }}
{{- end }}

{{- define "specdec.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: {{ .Values.security.runAsUser }}
runAsGroup: {{ .Values.security.runAsGroup }}
fsGroup: {{ .Values.security.fsGroup }}
seccompProfile:
  type: RuntimeDefault
{{- end }}

{{- define "specdec.containerSecurityContext" -}}
runAsNonRoot: true
runAsUser: {{ .Values.security.runAsUser }}
runAsGroup: {{ .Values.security.runAsGroup }}
allowPrivilegeEscalation: false
privileged: false
readOnlyRootFilesystem: true
capabilities:
  drop: [ALL]
seccompProfile:
  type: RuntimeDefault
{{- end }}

{{/* The Redis URL the gateway uses when the built-in Redis runs */}}
{{- define "specdec.redisURL" -}}
redis://{{ include "specdec.roleName" (dict "root" . "role" "redis") }}.{{ .Release.Namespace }}.svc:{{ .Values.redis.port }}/0
{{- end }}

{{/* OTEL_* variables of a service (dict root role) */}}
{{- define "specdec.otelEnv" -}}
{{- $t := .root.Values.tracing }}
- name: OTEL_SERVICE_NAME
  value: {{ printf "specdec-%s" .role | quote }}
- name: OTEL_RESOURCE_ATTRIBUTES
  value: {{ printf "service.namespace=%s,service.instance.id=$(POD_NAME)" .root.Release.Namespace | quote }}
{{- if $t.enabled }}
- name: OTEL_SDK_DISABLED
  value: "false"
- name: OTEL_TRACES_EXPORTER
  value: otlp
- name: OTEL_EXPORTER_OTLP_PROTOCOL
  value: grpc
- name: OTEL_EXPORTER_OTLP_ENDPOINT
  value: {{ include "specdec.otlpEndpoint" .root | quote }}
- name: OTEL_TRACES_SAMPLER
  value: parentbased_traceidratio
- name: OTEL_TRACES_SAMPLER_ARG
  value: {{ $t.samplingRatio | toString | quote }}
{{- else }}
- name: OTEL_SDK_DISABLED
  value: "true"
{{- end }}
{{- end }}

{{- define "specdec.otlpEndpoint" -}}
{{- if .Values.tracing.otlpEndpoint -}}
{{ .Values.tracing.otlpEndpoint }}
{{- else if .Values.tracing.jaeger.enabled -}}
http://{{ include "specdec.roleName" (dict "root" . "role" "jaeger") }}.{{ .Release.Namespace }}.svc:4317
{{- else -}}
{{ fail "tracing.enabled needs tracing.otlpEndpoint or tracing.jaeger.enabled" }}
{{- end }}
{{- end }}

{{/* SPECDEC_* settings from a map, sorted */}}
{{- define "specdec.settingsEnv" -}}
{{- range $k, $v := . }}
{{- if not (hasPrefix "SPECDEC_" $k) }}
{{- fail (printf "settings key %q must start with SPECDEC_" $k) }}
{{- end }}
- name: {{ $k }}
  value: {{ $v | toString | quote }}
{{- end }}
{{- end }}

{{/* topologySpreadConstraints with this role's labelSelector filled in (dict root role list) */}}
{{- define "specdec.topologySpread" -}}
{{- $ctx := . }}
{{- $out := list }}
{{- range .list }}
{{- $c := deepCopy . }}
{{- if not $c.labelSelector }}
{{- $_ := set $c "labelSelector" (dict "matchLabels" (include "specdec.selectorLabels" $ctx | fromYaml)) }}
{{- end }}
{{- $out = append $out $c }}
{{- end }}
{{- toYaml $out }}
{{- end }}

{{/* The 'grpc' probes of a container (dict port cfg) */}}
{{- define "specdec.probes" -}}
startupProbe:
  grpc:
    port: {{ .port }}
  periodSeconds: {{ .cfg.startupProbe.periodSeconds }}
  failureThreshold: {{ .cfg.startupProbe.failureThreshold }}
  timeoutSeconds: 5
readinessProbe:
  grpc:
    port: {{ .port }}
  periodSeconds: {{ .cfg.readinessProbe.periodSeconds }}
  failureThreshold: {{ .cfg.readinessProbe.failureThreshold }}
  timeoutSeconds: 5
livenessProbe:
  grpc:
    port: {{ .port }}
  periodSeconds: {{ .cfg.livenessProbe.periodSeconds }}
  failureThreshold: {{ .cfg.livenessProbe.failureThreshold }}
  timeoutSeconds: 5
{{- end }}

{{- define "specdec.checkGrace" -}}
{{- if le (int .cfg.terminationGracePeriodSeconds) (int .cfg.graceSeconds) }}
{{- fail (printf "%s.terminationGracePeriodSeconds (%v) must exceed %s.graceSeconds (%v)" .role .cfg.terminationGracePeriodSeconds .role .cfg.graceSeconds) }}
{{- end }}
{{- end }}

{{/* The gateway's --drafter / --verifier value for discovery.mode (dict root role) */}}
{{- define "specdec.discoveryTarget" -}}
{{- $d := .root.Values.discovery }}
{{- $svc := include "specdec.roleName" . }}
{{- $port := (index .root.Values .role).port }}
{{- if eq $d.mode "k8s" -}}
k8s:{{ .root.Release.Namespace }}/{{ $svc }}:{{ $port }}
{{- else if eq $d.mode "dns" -}}
dns:{{ $svc }}.{{ .root.Release.Namespace }}.svc.{{ .root.Values.clusterDomain }}:{{ $port }}
{{- else -}}
{{- $list := ternary $d.staticDrafters $d.staticVerifiers (eq .role "drafter") }}
{{- if not $list }}
{{- fail (printf "discovery.mode static needs discovery.static%ss" (title .role)) }}
{{- end }}
{{- join "," $list }}
{{- end }}
{{- end }}

{{/* "true" when this role's port serves TLS (dict root role), else empty */}}
{{- define "specdec.servesTls" -}}
{{- if eq .role "gateway" }}{{ if .root.Values.tls.gateway.secretName }}true{{ end }}
{{- else if .root.Values.tls.replicas.secretName }}true{{ end }}
{{- end }}

{{/* The port the kubelet's gRPC probes use: the plaintext health port beside TLS (dict root role port) */}}
{{- define "specdec.probePort" -}}
{{- if include "specdec.servesTls" . }}{{ .root.Values.tls.healthPort }}{{ else }}{{ .port }}{{ end }}
{{- end }}

{{/* SPECDEC_THREADS from the CPU request (whole cores, at least 1), unless settings name it (dict cfg) */}}
{{- define "specdec.threadsEnv" -}}
{{- $cpu := toString (dig "requests" "cpu" "" (default dict .cfg.resources)) }}
{{- if and $cpu (not (hasKey (default dict .cfg.settings) "SPECDEC_THREADS")) }}
{{- $threads := 1 }}
{{- if hasSuffix "m" $cpu }}
{{- $threads = div (atoi (trimSuffix "m" $cpu)) 1000 }}
{{- else }}
{{- $threads = int (floor (float64 $cpu)) }}
{{- end }}
- name: SPECDEC_THREADS
  value: {{ max 1 $threads | quote }}
{{- end }}
{{- end }}

{{/* TLS and token settings of a role: environment entries naming mounted files (dict root role) */}}
{{- define "specdec.trustEnv" -}}
{{- $t := .root.Values.tls }}
{{- if eq .role "gateway" }}
{{- if $t.gateway.secretName }}
- name: SPECDEC_TLS_CERT
  value: /etc/specdec/tls/tls.crt
- name: SPECDEC_TLS_KEY
  value: /etc/specdec/tls/tls.key
{{- if $t.gateway.requireClientCert }}
- name: SPECDEC_TLS_CLIENT_CA
  value: /etc/specdec/tls/ca.crt
{{- end }}
{{- end }}
{{- if $t.replicas.secretName }}
- name: SPECDEC_REPLICA_CA
  value: /etc/specdec/replica-tls/ca.crt
- name: SPECDEC_REPLICA_CERT
  value: /etc/specdec/replica-tls/tls.crt
- name: SPECDEC_REPLICA_KEY
  value: /etc/specdec/replica-tls/tls.key
- name: SPECDEC_REPLICA_SERVER_NAME
  value: {{ required "tls.replicas.serverName is required with tls.replicas.secretName: the DNS name in the replicas' certificate" $t.replicas.serverName | quote }}
{{- end }}
{{- if .root.Values.auth.tokensSecretName }}
- name: SPECDEC_AUTH_TOKENS_FILE
  value: /etc/specdec/auth/tokens
{{- end }}
{{- else if $t.replicas.secretName }}
- name: SPECDEC_TLS_CERT
  value: /etc/specdec/tls/tls.crt
- name: SPECDEC_TLS_KEY
  value: /etc/specdec/tls/tls.key
- name: SPECDEC_TLS_CLIENT_CA
  value: /etc/specdec/tls/ca.crt
{{- end }}
{{- if include "specdec.servesTls" . }}
- name: SPECDEC_HEALTH_PORT
  value: {{ $t.healthPort | quote }}
{{- end }}
{{- end }}

{{/* The Secret mounts of a role (dict root role) */}}
{{- define "specdec.trustMounts" -}}
{{- $t := .root.Values.tls }}
{{- if include "specdec.servesTls" . }}
- name: tls
  mountPath: /etc/specdec/tls
  readOnly: true
{{- end }}
{{- if eq .role "gateway" }}
{{- if $t.replicas.secretName }}
- name: replica-tls
  mountPath: /etc/specdec/replica-tls
  readOnly: true
{{- end }}
{{- if .root.Values.auth.tokensSecretName }}
- name: auth
  mountPath: /etc/specdec/auth
  readOnly: true
{{- end }}
{{- end }}
{{- end }}

{{/* The Secret volumes of a role, readable by the pod's group only (0440) (dict root role) */}}
{{- define "specdec.trustVolumes" -}}
{{- $t := .root.Values.tls }}
{{- if include "specdec.servesTls" . }}
- name: tls
  secret:
    secretName: {{ ternary $t.gateway.secretName $t.replicas.secretName (eq .role "gateway") }}
    defaultMode: 288
{{- end }}
{{- if eq .role "gateway" }}
{{- if $t.replicas.secretName }}
- name: replica-tls
  secret:
    secretName: {{ default $t.replicas.secretName $t.replicas.clientSecretName }}
    defaultMode: 288
{{- end }}
{{- with .root.Values.auth.tokensSecretName }}
- name: auth
  secret:
    secretName: {{ . }}
    defaultMode: 288
    items:
      - key: {{ $.root.Values.auth.tokensSecretKey }}
        path: tokens
{{- end }}
{{- end }}
{{- end }}

{{/* The models claim: models.pvc.existingClaim, else the one the chart creates */}}
{{- define "specdec.modelsClaim" -}}
{{- .Values.models.pvc.existingClaim | default (include "specdec.roleName" (dict "root" . "role" "models")) }}
{{- end }}

{{/* The folder SPECDEC_MODEL names for a role (dict root role): `specdec models install`
keeps a model in NAME/model; a hub download is linked to MOUNT/ORG/NAME */}}
{{- define "specdec.modelPath" -}}
{{- $m := .root.Values.models }}
{{- $cfg := index .root.Values .role }}
{{- if eq $m.source "install" -}}
{{ printf "%s/%s/model" $m.mountPath $cfg.model.name }}
{{- else -}}
{{ printf "%s/%s" $m.mountPath $cfg.model.name }}
{{- end }}
{{- end }}

{{/* The download of a hub model (python3 -c SCRIPT REPO REVISION GGUF CACHE LINK): the
snapshot goes into the hub cache layout under CACHE (huggingface_hub's snapshot_download,
HF_TOKEN from the environment), and LINK, the folder SPECDEC_MODEL names, points at it. A
cached complete snapshot is not fetched again; a failure is one line naming the repo. */}}
{{- define "specdec.hubFetchScript" -}}
import sys
from pathlib import Path
repo, revision, gguf, cache, link = sys.argv[1:]
try:
    from huggingface_hub import snapshot_download
    path = snapshot_download(repo, revision=revision or None, cache_dir=cache, allow_patterns=[gguf] if gguf else None)
except Exception as e:  # one line naming the repo, not a traceback
    first = (str(e).strip().splitlines() or [""])[0]
    hint = " (gated or private: set models.hub.tokenSecret)" if any(c in first for c in ("401", "403")) else ""
    sys.exit(f"models: cannot download {repo}@{revision or 'main'} into {cache}: {type(e).__name__}: {first}{hint}")
link = Path(link)
link.parent.mkdir(parents=True, exist_ok=True)
tmp = link.with_name(link.name + ".tmp")
tmp.unlink(missing_ok=True)
tmp.symlink_to(path, target_is_directory=True)
tmp.replace(link)
print(f"models: {repo}@{revision or 'main'} is {path}, linked as {link}", flush=True)
{{- end }}

{{/* The command that fetches one role's model into the models volume (dict root role), a
YAML argv: the hub download, or `specdec models install NAME` */}}
{{- define "specdec.modelFetch" -}}
{{- $m := .root.Values.models }}
{{- $cfg := index .root.Values .role }}
{{- if eq $m.source "install" }}
{{- toYaml (concat (list "specdec" "models" "install" $cfg.model.name) $m.install.extraArgs) }}
{{- else }}
{{- toYaml (list "python3" "-c" (include "specdec.hubFetchScript" .root) $cfg.model.name (toString ($cfg.model.revision | default "")) ($cfg.model.ggufFile | default "") (printf "%s/hub" $m.mountPath) (include "specdec.modelPath" .)) }}
{{- end }}
{{- end }}

{{/* The commands of the models Job's init containers, one per download (a YAML list of
argv): a hub download per role, or one `specdec models install` for both names */}}
{{- define "specdec.modelsFetch" -}}
{{- $m := .Values.models }}
{{- $out := list }}
{{- $names := list }}
{{- range $role := list "drafter" "verifier" }}
{{- $cfg := index $.Values $role }}
{{- if $cfg.enabled }}
{{- if eq $m.source "install" }}
{{- $names = append $names $cfg.model.name }}
{{- else }}
{{- $out = append $out (include "specdec.modelFetch" (dict "root" $ "role" $role) | fromYamlArray) }}
{{- end }}
{{- end }}
{{- end }}
{{- if $names }}
{{- $out = append $out (concat (list "specdec" "models" "install") (uniq $names) $m.install.extraArgs) }}
{{- end }}
{{- toYaml $out }}
{{- end }}

{{/* "true" when a models Job fills a claim (source hub or install with storage claim) */}}
{{- define "specdec.modelsJob" -}}
{{- $m := .Values.models }}
{{- if and (has $m.source (list "install" "hub")) (eq $m.storage "claim") (or .Values.drafter.enabled .Values.verifier.enabled) }}true{{ end }}
{{- end }}

{{/* "true" when each replica pod fetches its own model (source hub or install, storage pod) */}}
{{- define "specdec.modelsPerPod" -}}
{{- $m := .Values.models }}
{{- if and (has $m.source (list "install" "hub")) (eq $m.storage "pod") }}true{{ end }}
{{- end }}

{{/* The models Job's name: it carries a hash of the pod template */}}
{{- define "specdec.modelsJobName" -}}
{{- printf "%s-models-%s" (include "specdec.fullname" .) (include "specdec.modelsJobPod" . | sha256sum | trunc 10) }}
{{- end }}

{{/* The environment of a model download: caches under /tmp, the hub token (dict root) */}}
{{- define "specdec.fetchEnv" -}}
{{- $m := .root.Values.models -}}
- name: SPECDEC_MODELS_DIR
  value: {{ $m.mountPath | quote }}
- name: HOME
  value: /tmp
- name: HF_HOME
  value: /tmp/huggingface
{{- if and (eq $m.source "hub") $m.hub.tokenSecret.name }}
- name: HF_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ $m.hub.tokenSecret.name }}
      key: {{ $m.hub.tokenSecret.key }}
{{- end }}
{{- end }}

{{/* The replicas' wait for the models Job (sh -c SCRIPT MARKER SECONDS JOB CLAIM NAMESPACE):
a line every 10 s, and after SECONDS one line naming the Job and the claim, then exit 1 */}}
{{- define "specdec.waitScript" -}}
waited=0; until [ -e "$0" ]; do if [ "$waited" -ge "$1" ]; then echo "models: not ready after $1 s: claim $3 is Bound (this pod mounts it) but the models Job $2 has not written $0; see kubectl -n $4 describe job $2 and kubectl -n $4 logs job/$2 --all-containers" >&2; exit 1; fi; echo "waiting for the models Job $2 to write $0 on claim $3 ($waited of $1 s)"; sleep 10; waited=$((waited + 10)); done
{{- end }}

{{/* What the Job fetches, hashed: the marker file's name changes with it */}}
{{- define "specdec.modelsHash" -}}
{{- include "specdec.modelsFetch" . | sha256sum | trunc 10 }}
{{- end }}

{{/* The file the models Job writes once everything is fetched */}}
{{- define "specdec.modelsMarker" -}}
{{- printf "%s/.specdec-ready-%s" .Values.models.mountPath (include "specdec.modelsHash" .) }}
{{- end }}

{{/* Requests and limits of a container that only waits or touches a file */}}
{{- define "specdec.smallResources" -}}
requests:
  cpu: 10m
  memory: 16Mi
limits:
  cpu: 100m
  memory: 64Mi
{{- end }}

{{/* An Ingress to one of the gateway Service's ports (dict root cfg port name) */}}
{{- define "specdec.gatewayIngress" -}}
apiVersion: networking.k8s.io/v1
kind: Ingress
metadata:
  {{- include "specdec.metadata" (dict "root" .root "role" "gateway" "name" .name) | nindent 2 }}
  {{- with .cfg.annotations }}
  annotations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
spec:
  {{- with .cfg.className }}
  ingressClassName: {{ . }}
  {{- end }}
  {{- if .cfg.tlsSecretName }}
  tls:
    - hosts: [{{ .cfg.host | quote }}]
      secretName: {{ .cfg.tlsSecretName }}
  {{- end }}
  rules:
    - host: {{ .cfg.host | quote }}
      http:
        paths:
          - path: /
            pathType: Prefix
            backend:
              service:
                name: {{ include "specdec.roleName" (dict "root" .root "role" "gateway") }}
                port:
                  name: {{ .port }}
{{- end }}

{{/* A Gateway API route to the gateway Service (dict root kind value cfg rules port) */}}
{{- define "specdec.gatewayRoute" -}}
{{- if not .cfg.parentRefs }}
{{- fail (printf "%s.enabled needs %s.parentRefs (the Gateway to attach to)" .value .value) }}
{{- end }}
{{- $backend := dict "name" (include "specdec.roleName" (dict "root" .root "role" "gateway")) "port" (int .port) }}
{{- $rules := list }}
{{- range .rules }}
{{- $rules = append $rules (merge (dict "backendRefs" (list $backend)) .) }}
{{- end }}
apiVersion: gateway.networking.k8s.io/v1
kind: {{ .kind }}
metadata:
  {{- include "specdec.metadata" (dict "root" .root "role" "gateway") | nindent 2 }}
spec:
  parentRefs:
    {{- toYaml .cfg.parentRefs | nindent 4 }}
  {{- with .cfg.hostnames }}
  hostnames:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  rules:
    {{- toYaml $rules | nindent 4 }}
{{- end }}
