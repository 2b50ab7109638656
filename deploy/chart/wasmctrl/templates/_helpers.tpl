{{- define "wasmctrl.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "wasmctrl.labels" -}}
app.kubernetes.io/name: {{ include "wasmctrl.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "wasmctrl.selectorLabels" -}}
app.kubernetes.io/name: {{ include "wasmctrl.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "wasmctrl.fullname" -}}
{{- if contains (include "wasmctrl.name" .) .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name (include "wasmctrl.name" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
