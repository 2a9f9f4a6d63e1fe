{{- /* Flow-style YAML ({...}, [...]) so a helper fits at any indentation without sprig's nindent. */ -}}
{{- define "fairgate.fullname" -}}{{ .Release.Name }}-fairgate{{- end -}}
{{- define "fairgate.secret" -}}{{ if .Values.secret.name }}{{ .Values.secret.name }}{{ else }}{{ .Release.Name }}-fairgate{{ end }}{{- end -}}
{{- define "fairgate.selector" -}}
{app.kubernetes.io/name: fairgate, app.kubernetes.io/instance: {{ .Release.Name }}}
{{- end -}}
{{- define "fairgate.labels" -}}
{app.kubernetes.io/name: fairgate, app.kubernetes.io/instance: {{ .Release.Name }}, app.kubernetes.io/version: {{ printf "%q" .Chart.AppVersion }}, app.kubernetes.io/managed-by: {{ .Release.Service }}}
{{- end -}}
{{- define "fairgate.env" -}}
[{name: FAIRGATE_DATABASE_URL, valueFrom: {secretKeyRef: {name: {{ template "fairgate.secret" . }}, key: databaseUrl}}},
 {name: FAIRGATE_REDIS_URL, valueFrom: {secretKeyRef: {name: {{ template "fairgate.secret" . }}, key: redisUrl}}},
 {name: FAIRGATE_OPS_TOKEN, valueFrom: {secretKeyRef: {name: {{ template "fairgate.secret" . }}, key: opsToken}}}]
{{- end -}}
