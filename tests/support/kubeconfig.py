"""A kubeconfig for commands whose `--check` looks for Kubernetes credentials where no
cluster is: it names an API server nobody dials (a check opens no socket)."""

from __future__ import annotations

from pathlib import Path

SERVER = "https://k8s.example:6443"
CONTEXT = "lab-admin"


def write_kubeconfig(path: Path) -> Path:
    path.write_text(
        "apiVersion: v1\n"
        "kind: Config\n"
        f'clusters: [{{name: lab, cluster: {{server: "{SERVER}"}}}}]\n'
        "users: [{name: me, user: {token: not-a-real-token}}]\n"
        f"contexts: [{{name: {CONTEXT}, context: {{cluster: lab, user: me}}}}]\n"
        f"current-context: {CONTEXT}\n"
    )
    return path
