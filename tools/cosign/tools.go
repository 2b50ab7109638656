//go:build tools

// Package tools pins cosign, which the end-to-end tests run to check that its signatures
// and wasmctrl's are the same format; build.sh builds it.
package tools

import _ "github.com/sigstore/cosign/v2/cmd/cosign"
