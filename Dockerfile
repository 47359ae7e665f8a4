# One image for every globalkv role: `indexer`, `gateway`, `engine` (emulated), `bootstrap`,
# `up`, `doctor` — the command is the container's first argument (see docker-compose.yml).
#
#   docker build -t globalkv .
#   docker run --rm -p 8000:8000 globalkv up --host 0.0.0.0 --port 8000
#
# `--build-arg EXTRAS=bench` adds `globalkv bench replay` (numpy, matplotlib) to the image;
# without it the image holds what the services need and nothing more. Health checks are
# per role (each listens on its own ports), so they live in docker-compose.yml, as the
# official images leave them to the compose file too.

# Install globalkv and its dependencies into a virtual environment in a throw-away stage.
FROM python:3.11-slim AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
RUN python -m venv /opt/globalkv
WORKDIR /src
ARG EXTRAS=""
# The dependencies first, read from pyproject.toml alone: this layer (most of the build's
# time) stays cached while only the sources change.
COPY pyproject.toml ./
RUN python -c 'import sys, tomllib; p = tomllib.load(open("pyproject.toml", "rb"))["project"]; \
extras = [e for e in sys.argv[1].split(",") if e]; \
print("\n".join(p["dependencies"] + [d for e in extras for d in p["optional-dependencies"][e]]))' \
      "$EXTRAS" > requirements.txt \
 && /opt/globalkv/bin/pip install -r requirements.txt
# The sources: README.md and the packages (.dockerignore keeps everything else out).
COPY . ./
RUN /opt/globalkv/bin/pip install --no-deps . && /opt/globalkv/bin/pip check

# The runtime: that environment only (no sources, no build caches), an unprivileged user.
# Everything but the environment comes first, so that a change of sources rebuilds one step.
FROM python:3.11-slim
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
