#!/usr/bin/env bash
# Validates the manifests offline against the Kubernetes OpenAPI schemas bundled in the PyPI package
# kubernetes-validate (strict: unknown fields are errors).
set -euo pipefail
cd "$(dirname "$0")"
python3 -m pip show kubernetes-validate >/dev/null 2>&1 || python3 -m pip install -q kubernetes-validate
kubernetes-validate --strict config.yaml secret.yaml node.yaml coordinator.yaml
