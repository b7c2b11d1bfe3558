{{/* Chart name. */}}
{{- define "appliance.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 40 | trimSuffix "-" }}
{{- end }}

{{/*
Full name: the RayCluster's name. 40 characters at most, so that KubeRay's derived names
(`<name>-head-svc`, `<name>-<group>-worker-xxxxx`) stay valid DNS labels. A longer one is
refused, not cut: two releases whose names share their first 40 characters would otherwise
name the same objects. So is one that is no DNS label (a dot, a capital): KubeRay's service
for it could not be created.
*/}}
{{- define "appliance.fullname" -}}
{{- $full := "" }}
{{- if .Values.fullnameOverride }}
{{- $full = .Values.fullnameOverride }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- $full = ternary .Release.Name (printf "%s-%s" .Release.Name $name) (contains $name .Release.Name) }}
{{- end }}
{{- if gt (len $full) 40 }}
{{- fail (printf "the objects' name %q (release name%s) is %d characters: at most 40 (KubeRay derives longer names from it); give a shorter release name or fullnameOverride" $full (ternary "" " + \"-appliance\"" (contains (default .Chart.Name .Values.nameOverride) $full)) (len $full)) }}
{{- end }}
{{- if not (regexMatch "^[a-z]([-a-z0-9]*[a-z0-9])?$" $full) }}
{{- fail (printf "the objects' name %q is not a DNS label (lowercase letters, digits and '-', starting with a letter): KubeRay could not create its head service; give another release name or fullnameOverride" $full) }}
{{- end }}
{{- $full }}
{{- end }}

{{- define "appliance.selectorLabels" -}}
app.kubernetes.io/name: {{ include "appliance.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "appliance.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "appliance.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* Labels of the Ray node pods (head and workers): what the PodMonitor selects. */}}
{{- define "appliance.rayPodLabels" -}}
{{ include "appliance.selectorLabels" . }}
app.kubernetes.io/component: ray
{{- end }}

{{- define "appliance.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "appliance.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "appliance.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/* Parse "<n>Gi" into the integer n, failing with the value's name otherwise. */}}
{{- define "appliance.gibibytes" -}}
{{- $value := toString (index . 1) }}
{{- if not (regexMatch "^[0-9]+Gi$" $value) }}
{{- fail (printf "%s must be a whole number of Gi, like 100Gi (got %q)" (index . 0) $value) }}
{{- end }}
{{- trimSuffix "Gi" $value }}
{{- end }}

{{/*
The chosen GPU-class preset with gpuClassOverrides merged over it, as YAML, plus the derived
shmGi, memoryGi and objectStoreBytes. Use: $gpu := include "appliance.gpu" . | fromYaml
*/}}
{{- define "appliance.gpu" -}}
{{- $class := toString .Values.gpuClass }}
{{- if not (hasKey .Values.gpuClasses $class) }}
{{- fail (printf "gpuClass %q is not one of: %s (or add a preset under gpuClasses)" $class (keys .Values.gpuClasses | sortAlpha | join ", ")) }}
{{- end }}
{{- $gpu := mergeOverwrite (deepCopy (index .Values.gpuClasses $class)) (deepCopy .Values.gpuClassOverrides) }}
{{- range $key := list "instanceType" "gpusPerNode" "cpu" "memory" "shmSize" }}
{{- if not (hasKey $gpu $key) }}
{{- fail (printf "gpuClasses.%s.%s is missing" $class $key) }}
{{- end }}
{{- end }}
{{- $shmGi := include "appliance.gibibytes" (list (printf "gpuClasses.%s.shmSize" $class) $gpu.shmSize) | int64 }}
{{- $memGi := include "appliance.gibibytes" (list (printf "gpuClasses.%s.memory" $class) $gpu.memory) | int64 }}
{{- if lt $memGi (add $shmGi 8) }}
{{- fail (printf "gpuClasses.%s.memory (%s) must exceed shmSize (%s) by at least 8Gi: the memory-backed /dev/shm counts against the pod's memory limit" $class $gpu.memory $gpu.shmSize) }}
{{- end }}
{{- if lt $shmGi 8 }}
{{- fail (printf "gpuClasses.%s.shmSize (%s) must be at least 8Gi" $class $gpu.shmSize) }}
{{- end }}
{{- $_ := set $gpu "class" $class }}
{{- $_ := set $gpu "objectStoreBytes" (mul (sub $shmGi 4) 1073741824 | toString) }}
{{- toYaml $gpu }}
{{- end }}

{{/*
The head's Ray object store in bytes: its /dev/shm (head.shmSize) minus 1 GiB, so that the store
fits in shared memory (Ray's default, 30% of the pod's memory, would not: it would use /tmp).
*/}}
{{- define "appliance.headObjectStoreBytes" -}}
{{- $shmGi := include "appliance.gibibytes" (list "head.shmSize" .Values.head.shmSize) | int64 }}
{{- if lt $shmGi 2 }}
{{- fail (printf "head.shmSize (%s) must be at least 2Gi" .Values.head.shmSize) }}
{{- end }}
{{- mul (sub $shmGi 1) 1073741824 | toString }}
{{- end }}

{{/*
The workers' `ray start --resources` value: worker.customResources plus appliance_trainer_node: 1
(what `appliance train --cluster` places its weight store and trainers by). KubeRay passes
rayStartParams to a shell as `--resources=<value>`, so the JSON goes inside double quotes:
"{\"appliance_trainer_node\":1}".
*/}}
{{- define "appliance.workerResources" -}}
{{- if hasKey .Values.worker.rayStartParams "resources" }}
{{- fail "worker.rayStartParams.resources would replace the chart's appliance_trainer_node resource: put custom resources in worker.customResources instead" }}
{{- end }}
{{- $resources := merge (dict "appliance_trainer_node" 1) (deepCopy .Values.worker.customResources) }}
{{- printf "%q" (toJson $resources) }}
{{- end }}

{{/* One shell word: bare when safe, else single-quoted (single quotes themselves are refused). */}}
{{- define "appliance.shellWord" -}}
{{- $word := toString . }}
{{- if regexMatch "^[A-Za-z0-9_./:=@%+,-]+$" $word }}
{{- $word }}
{{- else if contains "'" $word }}
{{- fail (printf "job argument %q contains a single quote, which the entrypoint cannot carry" $word) }}
{{- else }}
{{- squote $word }}
{{- end }}
{{- end }}

{{/* Whether to render the PodMonitor: forced by monitoring.podMonitor.enabled, else by API. */}}
{{- define "appliance.podMonitorEnabled" -}}
{{- $mode := toString .Values.monitoring.podMonitor.enabled }}
{{- if eq $mode "true" }}true
{{- else if eq $mode "false" }}
{{- else if eq $mode "auto" }}
{{- if .Capabilities.APIVersions.Has "monitoring.coreos.com/v1" }}true{{ end }}
{{- else }}
{{- fail (printf "monitoring.podMonitor.enabled must be auto, true or false (got %q)" $mode) }}
{{- end }}
{{- end }}
