# syntax=docker/dockerfile:1
# Fulcrum daemon image: build the wheel set of pyproject.toml (the package and every runtime
# dependency it declares), then install only that set, offline, into a slim image that runs
# as a non-root user. tests/deploy/test_image.py runs the same two stages without Docker.

FROM python:3.11-slim-bookworm AS build
WORKDIR /src
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
COPY pyproject.toml README.md ./
COPY src ./src
RUN pip wheel --wheel-dir /wheels .

FROM python:3.11-slim-bookworm AS runtime
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
RUN groupadd --system --gid 10001 fulcrum \
 && useradd --system --uid 10001 --gid fulcrum --home-dir /var/lib/fulcrum --create-home fulcrum
COPY --from=build /wheels /wheels
RUN pip install --no-index --find-links=/wheels "fulcrum-moe==0.1.0" && rm -rf /wheels
COPY deploy/fulcrum.yaml /etc/fulcrum/fulcrum.yaml
USER 10001:10001
WORKDIR /var/lib/fulcrum
# 50051: gRPC API, health and reflection; 9464: Prometheus metrics.
EXPOSE 50051 9464
STOPSIGNAL SIGTERM
HEALTHCHECK --interval=10s --timeout=3s --start-period=5s --retries=3 \
  CMD ["fulcrum", "health", "--target", "127.0.0.1:50051", "--timeout", "2"]
ENTRYPOINT ["fulcrum"]
CMD ["serve", "--config", "/etc/fulcrum/fulcrum.yaml"]
