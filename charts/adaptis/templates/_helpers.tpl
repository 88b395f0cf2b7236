{{/*
Names and labels shared by every template of the AdaPtis chart.
*/}}

{{- define "adaptis.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* <release>-adaptis, or the release name alone when it already says adaptis. */}}
{{- define "adaptis.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 52 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 52 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 52 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "adaptis.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "adaptis.selectorLabels" -}}
app.kubernetes.io/name: {{ include "adaptis.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "adaptis.labels" -}}
helm.sh/chart: {{ include "adaptis.chart" . }}
{{ include "adaptis.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/part-of: adaptis
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "adaptis.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "adaptis.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "adaptis.workerServiceAccountName" -}}
{{- default (printf "%s-worker" (include "adaptis.fullname" .)) .Values.worker.serviceAccount.name }}
{{- end }}

{{- define "adaptis.image" -}}
{{- $tag := default .Chart.AppVersion .Values.image.tag }}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository $tag }}
{{- end }}
{{- end }}

{{- define "adaptis.workerImage" -}}
{{- printf "%s:%s" .Values.worker.image.repository (default .Chart.AppVersion .Values.worker.image.tag) }}
{{- end }}

{{/* The namespaces that hold worker pods: the watched ones, or the release's when all. */}}
{{- define "adaptis.workerNamespaces" -}}
{{- $list := list .Release.Namespace }}
{{- range .Values.operator.watchNamespaces }}
{{- $list = append $list . }}
{{- end }}
{{- $list | uniq | toJson }}
{{- end }}

{{/* Selector of the pods the operator creates for AdaPtisJobs (labels set by the operator). */}}
{{- define "adaptis.workerSelectorLabels" -}}
app.kubernetes.io/managed-by: adaptis
{{- end }}
