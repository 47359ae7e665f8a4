"""What `globalkv --check` reads on this host, and how it words what it found.

A configuration can be valid and still not start where it runs: a tokenizer path that
holds no tokenizer, Kubernetes discovery with no credentials to reach the API server, a
Redis URL its client cannot use. Start-up reads the same files, so the check reads them
too and fails as start-up would, without opening a socket or starting anything; and it
says what it found, so that a line that silently routes by load, or follows no pods,
says so before it is deployed.
"""

from __future__ import annotations

from pathlib import Path

from globalkv.extras import require
from globalkv.tokenize import HUB_ID, HUB_TOKENIZER_FILES, HFTokenizer, Tokenizer, load_tokenizer


def tokenizer_line(spec: str | None, *, load: bool) -> str:
    """What `--tokenizer spec` gives, checked as start-up reads it.

    A local path must exist (always) and load (with `load`); a Hugging Face id that is no
    local path is read from the Hugging Face cache with `load`, never from the network:
    missing there, start-up downloads it, unless HF_HUB_OFFLINE forbids it, which fails
    here as it would there. Raises ValueError saying why it would not load.
    """
    if spec is None:
        return "none"
    if spec == "byte":
        return "byte (one id per UTF-8 byte: the emulated engines' tokenizer)"
    if not Path(spec).exists() and HUB_ID.fullmatch(spec):
        return _hub_line(spec, load=load)
    if not Path(spec).exists():
        raise ValueError(f"tokenizer {spec}: no such file or directory")
    if not load:
        return spec
    tokenizer = load_tokenizer(spec)
    return f"{spec} ({_what(tokenizer)})"


def _hub_line(model_id: str, *, load: bool) -> str:
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    where = f"the Hugging Face cache {constants.HF_HUB_CACHE}"
    if not load:
        return f"{model_id} (Hugging Face id)"
    try:
        folder = snapshot_download(
            model_id, allow_patterns=HUB_TOKENIZER_FILES, local_files_only=True
        )
    except LocalEntryNotFoundError:
        if constants.HF_HUB_OFFLINE:
            raise ValueError(
                f"tokenizer {model_id}: not in {where}, and HF_HUB_OFFLINE forbids "
                "downloading it: download it where there is a network, or give a local path"
            ) from None
        return (
            f"{model_id} (Hugging Face id, not in {where} yet: start-up downloads its "
            "tokenizer files, so the Hub must be reachable from here)"
        )
    tokenizer = load_tokenizer(folder)
    return f"{model_id} (Hugging Face id, from {where}; {_what(tokenizer)})"


def _what(tokenizer: Tokenizer) -> str:
    if isinstance(tokenizer, HFTokenizer) and not tokenizer.has_chat_template:
        return "loaded; it has no chat template, so chat requests are not tokenized"
    return "loaded"


def kubernetes_credentials() -> str:
    """Where Kubernetes discovery's client will find the API server and its credentials,
    as lightkube looks for them (the in-cluster service account, else the file KUBECONFIG
    names, else ~/.kube/config), read without connecting. `MissingExtra` without the
    `kubernetes` extra; ValueError when there are none."""
    require("Kubernetes service discovery", "kubernetes", "lightkube")
    import yaml
    from lightkube import KubeConfig
    from lightkube.core.exceptions import ConfigError

    try:
        config = KubeConfig.from_env().get()
    except KeyError as missing:
        raise ValueError(
            f"Kubernetes service discovery: a service account token is mounted but {missing} "
            "is not set, so the API server's address is unknown"
        ) from None
    except (ConfigError, OSError, yaml.YAMLError, ValueError, TypeError, AttributeError) as exc:
        raise ValueError(
            "Kubernetes service discovery has no credentials: no service account token in "
            f"this pod and no usable kubeconfig (KUBECONFIG or ~/.kube/config): {exc}"
        ) from None
    assert config is not None  # `get` without a default raises rather than return None
    server = config.cluster.server
    if config.fname is None:
        return f"the pod's service account, API server {server}"
    return f"kubeconfig {config.fname}, context {config.context_name}, API server {server}"
