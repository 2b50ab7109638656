//go:build tools

// Package tools pins the OCI registry (CNCF distribution) the end-to-end tests push plugins
// to and the host pulls them from.
package tools

import _ "github.com/distribution/distribution/v3/cmd/registry"
