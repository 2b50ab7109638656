//go:build tools

// Package tools pins the Helm CLI the tests lint and render the chart with.
package tools

import _ "helm.sh/helm/v3/cmd/helm"
