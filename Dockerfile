# One image for every globalkv role: `gateway`, `indexer`, `epp`, `sidecar`, `engine`
# (emulated), `bootstrap`, `up`, `doctor` — the command is the container's first argument
# (see docker-compose.yml and deploy/kubernetes).
#
#   docker build -t globalkv .
#   docker run --rm -p 8000:8000 globalkv up --host 0.0.0.0 --port 8000
#
# The gateway's request path is compiled with mypyc (docs/compiled.md): about half the CPU
# per request. `--build-arg COMPILE=0` builds it pure Python instead (no compiler in the
# build stage, a few minutes quicker to build).
# `--build-arg EXTRAS=…` lists the extras installed beside the services' dependencies. The
# default, `kubernetes,epp`, is what the Kubernetes manifests run (pod discovery, the
# endpoint picker's gRPC; docs/kubernetes.md, step 1), and tests/deploy checks every
# command they deploy with it. A value replaces the list: `EXTRAS=kubernetes,epp,bench`
# adds `globalkv bench replay` (numpy, matplotlib); `EXTRAS=` builds what
# docker-compose.yml runs and nothing more (about 27 MB less); `envoy` would add the Envoy
# binary, which no picker runs. Health checks are per role (each listens on its own
# ports), so they live in docker-compose.yml, as the official images leave them to the
# compose file too.

# Install globalkv and its dependencies into a virtual environment in a throw-away stage.
FROM python:3.11-slim AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
RUN python -m venv /opt/globalkv
WORKDIR /src
ARG EXTRAS="kubernetes,epp"
# The dependencies first, read from pyproject.toml and pinned by the lock (constraints.txt,
# refreshed by `bash .ci/lock`), so two builds of one commit install the same software; this
# layer (most of the build's time) stays cached while only the sources change.
COPY pyproject.toml constraints.txt ./
RUN python -c 'import sys, tomllib; p = tomllib.load(open("pyproject.toml", "rb"))["project"]; \
extras = [e for e in sys.argv[1].split(",") if e]; \
print("\n".join(p["dependencies"] + [d for e in extras for d in p["optional-dependencies"][e]]))' \
      "$EXTRAS" > requirements.txt \
 && /opt/globalkv/bin/pip install -c constraints.txt -r requirements.txt
# The sources: README.md and the packages (.dockerignore keeps everything else out).
# COMPILE=1 (the default) builds the gateway's request path compiled with mypyc
# (docs/compiled.md): a C compiler and mypy for the build, neither kept in the image.
COPY . ./
ARG COMPILE=1
RUN if [ "$COMPILE" = 1 ]; then \
      apt-get update -qq && apt-get install -y -qq --no-install-recommends gcc libc6-dev \
      && /opt/globalkv/bin/pip install -c constraints.txt mypy 'setuptools>=77' \
      && GLOBALKV_COMPILE=1 /opt/globalkv/bin/pip install --no-deps --no-build-isolation . \
      && /opt/globalkv/bin/pip uninstall -y mypy mypy_extensions librt pathspec ast-serialize; \
    else \
      /opt/globalkv/bin/pip install --no-deps .; \
    fi \
 && /opt/globalkv/bin/pip check

# The runtime: that environment only (no sources, no build caches), an unprivileged user.
# Everything but the environment comes first, so that a change of sources rebuilds one step.
FROM python:3.11-slim
# A release build names what it was built from (tests/test_release.py keeps VERSION's
# default equal to pyproject.toml's version):
#   docker build --build-arg REVISION=$(git rev-parse HEAD) \
#     --build-arg SOURCE=$(git remote get-url origin) -t globalkv .
ARG VERSION=0.1.0
ARG REVISION=unknown
ARG SOURCE=""
LABEL org.opencontainers.image.title="globalkv" \
      org.opencontainers.image.description="Control plane for prefill/decode disaggregated LLM serving: bootstrap directories, a cluster-wide KV index and a prefix-routing PD gateway." \
      org.opencontainers.image.version="$VERSION" \
      org.opencontainers.image.revision="$REVISION" \
      org.opencontainers.image.source="$SOURCE" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN useradd --system --create-home --uid 10001 globalkv
ENV PATH=/opt/globalkv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
WORKDIR /home/globalkv
# gateway and engines 30000, bootstrap 8998, KV events 5557/5558, indexer 8100, metrics 29000
EXPOSE 30000 8998 5557 5558 8100 29000
USER globalkv
ENTRYPOINT ["globalkv"]
CMD ["--help"]
COPY --from=build /opt/globalkv /opt/globalkv
