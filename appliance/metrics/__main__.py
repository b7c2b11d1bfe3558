"""`python -m appliance.metrics`: every metric as the table in docs/metrics.md (names.py)."""

from appliance.metrics.names import markdown_table

print(markdown_table())
