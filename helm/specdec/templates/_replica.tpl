{{/* The Deployment of a drafter or verifier pool (dict root role) */}}
{{- define "specdec.replicaDeployment" -}}
{{- $root := .root }}
{{- $role := .role }}
{{- $cfg := index $root.Values $role }}
{{- $m := $root.Values.models }}
{{- include "specdec.checkGrace" (dict "cfg" $cfg "role" $role) }}
{{- if and (hasPrefix "cuda" $cfg.device) (eq $cfg.image.torchVariant "cpu") }}
{{- fail (printf "%s.device is %s but %s.image.torchVariant is cpu: a CPU build of torch cannot use the GPU; set %s.image.torchVariant to a CUDA build (cu128) or %s.device to cpu" $role $cfg.device $role $role $role) }}
{{- end }}
{{- $tp := int ($cfg.tensorParallel | default 1) }}
{{- $gpus := int $cfg.gpus }}
{{- if gt $tp 1 }}
{{- if ne $cfg.engine "dense" }}
{{- fail (printf "%s.tensorParallel %d needs %s.engine dense: the paged engine's pool is not sharded across ranks" $role $tp $role) }}
{{- end }}
{{- if eq $cfg.dtype "fastest" }}
{{- fail (printf "%s.tensorParallel %d needs a named %s.dtype (bfloat16, float32, ...), not fastest" $role $tp $role) }}
{{- end }}
{{- if hasPrefix "cuda" $cfg.device }}
{{- if and (gt $gpus 1) (ne $gpus $tp) }}
{{- fail (printf "%s.gpus is %d but %s.tensorParallel is %d: a tensor-parallel pod runs one rank per GPU" $role $gpus $role $tp) }}
{{- end }}
{{- $gpus = $tp }}
{{- end }}
{{- end }}
{{- $head := dig "head" "path" "" $cfg }}
{{- $headVolume := dig "head" "volume" dict $cfg }}
{{- if and $headVolume (not $head) }}
{{- fail (printf "%s.head.volume is set but %s.head.path is empty: name the head folder in that volume" $role $role) }}
{{- end }}
{{- if $head }}
{{- if eq $cfg.engine "llama.cpp" }}
{{- fail (printf "%s.head needs %s.engine dense or paged: a head runs on the torch engines" $role $role) }}
{{- end }}
{{- if $cfg.compile }}
{{- fail (printf "%s.head needs %s.compile false: compiled forwards are not built for heads" $role $role) }}
{{- end }}
{{- if eq $cfg.dtype "fastest" }}
{{- fail (printf "%s.head needs a named %s.dtype (float32, bfloat16, ...), not fastest" $role $role) }}
{{- end }}
{{- end }}
{{- if and (eq $m.source "pvc") (not $m.pvc.existingClaim) }}
{{- fail "models.source pvc needs models.pvc.existingClaim (a claim that holds the models); source hub or install downloads them (into each pod, or with models.storage claim into a claim a Job fills)" }}
{{- end }}
apiVersion: apps/v1
kind: Deployment
metadata:
  {{- include "specdec.metadata" . | nindent 2 }}
