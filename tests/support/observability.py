"""Where the deployable observability files live (deploy/observability and its copies), for
the deploy tests of the dashboards, the rules and the Kubernetes monitoring component."""

from __future__ import annotations

from typing import Any

import yaml

from tests.support.k8s import K8S, ROOT

OBSERVABILITY = ROOT / "deploy" / "observability"
RULES = OBSERVABILITY / "prometheus" / "pdserve-alerts.yml"
RULE_TESTS = OBSERVABILITY / "prometheus" / "pdserve-alerts.test.yml"
DASHBOARD = OBSERVABILITY / "grafana" / "pdserve-dashboard.json"
PROVISIONING = OBSERVABILITY / "grafana" / "provisioning"
COMPOSE_DIR = ROOT / "deploy" / "compose"
MONITORING = K8S / "components" / "monitoring"
SYNC = "deploy/observability/sync-k8s.sh"
"""What copies the rules and the dashboard into the monitoring component."""


def load_rules() -> dict[str, Any]:
    """The Prometheus rule file (recording and alert groups)."""
    doc: dict[str, Any] = yaml.safe_load(RULES.read_text())
    return doc
