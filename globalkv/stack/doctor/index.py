"""Stage 3: the index — does it follow every prefill, and how fresh is what it knows?

Per pod the indexer reports its ingest state (`GET /v1/pods`): subscribed, resyncing, and
per DP-rank source the last seq applied, when, and how many resets and dropped events it
took. A pod that is not followed, or is resyncing, makes prefix routing blind to that
pod's cache; resets and drops say events were lost and repaired. An idle pod publishes
nothing, so an old last event is shown, not judged: the probe stage measures how long a
fresh request's blocks take to become visible.
"""

from __future__ import annotations

from globalkv.stack.doctor.reading import Reader
from globalkv.stack.doctor.report import Stage
from globalkv.stack.views import PodsView, PodView, SourceView, WorkersView

SourceKey = tuple[str, int]


def applied_counts(pods: PodsView) -> dict[SourceKey, int]:
    """Batches applied so far per (pod, dp rank): compared before and after the probe."""
    return {
        (pod.id, source.dp_rank): source.applied
        for pod in pods.pods
        if pod.state is not None
        for source in pod.state.sources
    }


def _age(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.1f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}min"
    return f"{seconds / 3600:.1f}h"


def _source(source: SourceView, now: float) -> str:
    if source.last_seq is None:
        return f"dp{source.dp_rank}: no events yet"
    age = "" if source.last_applied_at is None else f" {_age(now - source.last_applied_at)} ago"
    return (
        f"dp{source.dp_rank}: seq {source.last_seq}{age}, {source.applied} batches, "
        f"{source.resets} resets, {source.drops} dropped, queue {source.queue_depth}"
    )


def _judge(stage: Stage, pod: PodView, now: float) -> None:
    subject = f"pod {pod.id}" + (f" ({pod.model})" if pod.model else "")
    state = pod.state
    if state is None:
        stage.fail(subject, "registered, but the indexer reports no ingest state for it")
        return
    if not state.subscribed:
        stage.fail(subject, "not subscribed to its KV events: its cache is invisible")
        return
    if state.resyncing:
        stage.fail(subject, "resyncing after the index lost data: lookups answer 503 meanwhile")
        return
    if not state.sources:
        stage.ok(subject, "subscribed; no events yet")
        return
    summary = "; ".join(_source(s, now) for s in state.sources)
    if any(s.resets or s.drops for s in state.sources):
        stage.warn(subject, f"{summary} (events were lost and repaired)")
    else:
        stage.ok(subject, summary)


async def check_index(
    stage: Stage, reader: Reader, indexer: str, workers: WorkersView | None, now: float
) -> PodsView | None:
    response = await reader.get(f"{indexer}/health")
    if isinstance(response, str):
        stage.fail("indexer", f"{indexer}/health {response}")
        return None
    if response.status_code == 503:
        stage.fail("indexer", f"resyncing after data loss: {response.text.strip()[:200]}")
    elif response.status_code != 200:
        stage.fail("indexer", f"{indexer}/health answered HTTP {response.status_code}")
        return None
    pods = await reader.view(f"{indexer}/v1/pods", PodsView)
    if isinstance(pods, str):
        stage.fail("indexer", f"{indexer}/v1/pods {pods}")
        return None
    if not pods.pods:
        stage.warn("indexer", "follows no pod: nothing can be routed by prefix")
    for pod in pods.pods:
        _judge(stage, pod, now)
    if workers is not None:
        followed = {p.id for p in pods.pods}
        for worker in workers.workers:
            if worker.role == "prefill" and worker.pod not in followed:
                stage.fail(
                    f"prefill {worker.id}",
                    f"its pod {worker.pod} is not followed by the indexer: routing cannot see "
                    f"its cache ({worker.last_error or 'not registered by the gateway'})",
                )
    return pods