spec:
  {{- if not (include "specdec.autoscaled" (dict "root" $root "cfg" $cfg "role" $role)) }}
  replicas: {{ $cfg.replicas }}
  {{- end }}
  revisionHistoryLimit: 5
  selector:
    matchLabels:
      {{- include "specdec.selectorLabels" . | nindent 6 }}
  template:
    metadata:
      labels:
        {{- include "specdec.labels" . | nindent 8 }}
      {{- with $cfg.podAnnotations }}
      annotations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
    spec:
      automountServiceAccountToken: false
      enableServiceLinks: false
      terminationGracePeriodSeconds: {{ $cfg.terminationGracePeriodSeconds }}
      securityContext:
        {{- include "specdec.podSecurityContext" $root | nindent 8 }}
      {{- with $root.Values.imagePullSecrets }}
      imagePullSecrets:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $cfg.priorityClassName }}
      priorityClassName: {{ . }}
      {{- end }}
      {{- with $cfg.runtimeClassName }}
      runtimeClassName: {{ . }}
      {{- end }}
      {{- with $cfg.nodeSelector }}
      nodeSelector:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $cfg.tolerations }}
      tolerations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $cfg.affinity }}
      affinity:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $cfg.topologySpreadConstraints }}
      topologySpreadConstraints:
        {{- include "specdec.topologySpread" (dict "root" $root "role" $role "list" .) | nindent 8 }}
      {{- end }}
      {{- if include "specdec.modelsPerPod" $root }}
      initContainers:
        # Fetches this pod's model into its own volume (models.storage pod).
        - name: fetch-model
          image: {{ include "specdec.image" (dict "root" $root "image" $cfg.image "role" $role) }}
          imagePullPolicy: {{ include "specdec.pullPolicy" (dict "root" $root "image" $cfg.image "role" $role) }}
          command:
            {{- include "specdec.modelFetch" . | nindent 12 }}
          env:
            {{- include "specdec.fetchEnv" (dict "root" $root) | nindent 12 }}
          securityContext:
            {{- include "specdec.containerSecurityContext" $root | nindent 12 }}
          resources:
            {{- toYaml $cfg.resources | nindent 12 }}
          volumeMounts:
            - name: models
              mountPath: {{ $m.mountPath }}
            - name: tmp
              mountPath: /tmp
      {{- else if include "specdec.modelsJob" $root }}
      initContainers:
        # Waits for the models Job (job-models.yaml) to have filled the claim, at most
        # models.job.waitSeconds; the claim is Bound (this pod mounts it), so what is missing
        # is the Job's work.
        - name: wait-for-models
          image: {{ include "specdec.image" (dict "root" $root "image" $cfg.image "role" $role) }}
          imagePullPolicy: {{ include "specdec.pullPolicy" (dict "root" $root "image" $cfg.image "role" $role) }}
          command:
            - sh
            - -c
            - {{ include "specdec.waitScript" $root | quote }}
            - {{ include "specdec.modelsMarker" $root | quote }}
            - {{ $m.job.waitSeconds | quote }}
            - {{ include "specdec.modelsJobName" $root | quote }}
            - {{ include "specdec.modelsClaim" $root | quote }}
            - {{ $root.Release.Namespace | quote }}
          securityContext:
            {{- include "specdec.containerSecurityContext" $root | nindent 12 }}
          resources:
            {{- include "specdec.smallResources" $root | nindent 12 }}
          volumeMounts:
            - name: models
              mountPath: {{ $m.mountPath }}
              readOnly: true
      {{- end }}
      containers:
        - name: {{ $role }}
          image: {{ include "specdec.image" (dict "root" $root "image" $cfg.image "role" $role) }}
          imagePullPolicy: {{ include "specdec.pullPolicy" (dict "root" $root "image" $cfg.image "role" $role) }}
          command: [specdec]
          args:
            - serve
            - {{ $role }}
            {{- range $cfg.args }}
            - {{ . | quote }}
            {{- end }}
          ports:
            - name: grpc
              containerPort: {{ $cfg.port }}
              protocol: TCP
            {{- if $cfg.dataPort }}
            - name: data
              containerPort: {{ $cfg.dataPort }}
              protocol: TCP
            {{- end }}
            {{- if $cfg.metricsPort }}
            - name: metrics
              containerPort: {{ $cfg.metricsPort }}
              protocol: TCP
            {{- end }}
            {{- if include "specdec.servesTls" . }}
            - name: health
              containerPort: {{ $root.Values.tls.healthPort }}
              protocol: TCP
            {{- end }}
          env:
            - name: POD_NAME
              valueFrom:
                fieldRef:
                  fieldPath: metadata.name
            - name: SPECDEC_MODEL
              value: {{ include "specdec.modelPath" . | quote }}
            {{- if $head }}
            - name: SPECDEC_HEAD
              value: {{ printf "%s/%s" (ternary "/head" $m.mountPath (not (empty $headVolume))) $head | quote }}
            {{- end }}
            {{- with $cfg.model.ggufFile }}
            - name: SPECDEC_GGUF_FILE
              value: {{ . | quote }}
            {{- end }}
            - name: SPECDEC_DEVICE
              value: {{ $cfg.device | quote }}
            - name: SPECDEC_DTYPE
              value: {{ $cfg.dtype | quote }}
            - name: SPECDEC_ENGINE
              value: {{ $cfg.engine | default "dense" | quote }}
            {{- if gt $tp 1 }}
            - name: SPECDEC_TENSOR_PARALLEL
              value: {{ $tp | quote }}
            {{- end }}
            - name: SPECDEC_COMPILE
              value: {{ $cfg.compile | default false | quote }}
            - name: SPECDEC_HOST
              value: "0.0.0.0"
            - name: SPECDEC_PORT
              value: {{ $cfg.port | quote }}
            - name: SPECDEC_DATA_PORT
              value: {{ $cfg.dataPort | default -1 | quote }}
            - name: SPECDEC_REPLICA_ID
              value: "$(POD_NAME)"
            - name: SPECDEC_GRACE_SECONDS
              value: {{ $cfg.graceSeconds | quote }}
            {{- if $cfg.metricsPort }}
            - name: SPECDEC_METRICS_PORT
              value: {{ $cfg.metricsPort | quote }}
            {{- end }}
            - name: HOME
              value: /tmp
            {{- include "specdec.threadsEnv" (dict "cfg" $cfg) | nindent 12 }}
            {{- include "specdec.trustEnv" . | nindent 12 }}
            {{- with $cfg.settings }}
            {{- include "specdec.settingsEnv" . | nindent 12 }}
            {{- end }}
            {{- include "specdec.otelEnv" (dict "root" $root "role" $role) | nindent 12 }}
            {{- with $cfg.env }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
          {{- include "specdec.probes" (dict "port" (include "specdec.probePort" (dict "root" $root "role" $role "port" $cfg.port)) "cfg" $cfg) | nindent 10 }}
          securityContext:
            {{- include "specdec.containerSecurityContext" $root | nindent 12 }}
          resources:
            {{- $res := deepCopy $cfg.resources }}
            {{- if gt $gpus 0 }}
            {{- $limits := default dict $res.limits }}
            {{- $_ := set $limits $root.Values.gpuResource $gpus }}
            {{- $_ := set $res "limits" $limits }}
            {{- $requests := default dict $res.requests }}
            {{- $_ := set $requests $root.Values.gpuResource $gpus }}
            {{- $_ := set $res "requests" $requests }}
            {{- end }}
            {{- toYaml $res | nindent 12 }}
          volumeMounts:
            - name: tmp
              mountPath: /tmp
            - name: dshm
              mountPath: /dev/shm
            {{- include "specdec.trustMounts" . | nindent 12 }}
            - name: models
              mountPath: {{ $m.mountPath }}
              readOnly: true
            {{- if $headVolume }}
            - name: head
              mountPath: /head
              readOnly: true
            {{- end }}
      volumes:
        - name: tmp
          emptyDir: {}
        - name: dshm
          emptyDir:
            medium: Memory
            sizeLimit: {{ $cfg.shmSize }}
        {{- include "specdec.trustVolumes" . | nindent 8 }}
        {{- with $headVolume }}
        - name: head
          {{- toYaml . | nindent 10 }}
        {{- end }}
        {{- if eq $m.source "hostPath" }}
        - name: models
          hostPath:
            path: {{ $m.hostPath.path }}
            type: Directory
        {{- else if and (include "specdec.modelsPerPod" $root) (eq $m.pod.volume "ephemeral") }}
        - name: models
          ephemeral:
            volumeClaimTemplate:
              metadata:
                labels:
                  {{- include "specdec.selectorLabels" . | nindent 18 }}
              spec:
                accessModes: [ReadWriteOnce]
                {{- with $m.pod.storageClassName }}
                storageClassName: {{ . }}
                {{- end }}
                resources:
                  requests:
                    storage: {{ $m.pod.size }}
        {{- else if include "specdec.modelsPerPod" $root }}
        - name: models
          emptyDir:
            sizeLimit: {{ $m.pod.size }}
        {{- else }}
        - name: models
          persistentVolumeClaim:
            claimName: {{ include "specdec.modelsClaim" $root }}
            readOnly: true
        {{- end }}
{{- end }}
