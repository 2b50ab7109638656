{{- define "wasmctrl.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- /* The chart and its version, as the helm.sh/chart label carries them. */ -}}
{{- define "wasmctrl.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- /*
Every object's labels: Helm's and Kubernetes' recommended ones, and commonLabels. Where a
common label names one of the chart's, the chart's wins: the selectors depend on them.
*/ -}}
{{- define "wasmctrl.labels" -}}
{{- $own := dict
    "helm.sh/chart" (include "wasmctrl.chart" .)
    "app.kubernetes.io/name" (include "wasmctrl.name" .)
    "app.kubernetes.io/instance" .Release.Name
    "app.kubernetes.io/version" .Chart.AppVersion
    "app.kubernetes.io/component" "controller"
    "app.kubernetes.io/part-of" "wasmctrl"
    "app.kubernetes.io/managed-by" .Release.Service -}}
{{- toYaml (merge $own (.Values.commonLabels | default dict)) -}}
{{- end -}}

{{- define "wasmctrl.selectorLabels" -}}
app.kubernetes.io/name: {{ include "wasmctrl.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- /*
The `helm test` pod's selector labels. Not the host's: the Service would send it traffic,
and the PodDisruptionBudget and the replicas' anti-affinity would count it as a replica.
*/ -}}
{{- define "wasmctrl.testSelectorLabels" -}}
app.kubernetes.io/name: {{ include "wasmctrl.name" . }}-test
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "wasmctrl.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else if contains (include "wasmctrl.name" .) .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name (include "wasmctrl.name" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- /* The host's ServiceAccount: the chart's, or an existing one named in values. */ -}}
{{- define "wasmctrl.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "wasmctrl.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name is required when serviceAccount.create is false: name the existing ServiceAccount the host runs as" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- /* The host's ServiceAccount as a binding's subject. */ -}}
{{- define "wasmctrl.subject" -}}
- kind: ServiceAccount
  name: {{ include "wasmctrl.serviceAccountName" . }}
  namespace: {{ .Release.Namespace }}
{{- end -}}

{{- /* The image: pinned by digest when one is given, else by tag (default: appVersion). */ -}}
{{- define "wasmctrl.image" -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) -}}
{{- end -}}
{{- end -}}

{{- /*
The host's rules on what lives beside the parents: cluster-wide (clusterrole.yaml) when it
watches every namespace, in watchNamespace only (watch-role.yaml) when it does not.
*/ -}}
{{- define "wasmctrl.watchedRules" -}}
# A team's NamespacedReconcilePolicies: watched, finalizers patched, status copied back.
- apiGroups: ["wasmctrl.dev"]
  resources: ["namespacedreconcilepolicies"]
  verbs: ["get", "list", "watch", "patch"]
- apiGroups: ["wasmctrl.dev"]
  resources: ["namespacedreconcilepolicies/status"]
  verbs: ["get", "patch"]
# Events on the parents of policies that act as the host.
- apiGroups: ["events.k8s.io"]
  resources: ["events"]
  verbs: ["create", "patch"]
{{- with .Values.rbac.extraRules }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- /* Non-empty when extraCA names a ConfigMap or a Secret. */ -}}
{{- define "wasmctrl.extraCA" -}}
{{- if or .Values.extraCA.configMapName .Values.extraCA.secretName -}}true{{- end -}}
{{- end -}}

{{- /*
The addresses the NetworkPolicy admits as the API server's, one CIDR a line: those given in
networkPolicy.apiServerCidrs, else the `kubernetes` Service's endpoints as the cluster has them
when Helm installs or upgrades (`lookup`; `helm template` without `--dry-run=server` finds
none). A control plane whose addresses change later needs a `helm upgrade`, or the values set.
*/ -}}
{{- define "wasmctrl.apiServerCidrs" -}}
{{- $cidrs := .Values.networkPolicy.apiServerCidrs -}}
{{- if not $cidrs -}}
{{- $slices := lookup "discovery.k8s.io/v1" "EndpointSlice" "default" "" | default dict -}}
{{- range ($slices.items | default list) -}}
{{- if eq (index (.metadata.labels | default dict) "kubernetes.io/service-name" | default "") "kubernetes" -}}
{{- range (.endpoints | default list) -}}
{{- range (.addresses | default list) -}}
{{- $cidrs = append $cidrs (printf "%s/%s" . (ternary "128" "32" (contains ":" .))) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- range ($cidrs | uniq) }}
{{ . }}
{{- end -}}
{{- end -}}

{{/* Non-empty when any plugin verification value is set. */}}
{{- define "wasmctrl.verification" -}}
{{- with .Values.verification -}}
{{- if or .policy .keylessTrustRoots .rekorPublicKeys -}}true{{- end -}}
{{- end -}}
{{- end -}}

{{- /* The webhook Secret's name. */ -}}
{{- define "wasmctrl.webhookSecret" -}}
{{- .Values.webhooks.secretName | default (printf "%s-webhook-tls" (include "wasmctrl.fullname" .)) -}}
{{- end }}
