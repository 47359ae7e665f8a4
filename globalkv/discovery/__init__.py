"""Worker discovery: a source of truth (Kubernetes pods by label, or a watched file) as
snapshots of the prefill and decode workers that should exist, for the gateway and other
consumers to reconcile against (`model`).

`kubernetes` holds the pod rules, `kube_watch` watches pods by them (the `kubernetes`
extra) and `kube_source` opens that watch where the extra is installed; `files` follows a
YAML or JSON file. Nothing here imports the gateway: a consumer maps a `DiscoveredWorker`
onto its own worker type.
"""
