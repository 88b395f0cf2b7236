# syntax=docker/dockerfile:1
# AdaPtis images, two targets from one file:
#   docker build --target operator -t adaptis/operator:0.1.0 .   # kopf + Kubernetes client, no torch
#   docker build --target worker   -t adaptis/worker:0.1.0 .     # torch (constraints.txt's pin)
# Both install into /opt/adaptis with deploy/install-venv.sh and every package pinned in
# deploy/constraints/<target>.txt; both run as the unprivileged numeric user 10001:10001 (the
# chart's runAsUser and worker.runAsUser: Pod Security `restricted` checks runAsNonRoot against a
# number) with `adaptis` as the entry point. The operator runs worker and profiler pods with a
# read-only root filesystem and HOME (/home/adaptis) and /tmp on emptyDirs
# (docs/pod-security.md), so nothing here may expect to write into the image.
# Pin the base by digest in a release pipeline (python:3.11.13-slim-bookworm@sha256:...).
ARG PYTHON_IMAGE=python:3.11.13-slim-bookworm

FROM ${PYTHON_IMAGE} AS base
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/adaptis \
    PATH=/opt/adaptis/bin:$PATH
RUN groupadd --system --gid 10001 adaptis \
 && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
      --shell /usr/sbin/nologin adaptis

# The build stages see only what the package needs (.dockerignore keeps the rest out).
# Dependencies first, from the pins alone, each target's venv in a layer of its own; the package
# is installed over it from a bind mount of the source. So a change to adaptis/ re-runs only
# that last step and adds a layer of a few hundred kB, instead of copying the worker's gigabytes
# of torch and CUDA libraries into a new layer.
FROM base AS deps
WORKDIR /src
COPY deploy/install-venv.sh deploy/install-venv.sh
COPY deploy/constraints/ deploy/constraints/

FROM deps AS deps-operator
RUN sh deploy/install-venv.sh /opt/adaptis operator --deps-only

FROM deps AS deps-worker
RUN sh deploy/install-venv.sh /opt/adaptis worker --deps-only

FROM deps AS source
COPY pyproject.toml constraints.txt README.md ./
COPY adaptis/ adaptis/

FROM base AS operator
COPY --from=deps-operator /opt/adaptis /opt/adaptis
# buildah (1.28) keys its layer cache on the RUN line, not on what the bind mount holds, so
# hack/realnode/build-images.sh passes the source's digest here; BuildKit needs none.
ARG SOURCE_DIGEST=""
# (rw: pip builds the package in its source tree; what it writes there is thrown away)
RUN --mount=type=bind,from=source,source=/src,target=/src,rw \
    cd /src && sh deploy/install-venv.sh /opt/adaptis operator /src  # source: ${SOURCE_DIGEST}
USER 10001:10001
# 8080: kopf's liveness endpoint (/healthz); 8000: the operator's metrics, when enabled.
EXPOSE 8080 8000
ENTRYPOINT ["adaptis"]
CMD ["operator", "--all-namespaces", "--liveness", "http://0.0.0.0:8080/healthz"]

FROM base AS worker
COPY --from=deps-worker /opt/adaptis /opt/adaptis
# buildah (1.28) keys its layer cache on the RUN line, not on what the bind mount holds, so
# hack/realnode/build-images.sh passes the source's digest here; BuildKit needs none.
ARG SOURCE_DIGEST=""
RUN --mount=type=bind,from=source,source=/src,target=/src,rw \
    cd /src && sh deploy/install-venv.sh /opt/adaptis worker /src  # source: ${SOURCE_DIGEST}
USER 10001:10001
# 9400: Prometheus metrics (/metrics); 29500: torch.distributed rendezvous (MASTER_PORT).
EXPOSE 9400 29500
ENTRYPOINT ["adaptis"]
CMD ["worker", "--config", "/etc/adaptis/worker.json"]
