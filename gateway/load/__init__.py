"""Each worker's load as this gateway sees it, in one place: requests in flight, the prefill
work queued and how far each prefill is estimated to have got through it, and the prompts
sent to each prefill that the index may not show yet.

The legs, the endpoint picker and the simulator change it, each through the tracker's
verbs; the policies, the decider and flow control read it through `Candidate` snapshots.
"""
