#!/usr/bin/env python3
"""Parse a Prometheus text exposition (stdin) with the reference parser
(prometheus_client.parser) and print its samples as JSON: [{name, labels, value, type}].
Exits non-zero if the text does not parse. Used by tests/observability_e2e.rs."""
import json
import sys

from prometheus_client.parser import text_string_to_metric_families

out = []
for family in text_string_to_metric_families(sys.stdin.read()):
    for s in family.samples:
        out.append({"name": s.name, "labels": s.labels, "value": s.value, "type": family.type})
json.dump(out, sys.stdout)
