{{/* Chart name, truncated to 63 characters (a DNS label). */}}
{{- define "trt-batcher.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Full name: release-chart unless the release name already holds the chart name. */}}
{{- define "trt-batcher.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "trt-batcher.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "trt-batcher.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "trt-batcher.selectorLabels" -}}
app.kubernetes.io/name: {{ include "trt-batcher.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "trt-batcher.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "trt-batcher.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The server's port: config.server.port (the server's own default, 8000, when unset). */}}
{{- define "trt-batcher.port" -}}
{{- $server := .Values.config.server | default dict }}
{{- if hasKey $server "port" }}{{ int $server.port }}{{ else }}8000{{ end }}
{{- end }}

{{/* config.server.shutdown_grace_s rounded up (the server's default, 30, when unset). */}}
{{- define "trt-batcher.shutdownGrace" -}}
{{- $server := .Values.config.server | default dict }}
{{- if hasKey $server "shutdown_grace_s" }}{{ int (ceil $server.shutdown_grace_s) }}{{ else }}30{{ end }}
{{- end }}

{{/* terminationGracePeriodSeconds: preStop sleep + drain + margin, or the value set (checked to exceed the first two). */}}
{{- define "trt-batcher.terminationGrace" -}}
{{- $needed := add (int .Values.preStopSleepSeconds) (int (include "trt-batcher.shutdownGrace" .)) }}
{{- if kindIs "invalid" .Values.terminationGracePeriodSeconds }}
{{- add $needed (int .Values.terminationMarginSeconds) }}
{{- else if le (int .Values.terminationGracePeriodSeconds) $needed }}
{{- fail (printf "terminationGracePeriodSeconds %d must exceed preStopSleepSeconds + config.server.shutdown_grace_s = %d" (int .Values.terminationGracePeriodSeconds) $needed) }}
{{- else }}
{{- int .Values.terminationGracePeriodSeconds }}
{{- end }}
{{- end }}

{{/* Label matchers of this release's series in Prometheus (KEDA query). */}}
{{- define "trt-batcher.promSelector" -}}
{{- if .Values.autoscaling.keda.selector }}
{{- .Values.autoscaling.keda.selector }}
{{- else }}
{{- printf "namespace=%q,service=%q" .Release.Namespace (include "trt-batcher.fullname" .) }}
{{- end }}
{{- end }}

{{- define "trt-batcher.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}
