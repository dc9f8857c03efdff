{{/* Names and labels shared by every object of the chart. */}}

{{- define "kvsieve.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* <release>-kvsieve, or the release name when it already says kvsieve. */}}
{{- define "kvsieve.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "kvsieve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvsieve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "kvsieve.labels" -}}
{{ include "kvsieve.selectorLabels" . }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "kvsieve.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) -}}
{{- end -}}

{{/* The Secret holding `store-url`: the user's, or the chart's own. */}}
{{- define "kvsieve.storeSecret" -}}
{{- .Values.redis.existingSecret | default (printf "%s-store" (include "kvsieve.fullname" .)) -}}
{{- end -}}

{{- define "kvsieve.redisHost" -}}
{{- printf "%s-redis" (include "kvsieve.fullname" .) -}}
{{- end -}}

{{- define "kvsieve.apiKeysSecret" -}}
{{- printf "%s-api-keys" (include "kvsieve.fullname" . | trunc 54 | trimSuffix "-") -}}
{{- end -}}

{{/* Environment of every kvsieve process: the store URL from its Secret. */}}
{{- define "kvsieve.env" -}}
- name: KVSIEVE_STORE__URL
  valueFrom:
    secretKeyRef:
      name: {{ include "kvsieve.storeSecret" . }}
      key: store-url
{{- end -}}

{{/* kvsieve settings (service/config.py) passed as the Serve application's args. */}}
{{- define "kvsieve.serveArgs" -}}
{{- $engine := dict "model" .Values.model.path "device" "cuda" "dtype" .Values.engine.dtype "max_total_tokens" .Values.engine.maxTotalTokens -}}
{{- with .Values.model.servedName }}{{ $_ := set $engine "served_model_name" . }}{{ end -}}
{{- with .Values.engine.maxRunningRequests }}{{ $_ := set $engine "max_running_requests" . }}{{ end -}}
{{- with .Values.engine.contextLength }}{{ $_ := set $engine "context_length" . }}{{ end -}}
{{- $ray := dict "app_name" .Values.serve.appName "max_ongoing_requests" .Values.serve.maxOngoingRequests "num_gpus_per_replica" .Values.serve.numGpusPerReplica "num_cpus_per_replica" .Values.serve.numCpusPerReplica "address" "auto" -}}
{{- if .Values.serve.replicas -}}
{{- $_ := set $ray "replicas" .Values.serve.replicas -}}
{{- else -}}
{{- $a := .Values.serve.autoscaling -}}
{{- $_ := set $ray "autoscaling" (dict "min_replicas" $a.minReplicas "max_replicas" $a.maxReplicas "target_ongoing_requests" $a.targetOngoingRequests) -}}
{{- end -}}
{{- $args := dict "engine" $engine "ray" $ray
      "server" (dict "log_level" .Values.serve.logLevel "port" (int .Values.service.port) "host" "0.0.0.0")
      "limits" (dict "max_tokens" .Values.limits.maxTokens "request_timeout_s" .Values.limits.requestTimeoutS)
      "auth" (dict "enabled" .Values.auth.enabled "default_rate_per_s" .Values.auth.defaultRatePerS "default_burst" .Values.auth.defaultBurst) -}}
{{- toYaml $args -}}
{{- end -}}

{{- define "kvsieve.httpProbe" -}}
httpGet:
  path: {{ .path }}
  port: {{ .port }}
initialDelaySeconds: {{ .initialDelaySeconds }}
periodSeconds: {{ .periodSeconds }}
failureThreshold: {{ .failureThreshold }}
timeoutSeconds: 5
{{- end -}}
