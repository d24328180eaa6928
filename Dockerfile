# syntax=docker/dockerfile:1
# Fulcrum daemon image: build a wheel, then install only it and its runtime dependencies
# into a slim image that runs as a non-root user.

FROM python:3.11-slim-bookworm AS build
WORKDIR /src
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
COPY pyproject.toml README.md ./
COPY src ./src
RUN pip wheel --no-deps --wheel-dir /wheels . \
 && pip wheel --wheel-dir /wheels \
      "grpcio>=1.85.1" "grpcio-health-checking>=1.85.1" "grpcio-reflection>=1.85.1" \
      "protobuf>=6.31" "uvloop>=0.19" "prometheus-client>=0.20" "structlog>=24.1" \
      "pyyaml>=6.0" "pydantic>=2.7" "numpy>=1.26"

FROM python:3.11-slim-bookworm AS runtime
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
RUN groupadd --system --gid 10001 fulcrum \
 && useradd --system --uid 10001 --gid fulcrum --home-dir /var/lib/fulcrum --create-home fulcrum
COPY --from=build /wheels /wheels
RUN pip install --no-index --find-links=/wheels "fulcrum==0.1.0" && rm -rf /wheels
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
