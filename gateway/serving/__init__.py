"""The core the entry points share: one gateway's parts built and wired (`service`), an
inference request served from its body to its answer (`inference`), the request ids and
CORS at the client edge (`edge`), and every other route (`app`, `admin`)."""
