# One image for every globalkv role: `indexer`, `gateway`, `engine` (emulated), `bootstrap`,
# `up`, `doctor` — the command is the container's first argument (see docker-compose.yml).
#
#   docker build -t globalkv .
#   docker run --rm -p 8000:8000 globalkv up --host 0.0.0.0 --port 8000

# Install globalkv and its dependencies into a virtual environment in a throw-away stage.
FROM python:3.11-slim AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/globalkv
WORKDIR /src
COPY pyproject.toml README.md ./
COPY bootstrap ./bootstrap
COPY globalkv ./globalkv
COPY gateway ./gateway
COPY enginesim ./enginesim
COPY bench ./bench
RUN /opt/globalkv/bin/pip install --no-cache-dir .

# The runtime: that environment only (no sources, no build caches), an unprivileged user.
FROM python:3.11-slim
ENV PATH=/opt/globalkv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
COPY --from=build /opt/globalkv /opt/globalkv
RUN useradd --system --create-home --uid 10001 globalkv
USER globalkv
WORKDIR /home/globalkv
# gateway and engines 30000, bootstrap 8998, KV events 5557/5558, indexer 8100, metrics 29000
EXPOSE 30000 8998 5557 5558 8100 29000
ENTRYPOINT ["globalkv"]
CMD ["--help"]
