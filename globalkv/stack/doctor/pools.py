"""Stage 1: the gateway's worker pools — who can take traffic, and who cannot and why.

The gateway's own view (`GET /workers`: health, circuit, failures, directory state, the
last error and its age) lags by design: a worker that died a second ago is still
`healthy` until enough checks fail. So every worker's `/health` is also asked directly,
and a worker that does not answer is reported even while the gateway still routes to it
(it then relies on retries). A last error younger than `RECENT_SECS` is a warning; an
older one is only shown. A decode that advertises nothing (a vLLM decode, a `globalkv
sidecar` before a decode) has its discovery over with an error (`discovered`, and
`last_error_step` "discovery", in `/workers`): a decode needs nothing discovered to be
routed, so that is shown, not warned about; a prefill needs its KV-event endpoints, and it
stays a warning there, as does a discovery the gateway will try again.
"""

from __future__ import annotations

import asyncio

from globalkv.stack.doctor.reading import Reader, Samples
from globalkv.stack.doctor.report import Stage
from globalkv.stack.views import WorkersView, WorkerView

ROLES = ("prefill", "decode")
RECENT_SECS = 300.0
_NEEDS_TOKEN = (
    "; the gateway has an admin token or API key: give doctor one of them "
    "(--admin-token / GLOBALKV_DOCTOR_ADMIN_TOKEN, --api-key / GLOBALKV_DOCTOR_API_KEY)"
)


def _subject(worker: WorkerView) -> str:
    pod = f" (pod {worker.pod})" if worker.pod and worker.pod != worker.id else ""
    kind = " [vLLM]" if worker.kind == "vllm" else ""
    return f"{worker.role} {worker.id}{kind}{pod}"


def _state(worker: WorkerView) -> str:
    state = f"gateway sees it {worker.health}, circuit {worker.circuit}"
    if worker.consecutive_failures:
        state += f", {worker.consecutive_failures} consecutive failures"
    state += f", {worker.in_flight} in flight"
    if worker.role == "prefill" and worker.directory is not None:
        state += f", directory {worker.directory}"
    return state


def _recent_error(worker: WorkerView) -> bool:
    age = worker.last_error_age_secs
    if worker.last_error is None or _nothing_to_discover(worker):
        return False
    return age is None or age < RECENT_SECS


def _nothing_to_discover(worker: WorkerView) -> bool:
    """A decode whose discovery ended without anything to discover."""
    return worker.role == "decode" and worker.discovered and worker.last_error_step == "discovery"


def _errors(worker: WorkerView) -> str:
    age = worker.last_error_age_secs
    last = "last error" + ("" if age is None else f" ({age:.0f}s ago)")
    error = worker.last_error
    if _nothing_to_discover(worker):
        last, error = "nothing discovered", "a decode needs nothing advertised"
    errors = [
        f"{what}: {text}"
        for what, text in (
            ("health check", worker.health_error),
            ("directory", worker.directory_error),
            (last, error),
        )
        if text
    ]
    return "; ".join(errors)


async def check_pools(
    stage: Stage, gateway_reader: Reader, reader: Reader, gateway: str
) -> WorkersView | None:
    """Judge every worker; returns the gateway's listing for the later stages.

    `gateway_reader` carries the gateway's API key or admin token; the workers are asked
    without it.
    """
    live = await gateway_reader.healthy(f"{gateway}/health")
    if live is not None:
        stage.fail("gateway", f"{gateway}/health {live}")
        return None
    listing = await gateway_reader.view(f"{gateway}/workers", WorkersView)
    if isinstance(listing, str):
        refused = listing.startswith("answered HTTP 401")
        stage.fail("gateway", f"{gateway}/workers {listing}" + (_NEEDS_TOKEN if refused else ""))
        return None
    answers = await asyncio.gather(*(reader.healthy(f"{w.url}/health") for w in listing.workers))
    for worker, problem in zip(listing.workers, answers, strict=True):
        errors = _errors(worker)
        detail = _state(worker) + (f"; {errors}" if errors else "")
        if problem is not None:
            stage.fail(_subject(worker), f"/health {problem}; {detail}")
        elif not worker.eligible:
            stage.fail(_subject(worker), f"not eligible for traffic: {detail}")
        elif (
            worker.consecutive_failures
            or worker.health_error
            or worker.directory_error
            or _recent_error(worker)
        ):
            stage.warn(_subject(worker), detail)
        else:
            stage.ok(_subject(worker), detail)
    for role in ROLES:
        workers = [w for w in listing.workers if w.role == role]
        eligible = sum(w.eligible for w in workers)
        if not workers:
            stage.fail(f"{role} pool", "empty: the gateway has no worker of this role")
        elif not eligible:
            stage.fail(f"{role} pool", f"none of {len(workers)} eligible: requests get 503")
        else:
            stage.ok(f"{role} pool", f"{eligible} of {len(workers)} eligible")
    samples = await gateway_reader.samples(f"{gateway}/metrics")
    if isinstance(samples, Samples):
        report_upstream_failures(stage, samples)
    return listing


def report_upstream_failures(stage: Stage, samples: Samples) -> None:
    """Failed calls to workers since the gateway started, by role and reason."""
    for role in ROLES:
        counts = {
            labels.get("reason", "?"): int(value)
            for labels, value in samples.matching(
                "globalkv_gateway_upstream_failures_total", role=role
            )
            if value > 0
        }
        if counts:
            reasons = ", ".join(f"{reason} ×{n}" for reason, n in sorted(counts.items()))
            stage.warn(f"{role} calls", f"failed since the gateway started: {reasons}")
